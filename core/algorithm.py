"""The base class of every training algorithm plugin.

An algorithm gets finished episodes and changes the policy's weights. It owns its
optimizer; the rollout engine, hooks and loggers sit outside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from llamagym.config import RolloutSettings
from llamagym.policy import Evaluation, Policy
from llamagym.trajectory import Episode, Turn


class AlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Algorithm:
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    #: Credit rules this algorithm accepts (documented in the README).
    credit_rules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policy: Policy, config: AlgorithmConfig, rollout: RolloutSettings):
        self.policy = policy
        self.config = config
        self.rollout = rollout
        self.skipped_updates = 0
        self.updates = 0
        self.optimizer: torch.optim.Optimizer | None = None  # set by each algorithm

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume this algorithm exactly."""
        return {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "counters": {"updates": self.updates, "skipped_updates": self.skipped_updates},
        }

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        counters = state.get("counters", {})
        self.updates = counters.get("updates", 0)
        self.skipped_updates = counters.get("skipped_updates", 0)

    @property
    def episodes_per_update(self) -> int:
        return int(getattr(self.config, "episodes_per_update", 32))

    @property
    def group_size(self) -> int:
        """Episodes per group sharing a start seed (GRPO); 1 = independent episodes."""
        return 1

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        raise NotImplementedError

    # -- helpers shared by the algorithms -----------------------------------------
    def evaluate(self, turns: Sequence[Turn]) -> Evaluation:
        """Current log-probabilities, entropy and values for ``turns`` (with gradients)."""
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                [turn.action_index for turn in turns],
                temperature=self.rollout.temperature,
            )
        return self.policy.evaluate_replies(prompts, [turn.action_tokens for turn in turns])

    def old_logprobs(self, turns: Sequence[Turn], width: int) -> torch.Tensor:
        """The rollout-time log-probabilities, padded to ``width`` action units."""
        old = torch.zeros(len(turns), width)
        for row, turn in enumerate(turns):
            old[row, : len(turn.logprobs)] = torch.tensor(turn.logprobs[:width])
        return old.to(self.policy.device)

    def step(self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float) -> bool:
        """Backward and step; a non-finite loss or gradient skips the step (counted)."""
        optimizer.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            self.skipped_updates += 1
            return False
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), max_grad_norm)
        if not math.isfinite(float(norm)):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return False
        optimizer.step()
        return True


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's unmasked units, then over rows (long replies don't dominate)."""
    per_row = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_row.mean()


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    turns = sum(len(e.turns) for e in episodes)
    return {
        "episodes": float(len(episodes)),
        "return_mean": sum(e.env_return for e in episodes) / max(1, len(episodes)),
        "invalid_rate": sum(e.invalid_replies for e in episodes) / max(1, turns),
        "episode_length": turns / max(1, len(episodes)),
    }
