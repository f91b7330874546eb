"""Slots that never wait: with ``carry``, an env whose episode ends starts the next at
once, and episodes unfinished when a collection has its episodes carry into the next,
each turn trained once with the log-probabilities it was played with."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from llamagym_cartpole.agent import CartPoleAgent

from llamagym.algorithms.algorithm import rollout_metrics
from llamagym.models.policy import Policy
from llamagym.testing import tiny_agent

NUM_ENVS = 4


@pytest.fixture
def agent():
    agent = tiny_agent(CartPoleAgent, rollout={"num_envs": NUM_ENVS, "mode": "score"})
    yield agent
    agent.engine.close()


def _turn_log_probs(policy, turns) -> list[float]:
    """Each turn's log-probability of its chosen action under the policy's weights now."""
    with torch.no_grad():
        scores, _ = policy.score([t.prompt_tokens for t in turns], [t.candidates for t in turns])
    rows = [
        Policy.action_log_probs(scores[r : r + 1], t.temperature)[0] for r, t in enumerate(turns)
    ]
    return [float(row[turn.action_index]) for row, turn in zip(rows, turns, strict=True)]


def test_every_forward_holds_every_env_while_carrying(agent) -> None:
    engine = agent.engine
    engine.play(6)  # lockstep: envs wait for the collection's last episodes
    waited = engine.stats.decisions / engine.stats.batched_decisions
    assert waited < NUM_ENVS
    before = (engine.stats.decisions, engine.stats.batched_decisions)
    for version in range(3):
        assert len(engine.play(6, carry=True, policy_version=version)) == 6
    decisions = engine.stats.decisions - before[0]
    passes = engine.stats.batched_decisions - before[1]
    assert decisions == passes * NUM_ENVS


def test_a_carried_episode_is_trained_once_with_the_log_probabilities_it_was_played_with(
    agent,
) -> None:
    engine, policy = agent.engine, agent.policy
    first = engine.play(4, carry=True, policy_version=0)
    carried = [slot for _, slot in engine._carried.active()]
    assert len(carried) == NUM_ENVS and any(slot.episode.turns for slot in carried)
    old_weights = {
        name: p.detach().clone() for name, p in policy.model.named_parameters() if p.requires_grad
    }
    agent.algorithm.update(first)  # the weights move
    second = engine.play(12, carry=True, policy_version=1)

    turns = [id(turn) for episode in first + second for turn in episode.turns]
    assert len(turns) == len(set(turns))  # no turn in two batches
    assert not {id(e) for e in first} & {id(e) for e in second}
    mixed = [e for e in second if {t.policy_version for t in e.turns} == {0, 1}]
    assert mixed, "an episode carried over holds turns of both versions"
    old_share = sum(t.policy_version == 0 for e in second for t in e.turns)
    old_share /= sum(len(e.turns) for e in second)
    assert rollout_metrics(second)["carried_turns"] == pytest.approx(old_share)
    assert rollout_metrics(first)["carried_turns"] == 0.0
    old_turns = [t for e in mixed for t in e.turns if t.policy_version == 0]

    played = [t.logprobs[0] for t in old_turns]
    now = _turn_log_probs(policy, old_turns)
    assert max(abs(a - b) for a, b in zip(played, now, strict=True)) > 1e-4  # weights moved
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if name in old_weights:
                parameter.copy_(old_weights[name])
    then = _turn_log_probs(policy, old_turns)
    assert played == pytest.approx(then, abs=1e-5)


def test_a_collection_without_carry_ends_the_carried_episodes(agent) -> None:
    engine = agent.engine
    engine.play(4, carry=True)
    assert engine._carried is not None
    episodes = engine.play(4)
    assert engine._carried is None and len(episodes) == 4
    assert all(t.policy_version == 0 for e in episodes for t in e.turns)
    with pytest.raises(ValueError, match="draws its own seeds"):
        engine.play(4, carry=True, seeds=[1, 2, 3, 4])


def test_a_collection_that_has_enough_returns_sooner_and_carries_the_rest(agent) -> None:
    engine = agent.engine
    asked: list[int] = []

    def enough(finished: int) -> bool:
        asked.append(finished)
        return finished >= 2

    first = engine.play(40, carry=True, enough=enough)
    assert 2 <= len(first) < 40 and asked[-1] == len(first)
    carried = [slot for _, slot in engine._carried.active()]
    assert len(carried) == NUM_ENVS and any(slot.episode.turns for slot in carried)
    in_progress = {id(slot.episode) for slot in carried}
    second = engine.play(4, carry=True)
    assert len(second) == 4 and in_progress & {id(e) for e in second}
    with pytest.raises(ValueError, match="only a carrying collection"):
        engine.play(4, enough=enough)


def _slots(engine):
    return [
        (slot.episode.seed, slot.steps, slot.history, [t.logprobs for t in slot.episode.turns],
         repr(slot.observation))
        for _, slot in engine._carried.active()
    ]


def test_a_saved_engine_plays_its_carried_episodes_again_in_fresh_envs(agent) -> None:
    engine = agent.engine
    engine.play(4, carry=True)
    state = copy.deepcopy(engine.state_dict())
    assert state["carried"]["slots"] and any(s and s["steps"] for s in state["carried"]["slots"])
    expected = _slots(engine)

    other = tiny_agent(CartPoleAgent, rollout={"num_envs": NUM_ENVS, "mode": "score"}).engine
    other.load_state_dict(state)
    assert _slots(other) == expected  # the same states, reached again by the envs
    after_saved = [e.turns for e in engine.play(4, carry=True)]
    after_loaded = [e.turns for e in other.play(4, carry=True)]
    assert [[t.action_index for t in turns] for turns in after_saved] == [
        [t.action_index for t in turns] for turns in after_loaded
    ]
    other.close()


def test_a_carried_episode_the_env_answers_otherwise_starts_afresh(agent, caplog) -> None:
    engine = agent.engine
    engine.play(4, carry=True)
    state = copy.deepcopy(engine.state_dict())
    changed = next(p for p, s in enumerate(state["carried"]["slots"]) if s and s["steps"])
    state["carried"]["slots"][changed]["rewards"][0] += 1.0  # not what the env says
    other = tiny_agent(CartPoleAgent, rollout={"num_envs": NUM_ENVS, "mode": "score"}).engine
    with caplog.at_level(logging.WARNING, logger="llamagym"):
        other.load_state_dict(state)
    assert f"env {changed}: its episode in progress" in caplog.text
    replaced = other._carried.slots[changed]
    assert replaced is not None and not replaced.steps  # a fresh episode in its place
    other.close()


@pytest.mark.parametrize(
    "damage",
    [
        lambda c: c["slots"][0].update(steps="go"),
        lambda c: c["slots"][0].update(episode={"turns": [{"prompt_tokens": "x"}]}),
        lambda c: c["slots"].append(None),  # another number of envs
        lambda c: c.update(code="__import__('os')"),
    ],
)
def test_carried_episodes_that_do_not_read_are_refused(agent, damage) -> None:
    engine = agent.engine
    engine.play(4, carry=True)
    state = copy.deepcopy(engine.state_dict())
    state["carried"]["slots"][0] = state["carried"]["slots"][0] or {
        "seed": 1, "steps": [], "rewards": [], "history": [], "episode": {}
    }
    damage(state["carried"])
    other = tiny_agent(CartPoleAgent, rollout={"num_envs": NUM_ENVS, "mode": "score"}).engine
    with pytest.raises(ValueError, match="episodes|envs"):
        other.load_state_dict(state)
    other.close()
