"""GRPO over turns: Group Relative Policy Optimisation (Shao et al., 2024), no value head.

Each update's episodes come in seed groups of G: the engine resets the first G episodes
of a batch with one seed, the next G with another, so a group shares its start state and
its returns are directly comparable. A turn's advantage is its return minus the group's
mean start return, over the group's std (see ``llamagym.algorithms.credit``: with the default
``discounted`` rule, gamma 1 and a reward only at the end, every turn of an episode gets
``(R - mean) / (std + eps)``).

The loss is PPO's clipped surrogate on exactly the tokens the engine sampled (or the
chosen candidate in score mode): the rewards being normalised belong to those very
completions. Optional KL penalty to the reference policy (the adapter switched off, or a
frozen copy of a fully fine-tuned model), with a fixed or adaptive weight, and an
enforced target-KL stop: the shared clipped-policy-gradient loop (``Algorithm.optimise``).
A group whose returns are all equal says nothing about which completion was better: it
adds no policy gradient, is counted, and the share of such groups is logged as
``zero_variance_fraction`` (its turns still carry the entropy bonus and KL penalty when
those are on, see ``update``).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol, runtime_checkable

import torch
from pydantic import Field, field_validator

from llamagym.algorithms.algorithm import Algorithm, AlgorithmContext
from llamagym.algorithms.algorithm_config import check_group_divides_batch
from llamagym.algorithms.batching import seed_groups
from llamagym.algorithms.credit import (
    RULES_WITHOUT_VALUES,
    CreditRule,
    group_normalized,
    turn_returns,
)
from llamagym.algorithms.kl_control import KLController
from llamagym.algorithms.losses import entropy_bonus, reference_penalty
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.schedule import LearningRate
from llamagym_builtins.clipped_config import ClippedConfig
from llamagym_builtins.sft import WarmStart

logger = logging.getLogger(__name__)

STD_EPS = 1e-4  # keeps a group with a tiny spread from blowing its advantages up


class CriticFreeConfig(ClippedConfig):
    """The settings GRPO, RLOO and REINFORCE share: no value head, so no GAE."""

    credit_rules = RULES_WITHOUT_VALUES

    episodes_per_update: int = Field(
        64, ge=2, description="Episodes collected per update (whole seed groups)."
    )
    epochs: int = Field(2, ge=1, description="Passes over each batch.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    credit: CreditRule = Field("discounted", description="Credit rule across turns.")


class GRPOConfig(CriticFreeConfig):
    group_size: int = Field(8, ge=2, description="Episodes per group sharing a start seed (G).")
    scale_by_std: bool = Field(
        True, description="Divide by the group's std (off: only subtract the mean)."
    )

    _whole_groups = field_validator("group_size")(check_group_divides_batch)


@runtime_checkable
class SeedGroupSettings(Protocol):
    """Settings that put episodes in seed groups (GRPO's, RLOO's)."""

    group_size: int


@runtime_checkable
class StdScaleSettings(Protocol):
    """Settings that say whether a group's advantages are divided by its std (GRPO's)."""

    scale_by_std: bool


class GRPO(Algorithm):
    """GRPO, and the update RLOO and REINFORCE share: a subclass with another
    :class:`CriticFreeConfig` overrides what reads GRPO's own settings
    (:attr:`group_size`, :meth:`advantages`) or has them in its config too."""

    Config: ClassVar[type[CriticFreeConfig]] = GRPOConfig
    credit_rules = GRPOConfig.credit_rules
    config: CriticFreeConfig

    learning_rate: LearningRate
    kl: KLController

    def __init__(self, context: AlgorithmContext):
        super().__init__(context)
        config = self.config
        self.optimizer = torch.optim.Adam(self.model_parameters(), lr=config.lr)
        self.learning_rate = LearningRate(
            context.schedule, config.lr, config.anneal_lr, config.warmup_steps
        )
        self.kl = KLController.from_config(config)
        self.sft = WarmStart.create(self, config.warm_start)

    @property
    def group_size(self) -> int:
        config = self.config
        if not isinstance(config, SeedGroupSettings):
            raise TypeError(
                f"{type(self).__name__}: {type(config).__name__} has no group_size; "
                "override group_size"
            )
        return config.group_size

    def group_returns(self, group: list[Episode]) -> list[list[float]]:
        """Each episode's per-turn returns under the credit rule."""
        config = self.config
        return [
            turn_returns([turn.reward for turn in episode.turns], config.credit, config.gamma)
            for episode in group
        ]

    def advantages(self, group: list[Episode]) -> list[list[float]] | None:
        """Per-turn advantages of one seed group, or None if it carries no signal."""
        config = self.config
        if not isinstance(config, StdScaleSettings):
            raise TypeError(
                f"{type(self).__name__}: {type(config).__name__} has no scale_by_std; "
                "override advantages()"
            )
        return group_normalized(self.group_returns(group), STD_EPS, config.scale_by_std)

    def groups(self, episodes: list[Episode]) -> list[list[Episode]]:
        groups = seed_groups(episodes)
        if any(episode.group is None for episode in episodes) and self.updates == 0:
            logger.warning(
                "%s: episodes without a seed group (the act/terminate_episode loop); the "
                "whole batch is used as one group",
                type(self).__name__,
            )
        return groups

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
        # 1. Advantages per seed group. A group without signal gets none (no policy
        # gradient); its turns stay in the batch only if a regulariser (entropy bonus,
        # KL penalty) should still act on them: without that pull, states where the
        # policy is already deterministic never produce a varied group again, and the
        # policy collapses there (seen on Blackjack: always-stick after ~20 updates).
        keep_masked = config.entropy_coef > 0 or self.kl.coef > 0
        turns: list[Turn] = []
        advantages: list[float] = []
        groups = self.groups(episodes)
        masked = signal_turns = 0
        for group in groups:
            group_advantages = self.advantages(group)
            if group_advantages is None:
                masked += 1
                if not keep_masked:
                    continue
                group_advantages = [[0.0] * len(episode.turns) for episode in group]
            else:
                signal_turns += sum(len(episode.turns) for episode in group)
            for episode, episode_advantages in zip(group, group_advantages, strict=True):
                turns += episode.turns
                advantages += episode_advantages
        advantages_t = torch.tensor(advantages, device=self.policy.device)

        # 2. Clipped-surrogate epochs. The loss: the surrogate, the entropy bonus and the
        #    KL to the reference. 3. Optional supervised steps; the metrics.
        terms = [
            entropy_bonus(config.entropy_coef),
            reference_penalty(self.scoring, self.kl.coef),
        ]
        result = self.optimise(turns, advantages_t, terms)
        metrics = self.finish_update(
            episodes,
            result,
            batch={
                "zero_variance_groups": float(masked),
                "zero_variance_fraction": masked / max(1, len(groups)),
                "signal_turns": float(signal_turns),
                "trained_turns": float(len(turns)),
            },
        )
        # The rate of the update's last step (the warmup's share of the scheduled one).
        metrics["lr"] = self.learning_rate.at(self.optimizer_steps)
        return metrics
