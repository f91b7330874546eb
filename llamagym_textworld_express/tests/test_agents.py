"""Every agent through LlamaGym's conformance checks (those of ``llamagym check``), its
baselines, and a prompt, on the real games."""

from __future__ import annotations

import pytest
from llamagym_textworld_express.agent import CoinAgent, MapReaderAgent
from llamagym_textworld_express.plugin import AGENTS

from llamagym.plugin_runtime.manager import get_plugins
from llamagym.rollout.evaluation import evaluate_baseline
from llamagym.testing import assert_agent_conforms, tiny_agent

pytestmark = pytest.mark.usefixtures("shared_jvm")


@pytest.mark.parametrize("name", [spec.name for spec in AGENTS])
def test_conforms(name: str) -> None:
    agent_class = get_plugins().registry.get("agent", name).load()
    results = assert_agent_conforms(agent_class, name=name, episodes=1,
                                    config={"agent": {"max_episode_steps": 8}})
    assert all(result.status == "pass" for result in results), results


def test_the_gold_path_wins_every_game_and_random_play_fewer() -> None:
    agent = tiny_agent(CoinAgent, rollout={"num_envs": 2})
    gold = evaluate_baseline(agent, "gold-path", 6)
    assert gold.outcomes == {"won": 1.0, "lost": 0.0} and gold.mean == pytest.approx(1.0)
    random_play = evaluate_baseline(agent, "random", 6)
    assert random_play.mean < gold.mean


def test_the_task_is_said_once_and_the_map_stays_in_the_prompt(fake_llm) -> None:
    """Map Reader keeps the whole episode: the map read on the first turn is still in
    the prompt of the second."""
    agent = tiny_agent(MapReaderAgent, agent={"max_episode_steps": 2})
    llm = fake_llm(['{"action": "read map"}', '{"action": "task"}'])
    [episode] = llm.play(agent, episodes=1, mode="generate")
    first, second = llm.prompts
    assert first.count("Task: Your task is to take the coin that is located in") == 1
    assert "Valid actions: inventory, look around, " in first
    assert "The map reads:" not in first and "The map reads:" in second
    assert second.count("Task: Your task is to take the coin") == 1
    assert [turn.legal_actions[turn.action_index] for turn in episode.turns] == ["read map", "task"]
