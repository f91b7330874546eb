"""The Blackjack plugin: prompts, parsing, baselines, and the classic LlamaGym loop."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from llamagym_blackjack.agent import BlackjackAgent, basic_strategy, hit_below_17

from llamagym import Agent, load_model_and_tokenizer
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import tiny_agent


def test_registered_through_the_plugin() -> None:
    registration = get_plugins().registry.get("agent", "blackjack")
    assert registration.distribution == "llamagym-blackjack"
    assert registration.load() is BlackjackAgent


def test_prompt_text() -> None:
    agent = BlackjackAgent()
    text = agent.format_observation((np.int64(14), np.int64(10), np.int64(1)))
    assert text == "Sum 14, dealer 10, usable ace yes."
    assert "stick" in agent.get_system_prompt() and "hit" in agent.get_system_prompt()



def test_a_pretrained_model_restates_the_sum_at_the_start_of_its_reply() -> None:
    prefix = BlackjackAgent.pretrained_defaults["generate"]["rollout"]["reply_prefix"]
    agent = tiny_agent(BlackjackAgent, rollout={"mode": "generate", "reply_prefix": prefix})
    engine = agent.engine
    slot = engine.new_slot((np.int64(14), np.int64(10), np.int64(1)), {}, None, None)
    [prompt], [filled] = engine.generation_prompts([slot])
    assert filled == '{"sum": 14, "action": "'
    tail = agent.policy.tokenizer.decode(prompt[-len(engine.prompts.reply_prefix_tokens(filled)) :])
    assert tail == filled
    assert "Sum 14, dealer 10" in agent.policy.tokenizer.decode(prompt)

@pytest.mark.parametrize(
    ("reply", "action"),
    [('{"action": "hit"}', 1), ("I stand", 0), ("stay", 0), ("hit me", 1), ("fold", None)],
)
def test_reply_parsing(reply: str, action: int | None) -> None:
    agent = BlackjackAgent()
    assert get_plugins().extract_action(agent, reply, list(agent.action_names)) == action


@pytest.mark.parametrize(
    ("observation", "expected"),
    [
        ((16, 10, 0), "hit"),
        ((16, 6, 0), "stick"),
        ((12, 2, 0), "hit"),
        ((12, 5, 0), "stick"),
        ((11, 10, 0), "hit"),
        ((18, 9, 1), "hit"),
        ((18, 7, 1), "stick"),
        ((17, 1, 0), "stick"),
    ],
)
def test_basic_strategy_table(observation, expected) -> None:
    assert basic_strategy(observation, {}, ["stick", "hit"], None) == expected


def test_baselines_rank_as_known() -> None:
    agent = BlackjackAgent()
    results = {
        name: evaluate_baseline(agent, name, 4000, seed=1).mean
        for name in ("random", "always-stick", "basic-strategy")
    }
    assert results["random"] < results["always-stick"] < results["basic-strategy"]
    assert hit_below_17((16, 2, 0), {}, [], None) == "hit"


class UserBlackjackAgent(Agent):
    """Written the way the original LlamaGym README shows."""

    action_names = ["stay", "hit"]

    def get_system_prompt(self) -> str:
        return "You are an expert blackjack player."

    def format_observation(self, observation) -> str:
        return f"Your current total is {observation[0]}"

    def extract_action(self, response: str):
        return 0 if "stay" in response else 1


def test_classic_llamagym_loop_trains() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    agent = UserBlackjackAgent(
        model,
        tokenizer,
        "cpu",
        generate_config_dict={"max_new_tokens": 8, "do_sample": True, "top_p": 0.9},
        ppo_config_dict={"batch_size": 4, "mini_batch_size": 4},
    )
    env = gym.make("Blackjack-v1")
    updates = []
    for episode in range(8):
        observation, info = env.reset(seed=episode)
        done = False
        while not done:
            action = agent.act(observation)
            assert action in (0, 1)
            observation, reward, terminated, truncated, info = env.step(action)
            agent.assign_reward(reward)
            done = terminated or truncated
        stats = agent.terminate_episode()
        if stats:
            updates.append(stats)
    assert len(updates) == 2  # a batch of 4 episodes, twice
    assert all(np.isfinite(s["policy_loss"]) for s in updates)
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())


def test_assign_reward_before_act_is_a_clear_error() -> None:
    agent = UserBlackjackAgent()
    with pytest.raises(Exception, match="before act"):
        agent.assign_reward(1.0)


def test_unknown_legacy_option_is_a_clear_error() -> None:
    with pytest.raises(Exception, match="ppo_config_dict key 'ppo_steps'"):
        UserBlackjackAgent(ppo_config_dict={"ppo_steps": 3})


def test_exact_values_of_the_baselines() -> None:
    from llamagym_blackjack.exact import policy_value

    def value(baseline) -> float:
        return policy_value(lambda state: baseline(state, {}, ["stick", "hit"], None))

    assert value(basic_strategy) == pytest.approx(-0.0466, abs=5e-4)
    assert value(hit_below_17) == pytest.approx(-0.0793, abs=5e-4)
    # The exact value agrees with simulation within its 95% interval.
    simulated = evaluate_baseline(BlackjackAgent(), "always-stick", 20_000, seed=3)
    assert abs(value(lambda *_: "stick") - simulated.mean) < simulated.ci95


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_greedy_evaluation_reuses_decisions_and_plays_the_same_episodes(mode: str) -> None:
    """An evaluation decides each distinct prompt once; the episodes are those the
    engine plays deciding every turn afresh."""
    from llamagym.rollout.evaluation import evaluate_agent, evaluation_seeds

    agent = BlackjackAgent(config={"rollout": {"mode": mode, "num_envs": 16}})
    policy = agent.policy
    result = evaluate_agent(agent.evaluation_engine(), 300, seed=3)
    memo_positions = policy.head_positions
    envs = [agent.make_env() for _ in range(16)]
    with torch.no_grad():
        fresh = agent.engine.collect(envs, 300, greedy=True, seeds=evaluation_seeds(3, 300))
    returns = [e.env_return for e in fresh]
    assert result.episodes == len(returns) == 300
    assert result.mean == pytest.approx(sum(returns) / len(returns), abs=1e-12)
    # The memo looks each distinct prompt up once in the whole evaluation; the engine
    # once per batch it meets it in.
    distinct = {tuple(turn.prompt_tokens) for episode in fresh for turn in episode.turns}
    if mode == "score":  # one LM-head position per single-token action name
        assert memo_positions == len(agent.action_names) * len(distinct)
    assert policy.head_positions - memo_positions > 1.5 * memo_positions
