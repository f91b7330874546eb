"""The settings every built-in clipped-objective algorithm shares (PPO, GRPO, RLOO,
REINFORCE): optimiser, batch, clipped surrogate, KL to the reference, discount,
gradient clipping and the SFT warm-start. Each algorithm's ``Config`` adds its own
fields and sets its own defaults where they differ."""

from __future__ import annotations

from pydantic import Field, field_validator

from llamagym.algorithms.algorithm_config import (
    AlgorithmConfig,
    check_adaptive_kl,
    microbatch_size_field,
    warmup_steps_field,
)
from llamagym.algorithms.credit import CreditRule
from llamagym_builtins.sft import WarmStartConfig


class ClippedConfig(AlgorithmConfig):
    lr: float = Field(1e-3, gt=0, le=10, description="Adam learning rate.")
    anneal_lr: bool = Field(True, description="Decay the learning rate linearly over the run.")
    episodes_per_update: int = Field(64, ge=1, description="Episodes collected per update.")
    epochs: int = Field(4, ge=1, description="Passes over each batch.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    microbatch_size: int | None = microbatch_size_field()
    warmup_steps: int = warmup_steps_field()
    clip_range: float = Field(
        0.2, gt=0, le=1, description="Ratio clip epsilon: the ratio is kept in [1 - it, 1 + it]."
    )
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
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
    credit: CreditRule = Field("gae", description="Credit rule across turns.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across turns.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    warm_start: WarmStartConfig = Field(
        default_factory=WarmStartConfig,
        description="Supervised steps: on demonstrations before RL, on the best episodes "
        "between updates.",
    )

    _adaptive_needs_coef = field_validator("adaptive_kl_target")(check_adaptive_kl)
