"""The CartPole agent: observation text, token layout, parsing, baselines, a short training."""

from __future__ import annotations

import gymnasium
import numpy as np
import pytest
import torch
from gymnasium.utils.env_checker import check_env
from llamagym_cartpole.agent import (
    LEFT,
    RIGHT,
    CartPoleAgent,
    angle_and_velocity,
    push_toward_lean,
)

from llamagym.errors import ConfigError
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import tiny_agent
from llamagym.training.loop.trainer import Trainer


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny forwards on a shared machine run several times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def agent() -> CartPoleAgent:
    return tiny_agent(CartPoleAgent)


def test_registered_through_its_entry_point() -> None:
    registration = get_plugins().registry.get("agent", "cartpole")
    assert registration.distribution == "llamagym-cartpole"
    assert registration.load() is CartPoleAgent


@pytest.mark.parametrize(
    ("precision", "observation", "text"),
    [
        (
            2,
            [0.0312, -1.2549, 0.0049, 0.3],
            "Cart position=+0.03 velocity=-1.25, pole angle=+0.00 angular velocity=+0.30",
        ),
        (
            3,
            [-2.4, 0.0, -0.2096, -0.0004],
            "Cart position=-2.400 velocity=+0.000, pole angle=-0.210 angular velocity=+0.000",
        ),
        (1, [1.0, -0.04, 0.1, 12.34], "Cart position=+1.0 velocity=+0.0, pole angle=+0.1 "
         "angular velocity=+12.3"),
        (0, [0.4, -0.6, 0.0, 2.5], "Cart position=+0 velocity=-1, pole angle=+0 "
         "angular velocity=+2"),
    ],
)
def test_observation_text(precision: int, observation: list[float], text: str) -> None:
    agent = tiny_agent(CartPoleAgent, agent={"precision": precision})
    rendered = agent.format_observation(np.array(observation, dtype=np.float32))
    assert rendered == text


def test_observation_without_the_cart_holds_the_pole_alone() -> None:
    agent = tiny_agent(CartPoleAgent, agent={"cart": False})
    rendered = agent.format_observation(np.array([1.5, -0.7, -0.031, 0.42], dtype=np.float32))
    assert rendered == "Pole angle=-0.03 angular velocity=+0.42"
    assert agent.format_observation(np.array([-2.0, 3.0, -0.031, 0.42])) == rendered


def test_rounded_zero_has_one_spelling() -> None:
    agent = tiny_agent(CartPoleAgent, agent={"precision": 2})
    assert agent.format_number(-0.001) == "+0.00"
    assert agent.format_number(0.0) == "+0.00"
    assert agent.format_number(-0.006) == "-0.01"


def test_digits_line_up_token_for_token(agent: CartPoleAgent) -> None:
    """Every observation has the same token count and digits at the same positions,
    whatever the signs, because each digit is a token and the sign is its own token."""
    tokenizer = agent.policy.tokenizer
    rng = np.random.default_rng(0)
    layouts = set()
    for _ in range(200):
        observation = rng.uniform(-2.4, 2.4, size=4) * rng.choice([1.0, 0.01], size=4)
        ids = tokenizer(agent.format_observation(observation), add_special_tokens=False)
        pieces = [tokenizer.decode([i]) for i in ids["input_ids"]]
        assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
        layouts.add(tuple("digit" if p.isdigit() else "sign" if p in "+-" else p for p in pieces))
    assert len(layouts) == 1


def test_precision_is_validated() -> None:
    with pytest.raises(ConfigError, match="agent.precision"):
        tiny_agent(CartPoleAgent, agent={"precision": 9})
    with pytest.raises(ConfigError, match="agent.colour: unknown key"):
        tiny_agent(CartPoleAgent, agent={"colour": "red"})


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ('{"action": "RIGHT"}', RIGHT),  # JSON parser
        ('{"action": 0}', LEFT),
        ("LEFT", LEFT),
        ("right", RIGHT),
        ("R", RIGHT),  # the agent's own short answers
        ("l.", LEFT),
        (">", RIGHT),
        ("The pole leans right, so I push RIGHT.", RIGHT),  # regex: last name named
        ("Action: LEFT", LEFT),
        ("up", None),  # nothing legal: the invalid-action policy decides
        ("", None),
        ("R L", None),  # two short answers are no answer
    ],
)
def test_reply_parsing(agent: CartPoleAgent, reply: str, action: str | None) -> None:
    index = agent.plugins.extract_action(agent, reply, list(agent.action_names))
    assert (agent.action_names[index] if index is not None else None) == action


def test_actions_map_to_the_discrete_space(agent: CartPoleAgent) -> None:
    env = agent.make_env()
    assert env.action_space == gymnasium.spaces.Discrete(2)
    assert agent.env_action(0, agent.action_names) == 0  # CartPole: 0 pushes left
    assert agent.env_action(1, agent.action_names) == 1
    env.close()


# CartPole-v1 declares unbounded velocities, which the checker flags; it is Gymnasium's.
@pytest.mark.filterwarnings("ignore:.*Box observation space m")
def test_env_passes_gymnasium_check_env(agent: CartPoleAgent) -> None:
    env = agent.make_env()
    check_env(env.unwrapped, skip_render_check=True)  # rendering needs pygame; not ours
    env.close()


def test_baselines_rank_as_expected(agent: CartPoleAgent) -> None:
    lengths = {name: evaluate_baseline(agent, name, 10).mean for name in agent.baselines}
    assert lengths["random"] < 40
    assert lengths["random"] < lengths["pole-angle"] < 100
    assert lengths["angle+velocity"] == 500.0
    assert push_toward_lean([0, 0, -0.01, 5.0], {}, (), None) == LEFT
    assert angle_and_velocity([0, 0, -0.01, 5.0], {}, (), None) == RIGHT


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_collects_legal_episodes_in_both_modes(mode: str) -> None:
    agent = tiny_agent(
        CartPoleAgent, rollout={"mode": mode, "num_envs": 2, "max_new_tokens": 4}
    )
    envs = [agent.make_env() for _ in range(2)]
    episodes = agent.engine.collect(envs, 2, seeds=[0, 1])
    assert len(episodes) == 2
    for episode in episodes:
        assert episode.length == len(episode.turns) >= 8  # CartPole lasts at least ~8 steps
        assert episode.env_return == episode.length  # +1 per step the pole stays up
        assert all(turn.action_index in (0, 1) for turn in episode.turns)
        assert episode.turns[0].user_text.startswith("Cart position=")
    for env in envs:
        env.close()


def test_short_training_run_changes_every_trainable_parameter(tmp_path) -> None:
    agent = tiny_agent(
        CartPoleAgent,
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": 4, "minibatch_size": 64, "epochs": 1},
        training={"episodes": 4, "minutes": None, "eval_episodes": 0},
        output={"dir": str(tmp_path), "quiet": True},
    )
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters() if p.requires_grad}
    summary = Trainer(agent, agent.session).run()
    assert summary.updates == 1 and summary.episodes == 4
    unchanged = [
        name
        for name, parameter in agent.policy.named_parameters()
        if parameter.requires_grad and torch.equal(before[name], parameter.detach())
    ]
    assert unchanged == []
