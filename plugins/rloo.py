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

from llamagym.algorithm import check_adaptive_kl, check_multiple_of_group
from llamagym.credit import (
    RULES_WITHOUT_VALUES,
    CreditRule,
    group_normalized,
    leave_one_out,
    minus_batch_mean,
)
from llamagym.plugins.grpo import GRPO, STD_EPS
from llamagym.plugins.sft import SFTWarmStartConfig
from llamagym.trajectory import Episode


class RLOOConfig(SFTWarmStartConfig):
    credit_rules = RULES_WITHOUT_VALUES

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    anneal_lr: bool = Field(True, description="Decay the learning rate linearly over the run.")
    group_size: int = Field(4, ge=2, description="Episodes per group sharing a start seed (K).")
    episodes_per_update: int = Field(
        64, ge=2, description="Episodes collected per update; a multiple of group_size."
    )
    epochs: int = Field(2, ge=1, description="Passes over each batch.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    clip_range: float = Field(0.2, gt=0, description="Ratio clip epsilon (epochs after the first).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL to the reference (0 = off).")
    adaptive_kl_target: float | None = Field(
        None, gt=0, description="Adapt kl_coef so KL to the reference stays near this."
    )
    adaptive_kl_horizon: int = Field(
        10_000, ge=1, description="Samples over which the adaptive kl_coef moves <= 20%."
    )
    target_kl: float | None = Field(
        None, gt=0, description="Stop the update's epochs when KL(rollout||new) > 1.5x this."
    )
    credit: CreditRule = Field("discounted", description="Credit rule across turns.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across turns.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")

    _episodes_fit_groups = field_validator("episodes_per_update")(check_multiple_of_group)
    _adaptive_needs_coef = field_validator("adaptive_kl_target")(check_adaptive_kl)


class RLOO(GRPO):
    Config = RLOOConfig
    credit_rules = RLOOConfig.credit_rules

    def advantages(self, group: list[Episode]) -> list[list[float]] | None:
        return leave_one_out(self.group_returns(group))


class REINFORCEConfig(SFTWarmStartConfig):
    credit_rules = RULES_WITHOUT_VALUES

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    anneal_lr: bool = Field(True, description="Decay the learning rate linearly over the run.")
    episodes_per_update: int = Field(64, ge=2, description="Episodes collected per update.")
    epochs: int = Field(1, ge=1, description="Passes over each batch.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    clip_range: float = Field(0.2, gt=0, description="Ratio clip epsilon (epochs after the first).")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL to the reference (0 = off).")
    adaptive_kl_target: float | None = Field(
        None, gt=0, description="Adapt kl_coef so KL to the reference stays near this."
    )
    adaptive_kl_horizon: int = Field(
        10_000, ge=1, description="Samples over which the adaptive kl_coef moves <= 20%."
    )
    target_kl: float | None = Field(
        None, gt=0, description="Stop the update's epochs when KL(rollout||new) > 1.5x this."
    )
    credit: CreditRule = Field("discounted", description="Credit rule across turns.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across turns.")
    normalize_advantages: bool = Field(
        False, description="Divide the advantages by the batch's std of returns."
    )
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")

    _adaptive_needs_coef = field_validator("adaptive_kl_target")(check_adaptive_kl)


class REINFORCE(GRPO):
    Config = REINFORCEConfig
    credit_rules = REINFORCEConfig.credit_rules

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
