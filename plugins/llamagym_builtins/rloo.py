"""RLOO and REINFORCE: critic-free policy gradients that differ from GRPO only in the
baseline, so they reuse GRPO's update (clipped surrogate over epochs, optional KL to the
reference, target-KL stop, SFT warm-start) and override how advantages are computed.

* RLOO (REINFORCE Leave-One-Out; Kool et al., 2019; Ahmadian et al., 2024): groups of K
  episodes from the same seed; an episode's baseline is the mean return of the *other*
  K - 1, which never depends on its own actions, so the estimate is unbiased. No scaling
  by the std.
* REINFORCE (Williams, 1992) with a batch-mean baseline: independent episodes, one
  baseline for the whole batch, optionally divided by the batch's std.

With one epoch the first and only step is the plain policy gradient (the ratio is 1);
with more, the clipped ratio keeps the later steps on stale episodes safe.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from llamagym.algorithms.algorithm_config import check_group_divides_batch
from llamagym.algorithms.credit import (
    group_normalized,
    leave_one_out,
    minus_batch_mean,
)
from llamagym.rollout.trajectory import Episode
from llamagym_builtins.grpo import GRPO, STD_EPS, CriticFreeConfig


class RLOOConfig(CriticFreeConfig):
    group_size: int = Field(4, ge=2, description="Episodes per group sharing a start seed (K).")

    _whole_groups = field_validator("group_size")(check_group_divides_batch)


class RLOO(GRPO):
    Config = RLOOConfig
    credit_rules = RLOOConfig.credit_rules
    config: RLOOConfig

    def advantages(self, group: list[Episode]) -> list[list[float]] | None:
        return leave_one_out(self.group_returns(group))


class REINFORCEConfig(CriticFreeConfig):
    epochs: int = Field(1, ge=1, description="Passes over each batch.")
    normalize_advantages: bool = Field(
        False, description="Divide the advantages by the batch's std of returns."
    )


class REINFORCE(GRPO):
    Config = REINFORCEConfig
    credit_rules = REINFORCEConfig.credit_rules
    config: REINFORCEConfig

    @property
    def group_size(self) -> int:
        return 1  # independent episodes; the batch is the one group

    def groups(self, episodes: list[Episode]) -> list[list[Episode]]:
        return [list(episodes)]

    def advantages(self, group: list[Episode]) -> list[list[float]] | None:
        returns = self.group_returns(group)
        if self.config.normalize_advantages:
            return group_normalized(returns, STD_EPS, scale_by_std=True)
        return minus_batch_mean(returns)
