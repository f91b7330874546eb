"""Steps03: REINFORCE (Williams, 1992) with a batch-mean baseline, one file top to bottom.

Each turn's log-probability is pushed up in proportion to how much better than the
batch average its return was. The same code serves both action modes: the policy's
evaluation gives one log-probability per "action unit" (the chosen candidate in score
mode, each reply token in generate mode) with a mask, and a turn's log-probability is
their masked sum.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from llamagym.config import RolloutSettings
from llamagym.models.policy import Policy
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.training.algorithm import Algorithm, AlgorithmConfig, minibatches, rollout_metrics
from pydantic import Field


class Steps03Config(AlgorithmConfig):
    """The run's `algorithm` section (`--set algorithm.lr=3e-4`); unknown keys fail."""

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    episodes_per_update: int = Field(32, ge=2, description="Episodes collected per update.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across an episode's turns.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")


class Steps03(Algorithm):
    Config = Steps03Config

    def __init__(
        self, policy: Policy, config: Steps03Config, rollout: RolloutSettings, **run: Any
    ):
        # ``run``: the run's schedule, process group and stop control (llamagym.run).
        super().__init__(policy, config, rollout, **run)
        # Only the language model's weights: REINFORCE has no use for the value head.
        self.optimizer = torch.optim.Adam(self.model_parameters(), lr=config.lr)

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
        # 1. Every turn's return: its reward plus the discounted rewards after it.
        turns: list[Turn] = []
        returns: list[float] = []
        for episode in episodes:
            running, reversed_returns = 0.0, []
            for turn in reversed(episode.turns):
                running = turn.reward + config.gamma * running
                reversed_returns.append(running)
            turns += episode.turns
            returns += reversed(reversed_returns)
        # 2. Advantage: the return minus the batch mean, so better-than-usual actions
        #    become likelier and worse ones less likely.
        baseline = sum(returns) / len(returns)
        advantages = torch.tensor([r - baseline for r in returns], device=self.policy.device)
        # 3. One gradient step per minibatch on -advantage x log pi(action | prompt).
        #    sync_minibatch_count agrees with the other processes, when a run trains in
        #    several, on as many steps as each takes (gradients are averaged in self.step).
        order = list(range(len(turns)))
        self.rng.shuffle(order)  # seeded: a seeded run repeats exactly
        losses = []
        steps = self.sync_minibatch_count(len(turns), config.minibatch_size)
        for batch in minibatches(order, config.minibatch_size, steps):
            evaluation = self.evaluate([turns[i] for i in batch])
            turn_logprobs = (evaluation.logprobs * evaluation.mask).sum(-1)
            loss = -(advantages[batch] * turn_logprobs).mean()
            if self.step(self.optimizer, loss, config.max_grad_norm):  # skips NaN losses
                losses.append(loss.item())
        self.updates += 1
        return {
            **rollout_metrics(episodes),
            "policy_loss": sum(losses) / len(losses) if losses else math.nan,
            "policy_steps": float(len(losses)),
        }
