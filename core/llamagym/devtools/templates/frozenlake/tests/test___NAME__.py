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


def test_the_prompt_draws_the_lake() -> None:
    text = __CLASS__().format_observation(6)
    assert text.splitlines()[1] == "FH@H"
    assert text.endswith("(row 2, column 3).")


def test_the_slippery_option_reaches_the_env() -> None:
    # What `--set agent.is_slippery=true` (or a config file's `agent:` section) does.
    assert __CLASS__().make_env().spec.kwargs["is_slippery"] is False
    slippery = __CLASS__(config={"agent": {"is_slippery": True}})
    assert slippery.options.is_slippery is True
    assert slippery.make_env().spec.kwargs["is_slippery"] is True


def test_a_scripted_model_walks_the_route(fake_llm) -> None:
    # Each reply is read by the extraction chain: JSON, a bare word, a sentence, and a
    # compass word that only this agent's extract_action knows.
    llm = fake_llm(['{"action": "right"}', "right", "down", "I go down.", "south", "Right!"])
    [episode] = llm.play(__CLASS__(), episodes=1)
    chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert chosen == ["right", "right", "down", "down", "down", "right"]
    assert episode.env_return == 1.0 and episode.invalid_replies == 0
    assert "@FFF" in llm.prompts[0]  # the model was shown the start square


def test_an_unreadable_reply_gets_a_legal_action_and_a_penalty(fake_llm) -> None:
    llm = fake_llm(["I would rather not.", json.dumps({"action": "down"})], cycle=True)
    [episode] = llm.play(__CLASS__(), episodes=1, max_turns=200)
    first = episode.turns[0]
    assert not first.valid and first.action_index is not None
    assert first.reward < 0  # the invalid-action penalty
    assert episode.turns[1].valid


def test_the_route_baseline_always_arrives() -> None:
    agent = __CLASS__()
    route = evaluate_baseline(agent, "route", episodes=5)
    assert route.mean == 1.0 and route.outcomes == {"goal": 1.0, "no goal": 0.0}
    random = evaluate_baseline(agent, "random", episodes=50, seed=1)
    assert random.mean < 0.5
    assert random.outcomes["goal"] == random.mean  # the lake pays 1 at the goal only
