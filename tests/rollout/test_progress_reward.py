"""``info["progress"]``: the env's own measure of a step's progress, read by the core
for every agent (``rollout.progress_reward`` per unit) into the learner's reward, never
into the env's return that evaluations count."""

from __future__ import annotations

import math
from typing import Any

import gymnasium
import numpy as np
import pytest

from llamagym.agent import Agent
from llamagym.rollout.env_checks import MAX_PROGRESS, progress_of
from llamagym.testing import tiny_agent

#: What the env reports as each step's progress, in order (then the episode ends).
REPORTED: list[Any] = [1, -2.5, np.float32(0.5), float("nan"), True, "3", 1e308, None]


class Ladder(gymnasium.Env):
    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.count = 0
        return 0, {}

    def step(self, action: int):
        progress = REPORTED[self.count]
        self.count += 1
        info = {} if progress is None else {"progress": progress}
        return 0, 0.25, self.count == len(REPORTED), False, info


class LadderAgent(Agent):
    name = "ladder"
    action_names = ("up", "down")

    def format_observation(self, observation: Any) -> str:
        return "Climb."

    def make_env(self) -> Ladder:
        return Ladder()


@pytest.mark.parametrize("weight", [0.0, 1.0, 2.0])
def test_the_learner_gets_the_progress_the_env_reports_and_the_return_stays_the_envs(
    weight: float,
) -> None:
    agent = tiny_agent(LadderAgent, rollout={"num_envs": 1, "progress_reward": weight})
    try:
        (episode,) = agent.engine.play(1)
    finally:
        agent.engine.close()
    # Counted: 1, -2.5, 0.5 and 1e308 bounded; not a number, a bool, a string or nothing.
    counted = [1.0, -2.5, 0.5, 0.0, 0.0, 0.0, MAX_PROGRESS, 0.0]
    assert [turn.reward for turn in episode.turns] == pytest.approx(
        [0.25 + weight * p for p in counted]
    )
    assert episode.env_return == pytest.approx(0.25 * len(REPORTED))


def test_progress_of_reads_only_finite_real_numbers() -> None:
    assert progress_of({"progress": -3}) == -3.0
    assert progress_of({"progress": -math.inf}) == 0.0
    assert progress_of({"progress": -1e300}) == -MAX_PROGRESS
    assert progress_of({"progress": [1]}) == 0.0
    assert progress_of({}) == 0.0
