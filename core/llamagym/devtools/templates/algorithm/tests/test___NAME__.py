"""Tests of the __DISTRIBUTION__ plugin: `pip install -e ".[test]"`, then `pytest`.

BanditAgent (two levers, one pays more) and tiny_agent (the offline tiny model with
small settings) come from LlamaGym's testing helpers, llamagym.testing.
"""

from __future__ import annotations

import math

import pytest
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.testing import BanditAgent, action_probabilities, tiny_agent
from pydantic import ValidationError

from __PACKAGE__.algorithm import __CLASS__


def test_registered_through_the_entry_point() -> None:
    registration = get_plugins().registry.get("algorithm", "__NAME__")
    assert registration.distribution == "__DISTRIBUTION__"
    assert registration.load() is __CLASS__


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError):
        __CLASS__.Config(lr=-1.0)
    with pytest.raises(ValidationError):
        __CLASS__.Config(no_such_key=1)


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_one_update_changes_every_weight(mode: str) -> None:
    agent = tiny_agent(BanditAgent, rollout={"mode": mode, "max_new_tokens": 4,
                       "invalid_action": {"policy": "random"}}, algorithm={"name": "__NAME__"})
    before = {n: p.detach().clone() for n, p in agent.policy.model.named_parameters()}
    metrics = agent.algorithm.update(agent.engine.play(32))  # over the run's 8 envs
    assert metrics["policy_steps"] > 0 and math.isfinite(metrics["policy_loss"])
    after = dict(agent.policy.model.named_parameters())
    assert [n for n, p in before.items() if p.equal(after[n].detach())] == []


def test_learns_the_better_lever() -> None:
    agent = tiny_agent(BanditAgent, rollout={"num_envs": 32},
                       algorithm={"name": "__NAME__", "episodes_per_update": 64, "lr": 3e-3})
    assert action_probabilities(agent, 0)[1] < 0.9
    for _ in range(15):
        agent.algorithm.update(agent.engine.play(64))
        if action_probabilities(agent, 0)[1] > 0.9:
            break
    assert action_probabilities(agent, 0)[1] > 0.9
