"""The BabyAI agent on minigrid's real levels: the view in words, action names and
parsing, the bot, the progress by its plan, the level option, conformance and a short
training run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from llamagym_babyai.agent import ACTIONS, BabyAIAgent
from llamagym_babyai.env import make_level
from llamagym_babyai.text import describe_view, where

from llamagym.errors import ConfigError
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import assert_agent_conforms, tiny_agent
from llamagym.training.loop.trainer import Trainer

WALL, BALL, KEY, DOOR = 2, 6, 5, 4
RED, GREEN, BLUE = 0, 1, 2


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny forwards on a shared machine run several times faster on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_registered_through_its_entry_point() -> None:
    registration = get_plugins().registry.get("agent", "babyai")
    assert registration.distribution == "llamagym-babyai"
    assert registration.load() is BabyAIAgent


def test_plugin_and_agent_modules_do_not_import_minigrid() -> None:
    code = (
        "import sys, llamagym_babyai.plugin, llamagym_babyai.agent;"
        "print('minigrid' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# -- the view in words -------------------------------------------------------------------
def _view(*things: tuple[int, int, int, int, int]) -> np.ndarray:
    image = np.ones((7, 7, 3), dtype=np.uint8)  # every cell empty (object 1)
    for x, y, kind, colour, state in things:
        image[x, y] = (kind, colour, state)
    return image


@pytest.mark.parametrize(
    ("dx", "forward", "words"),
    [(-2, 1, "2 steps left and 1 step forward"), (0, 3, "3 steps forward"),
     (1, 0, "1 step right")],
)
def test_where(dx: int, forward: int, words: str) -> None:
    assert where(dx, forward) == words


def test_the_view_says_things_nearest_first_and_the_nearest_wall_each_way() -> None:
    image = _view(
        (1, 5, BALL, RED, 0),  # 2 left, 1 forward
        (3, 3, WALL, 0, 0), (3, 2, WALL, 0, 0),  # walls ahead: the nearer one is said
        (0, 6, WALL, 0, 0),  # beside, on the left
        (5, 1, WALL, 0, 0),  # neither ahead nor beside: not said
        (4, 6, DOOR, BLUE, 2),
        (3, 6, KEY, GREEN, 0),  # the agent's own cell: what it carries
    )
    assert describe_view(image) == [
        "You see a locked blue door 1 step right",
        "You see a red ball 2 steps left and 1 step forward",
        "You see a wall 3 steps forward",
        "You see a wall 3 steps left",
        "You carry a green key",
    ]
    assert describe_view(_view()) == ["You see nothing but the floor"]


def test_a_real_level_in_words() -> None:
    agent = tiny_agent(BabyAIAgent)
    env = agent.make_env()
    observation, info = env.reset(seed=1)
    text = agent.format_observation(observation)
    assert text.splitlines()[0] == "Goal of the agent: go to the purple box"
    assert "You see a purple box 1 step left and 1 step forward" in text.splitlines()
    assert info["bot_action"] == ACTIONS.index("go forward")
    assert env.action_space.n == 6


# -- actions, parsing, options ---------------------------------------------------------
@pytest.mark.parametrize(
    ("reply", "action"),
    [('{"action": "pick up"}', "pick up"), ("turn right", "turn right"), ("forward", "go forward"),
     ("Open.", "toggle"), ("pickup the key", "pick up"), ("I will drop it", "drop"),
     ("dance", None)],
)
def test_reply_parsing(reply: str, action: str | None) -> None:
    agent = tiny_agent(BabyAIAgent, rollout={"mode": "generate"})
    index = agent.plugins.extract_action(agent, reply, ACTIONS)
    assert (ACTIONS[index] if index is not None else None) == action


def test_the_level_is_an_option_and_a_wrong_one_is_named() -> None:
    agent = tiny_agent(BabyAIAgent, agent={"level": "BabyAI-PickupLoc-v0"})
    observation, _ = agent.make_env().reset(seed=0)
    assert observation["mission"].startswith("pick up")
    with pytest.raises(ConfigError, match="agent.level"):
        tiny_agent(BabyAIAgent, agent={"level": "MiniGrid-Empty-5x5-v0"})
    with pytest.raises(ConfigError, match="not one of the .* BabyAI levels.*e.g. BabyAI-GoTo"):
        tiny_agent(BabyAIAgent, agent={"level": "BabyAI-Qqqqqqqqqqqqqqqqqqqqqq-v0"}).make_env()
    with pytest.raises(ConfigError, match="closest: BabyAI-GoToLocal-v0"):
        tiny_agent(BabyAIAgent, agent={"level": "BabyAI-GoToLocl-v0"}).make_env()


def test_the_bot_completes_the_level_and_random_play_does_not() -> None:
    agent = tiny_agent(BabyAIAgent, rollout={"num_envs": 2})
    bot = evaluate_baseline(agent, "bot", 6)
    assert bot.outcomes == {"success": 1.0, "failure": 0.0} and bot.mean > 0.8
    random_play = evaluate_baseline(agent, "random", 6)
    assert random_play.mean < bot.mean


# -- the progress by the bot's plan ----------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_following_the_bot_gains_one_a_step_down_to_a_plan_of_none(seed: int) -> None:
    env = make_level("BabyAI-GoToLocal-v0")
    _, info = env.reset(seed=seed)
    start = info["bot_plan_length"]
    assert info["progress"] == 0 and isinstance(start, int) and start > 0
    gained, terminated, reward = [], False, 0.0
    while not terminated:
        _, reward, terminated, truncated, info = env.step(info["bot_action"])
        gained.append(info["progress"])
        assert not truncated
    assert reward > 0 and info["bot_plan_length"] == 0  # the mission done: nothing left
    assert gained == [1] * start  # the plan was the bot's own way, step for step
    assert sum(gained) == start - info["bot_plan_length"]


def test_a_turn_away_from_the_plan_loses_and_turning_back_regains_it() -> None:
    env = make_level("BabyAI-GoToLocal-v0")
    _, info = env.reset(seed=1)  # the purple box is 1 step left and 1 step forward
    start = info["bot_plan_length"]
    assert (start, info["bot_action"]) == (2, ACTIONS.index("go forward"))
    _, _, _, _, info = env.step(ACTIONS.index("turn right"))  # the box behind, to the left
    assert info["progress"] == -1 and info["bot_plan_length"] == start + 1
    assert info["bot_action"] == ACTIONS.index("turn left")  # the bot undoes it
    _, _, _, _, info = env.step(ACTIONS.index("turn left"))
    assert info["progress"] == 1 and info["bot_plan_length"] == start  # a detour undone


def test_a_plan_is_played_on_its_own_clock() -> None:
    """A level scores a mission done late near 0, and past 1.1 x max_steps below it: a
    plan measured late in an episode is still a plan (the copy's clock starts at 0)."""
    env = make_level("BabyAI-GoToLocal-v0")
    _, info = env.reset(seed=1)
    env.unwrapped.step_count = 2 * env.unwrapped.max_steps  # as if very late
    _, _, _, truncated, info = env.step(info["bot_action"])
    assert truncated and info["progress"] == 1 and info["bot_plan_length"] == 1


@pytest.mark.parametrize("level", ["BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0"])
def test_random_play_sums_to_the_plans_and_the_level_is_not_touched(level: str) -> None:
    """The plan is played on copies: a level with progress plays as one without."""
    measured, plain = make_level(level), make_level(level, progress=False)
    rng = np.random.default_rng(0)
    for seed in range(3):
        observation, info = measured.reset(seed=seed)
        plain_observation, plain_info = plain.reset(seed=seed)
        assert plain_info["bot_plan_length"] is None and plain_info["progress"] == 0
        start, total, done = info["bot_plan_length"], 0, False
        while not done:
            action = int(rng.integers(6))
            observation, reward, terminated, truncated, info = measured.step(action)
            plain_observation, *plain_rest, plain_info = plain.step(action)
            assert np.array_equal(observation["image"], plain_observation["image"])
            assert [reward, terminated, truncated] == plain_rest
            assert plain_info["progress"] == 0 and plain_info["bot_action"] == info["bot_action"]
            assert isinstance(info["progress"], int)
            total += info["progress"]
            done = terminated or truncated
        assert total == start - info["bot_plan_length"]


def test_the_agent_plans_only_where_the_progress_is_rewarded() -> None:
    _, info = tiny_agent(BabyAIAgent).make_env().reset(seed=1)
    assert info["bot_plan_length"] > 0 and info["progress"] == 0
    off = tiny_agent(BabyAIAgent, rollout={"progress_reward": 0}).make_env()
    off.reset(seed=1)
    _, _, _, _, info = off.step(ACTIONS.index("go forward"))
    assert info["bot_plan_length"] is None and info["progress"] == 0


def test_conforms() -> None:
    results = assert_agent_conforms(BabyAIAgent, name="babyai", episodes=1,
                                    config={"agent": {"max_episode_steps": 16}})
    assert all(result.status == "pass" for result in results)


def test_short_training_run_changes_every_trainable_parameter(tmp_path) -> None:
    agent = tiny_agent(
        BabyAIAgent,
        agent={"max_episode_steps": 6},
        # Generate mode: the untrained model's unreadable replies cost the invalid-reply
        # penalty, so returns are not all 0 and the value head has a gradient too.
        rollout={"num_envs": 2, "mode": "generate", "max_new_tokens": 4},
        algorithm={"episodes_per_update": 2, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 2, "minutes": None, "eval_episodes": 0},
        output={"dir": str(tmp_path), "quiet": True},
    )
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters() if p.requires_grad}
    summary = Trainer(agent, agent.session).run()
    assert summary.updates == 1
    unchanged = [
        name
        for name, parameter in agent.policy.named_parameters()
        if parameter.requires_grad and torch.equal(before[name], parameter.detach())
    ]
    assert unchanged == []
