"""The original LlamaGym README's example, as written there, with only the line that
loads the model changed (to the offline tiny model): an agent that names no actions,
whose ``extract_action`` answers with the env action itself."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from llamagym import Agent, load_model_and_tokenizer
from llamagym.errors import LlamaGymError


class BlackjackAgent(Agent):
    def get_system_prompt(self) -> str:
        return "You are an expert blackjack player."

    def format_observation(self, observation) -> str:
        return f"Your current total is {observation[0]}"

    def extract_action(self, response: str):
        return 0 if "stay" in response else 1


@pytest.mark.slow  # trains the example for real
def test_the_original_example_runs_and_trains() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")  # the one changed line
    device = "cpu"
    agent = BlackjackAgent(model, tokenizer, device)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    env = gym.make("Blackjack-v1")
    updates, actions = [], set()
    for _episode in range(70):  # the README runs 5000; one update needs 64 episodes
        observation, info = env.reset()
        done = False

        while not done:
            action = agent.act(observation)  # act based on observation
            actions.add(action)
            observation, reward, terminated, truncated, info = env.step(action)
            agent.assign_reward(reward)  # provide reward to agent
            done = terminated or truncated

        train_stats = agent.terminate_episode()  # trains if batch is full
        if train_stats:
            updates.append(train_stats)

    assert actions <= {0, 1}  # extract_action's values went to env.step as they were
    assert len(updates) == 1 and updates[0]["episodes"] == 64
    changed = [n for n, p in agent.policy.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed  # the update trained the model


class SilentAgent(BlackjackAgent):
    def extract_action(self, response: str):
        return None


def test_an_unreadable_reply_without_named_actions_says_what_to_do() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    agent = SilentAgent(model, tokenizer, "cpu")
    observation, _ = gym.make("Blackjack-v1").reset(seed=0)
    with pytest.raises(LlamaGymError, match=r"returned None for the reply .*set action_names"):
        agent.act(observation)


def test_score_mode_needs_the_actions_named() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    agent = BlackjackAgent(model, tokenizer, "cpu", config={"rollout": {"mode": "score"}})
    observation, _ = gym.make("Blackjack-v1").reset(seed=0)
    with pytest.raises(LlamaGymError, match="names no actions, and score mode ranks"):
        agent.act(observation)


def test_named_actions_still_get_the_parsers_and_the_fallback() -> None:
    """Given the env, the agent knows its Discrete actions ("0", "1") again, and an
    unreadable reply falls back to a legal one instead of stopping."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    env = gym.make("Blackjack-v1")
    agent = SilentAgent(model, tokenizer, "cpu", env=env)
    observation, _ = env.reset(seed=0)
    assert agent.act(observation) in (0, 1)


def test_the_readme_example_runs_as_written(capsys) -> None:
    """The README's classic-API block, executed unchanged but for the length of its loop
    (its 20,000 episodes are measured by benchmarks/readme_example.py)."""
    from benchmarks.readme_example import LOOP, readme_example

    code = readme_example().replace(LOOP, "range(70)")
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    assert len(namespace["returns"]) == 70
    agent = namespace["agent"]
    assert agent.config.rollout.mode == "score" and agent.action_names == ["stick", "hit"]
    assert "mean return, last 70 episodes: " in capsys.readouterr().out

