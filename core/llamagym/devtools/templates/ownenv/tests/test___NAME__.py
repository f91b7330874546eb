"""Tests of the __DISTRIBUTION__ plugin: `pip install -e ".[test]"`, then `pytest`.

The fake_llm fixture comes from LlamaGym's pytest plugin (llamagym.testing), which
pytest loads by itself wherever LlamaGym is installed.
"""

from __future__ import annotations

import json
import math

from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import assert_agent_conforms

from __PACKAGE__ import env as game
from __PACKAGE__.agent import __CLASS__, binary_search


def test_registered_through_the_entry_point() -> None:
    registration = get_plugins().registry.get("agent", "__NAME__")
    assert registration.distribution == "__DISTRIBUTION__"
    assert registration.load() is __CLASS__


def test_the_agent_makes_the_registered_env() -> None:
    # Agent.make_env registers the plugins' envs, then calls gymnasium.make.
    env = __CLASS__().make_env()
    assert env.spec.id == "__ENV_ID__"
    assert isinstance(env.unwrapped, game.__ENV_CLASS__)


def test_a_seed_decides_the_secret() -> None:
    env, other = game.__ENV_CLASS__(), game.__ENV_CLASS__()
    secrets = []
    for seed in range(20):
        env.reset(seed=seed)
        secret = env.secret
        env.reset(seed=seed)  # the same env again
        other.reset(seed=seed)  # another env
        assert env.secret == other.secret == secret
        secrets.append(secret)
    assert len(set(secrets)) > 1  # and different seeds draw different secrets


def test_hints_narrow_the_range() -> None:
    env = game.__ENV_CLASS__()
    env.reset(seed=0)
    secret = env.secret
    wrong = 1 if secret != 1 else 16
    observation, reward, terminated, _, _ = env.step(wrong - 1)  # action n - 1 guesses n
    assert observation["hint"] == (game.HIGHER if wrong < secret else game.LOWER)
    assert observation["low"] <= secret <= observation["high"]
    assert (observation["low"], observation["high"]) != (1, 16)
    assert reward == 0.0 and not terminated
    observation, reward, terminated, truncated, _ = env.step(secret - 1)
    assert observation["hint"] == game.CORRECT and observation["guess"] == secret
    assert reward == 1.0 and terminated and not truncated


def test_the_turn_limit_truncates() -> None:
    env = game.__ENV_CLASS__(max_guesses=3)
    env.reset(seed=0)
    wrong = 1 if env.secret != 1 else 16
    results = [env.step(wrong - 1) for _ in range(3)]
    assert [result[3] for result in results] == [False, False, True]  # truncated
    assert not any(result[2] for result in results)  # terminated


def test_binary_search_finds_every_secret_quickly() -> None:
    env = game.__ENV_CLASS__()
    legal = list(__CLASS__.action_names)
    for secret in range(game.LOWEST, game.HIGHEST + 1):
        observation, info = env.reset(seed=secret)
        env.secret = secret  # every secret in turn, whatever the seed drew
        terminated = truncated = False
        while not (terminated or truncated):
            action = legal.index(binary_search(observation, info, legal, None))
            observation, reward, terminated, truncated, info = env.step(action)
        assert reward == 1.0 and info["guesses"] <= math.log2(16) + 1


def test_the_baselines_play() -> None:
    agent = __CLASS__()
    result = evaluate_baseline(agent, "binary-search", episodes=10)
    assert result.mean == 1.0 and result.outcomes == {"found": 1.0, "not found": 0.0}
    random = evaluate_baseline(agent, "random", episodes=10)
    assert random.episodes == 10


def test_the_prompt_says_the_hint() -> None:
    observation = {"guess": 8, "hint": game.HIGHER, "low": 9, "high": 16}
    text = __CLASS__().format_observation(observation)
    assert "8" in text and "higher" in text and "from 9 to 16" in text


def test_passes_the_conformance_checks() -> None:
    # The checks of `llamagym check __NAME__`: seeded resets, prompts that fit, action
    # names that parse back, baselines, and whole episodes with a scripted model.
    assert_agent_conforms(__CLASS__)


def test_replies_are_read_through_the_extraction_chain(fake_llm) -> None:
    # JSON, then a sentence naming a number, then a reply naming no action at all.
    llm = fake_llm([json.dumps({"action": "8"}), "I guess 12.", "I am not sure."], cycle=True)
    [episode] = llm.play(__CLASS__(), episodes=1)
    chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert chosen[:2] == ["8", "12"][: len(chosen)]
    # An unreadable reply still gets a legal action (the invalid-action policy).
    assert all(turn.valid == (turn.reply != "I am not sure.") for turn in episode.turns)
    assert "No guess yet." in llm.prompts[0]
