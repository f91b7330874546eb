"""__CLASS__: REINFORCE (Williams, 1992) with a batch-mean baseline. The whole algorithm
is this file, top to bottom: its settings, its loss and its update.

Each turn's log-probability is pushed up in proportion to how much better than the
batch average its return was. The same code serves both action modes: the policy's
evaluation gives one log-probability per "action unit" (the chosen candidate in score
mode, each reply token in generate mode) with a mask, and a turn's log-probability is
their masked sum.
"""

from __future__ import annotations

import math

import torch
from llamagym.algorithms.algorithm import Algorithm, AlgorithmContext, rollout_metrics
from llamagym.algorithms.algorithm_config import AlgorithmConfig
from llamagym.algorithms.batching import minibatches
from llamagym.models.policy import Evaluation
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.schedule import LearningRate
from pydantic import Field


class __CONFIG_CLASS__(AlgorithmConfig):
    """The run's `algorithm` section (`--set algorithm.lr=3e-4`); unknown keys fail."""

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    anneal_lr: bool = Field(False, description="Decay the learning rate linearly over the run.")
    episodes_per_update: int = Field(32, ge=2, description="Episodes collected per update.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across an episode's turns.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")


def policy_gradient_loss(evaluation: Evaluation, advantages: torch.Tensor) -> torch.Tensor:
    """The loss: -advantage x log pi(action | prompt), averaged over the turns."""
    turn_logprobs = (evaluation.logprobs * evaluation.mask).sum(-1)
    return -(advantages * turn_logprobs).mean()


class __CLASS__(Algorithm):
    Config = __CONFIG_CLASS__
    config: __CONFIG_CLASS__

    def __init__(self, context: AlgorithmContext):
        # The context holds what the run gives every algorithm: the policy, this
        # algorithm's validated config, the schedule, the processes, the stop control.
        super().__init__(context)
        config = self.config
        # Only the language model's weights: REINFORCE has no use for the value head.
        self.optimizer = torch.optim.Adam(self.model_parameters(), lr=config.lr)
        # The rate each step of self.optimizer takes, on the run's schedule.
        self.learning_rate = LearningRate(context.schedule, config.lr, config.anneal_lr)

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
        # 3. One gradient step per minibatch on the loss. sync_minibatch_count agrees with
        #    the other processes, when a run trains in several, on as many steps as each
        #    takes (self.step averages the gradients over them).
        order = list(range(len(turns)))
        self.rng.shuffle(order)  # seeded: a seeded run repeats exactly
        losses = []
        steps = self.sync_minibatch_count(len(turns), config.minibatch_size)
        for batch in minibatches(order, config.minibatch_size, steps):
            evaluation = self.scoring.evaluate([turns[i] for i in batch])
            loss = policy_gradient_loss(evaluation, advantages[batch])
            if self.step(self.optimizer, loss, config.max_grad_norm):  # skips NaN losses
                losses.append(loss.item())
        self.updates += 1
        return {
            **rollout_metrics(episodes),
            "policy_loss": sum(losses) / len(losses) if losses else math.nan,
            "policy_steps": float(len(losses)),
        }
