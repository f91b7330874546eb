"""Tests of the __DISTRIBUTION__ plugin: `pip install -e ".[test]"`, then `pytest`.

The fake_llm fixture comes from LlamaGym's pytest plugin (llamagym.testing), which
pytest loads by itself wherever LlamaGym is installed.
"""

from __future__ import annotations

import json

from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import assert_agent_conforms

from __PACKAGE__.agent import __CLASS__


def test_registered_through_the_entry_point() -> None:
    registration = get_plugins().registry.get("agent", "__NAME__")
    assert registration.distribution == "__DISTRIBUTION__"
    assert registration.load() is __CLASS__


def test_passes_the_conformance_checks() -> None:
    # The checks of `llamagym check __NAME__`: seeded resets, prompts that fit, action
    # names that parse back, baselines, and whole episodes with a scripted model.
    assert_agent_conforms(__CLASS__)


def test_replies_are_read_through_the_extraction_chain(fake_llm) -> None:
    names = list(__CLASS__.action_names)
    # JSON, then a bare name, then a reply naming no action at all.
    llm = fake_llm([json.dumps({"action": names[0]}), names[-1], "I am not sure."], cycle=True)
    [episode] = llm.play(__CLASS__(), episodes=1, max_turns=5000)
    chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert chosen[:2] == [names[0], names[-1]][: len(chosen)]
    # An unreadable reply still gets a legal action (the invalid-action policy).
    assert all(turn.valid == (turn.reply != "I am not sure.") for turn in episode.turns)


def test_the_random_baseline_plays() -> None:
    result = evaluate_baseline(__CLASS__(), "random", episodes=3)
    assert result.episodes == 3


def test_an_option_reaches_the_agent(fake_llm) -> None:
    # What `--set agent.max_episode_steps=2` (or a config file's `agent:` section) does.
    agent = __CLASS__(config={"agent": {"max_episode_steps": 2}})
    assert agent.options.max_episode_steps == 2
    llm = fake_llm([__CLASS__.action_names[0]], cycle=True)
    episodes = llm.play(agent, episodes=2)
    assert all(len(episode.turns) <= 2 for episode in episodes)
