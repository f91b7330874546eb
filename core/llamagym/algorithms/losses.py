"""The terms of the clipped-policy-gradient loss that
:meth:`~llamagym.algorithms.algorithm.Algorithm.optimise` minimises: PPO's clipped
surrogate, the KL to the reference, the masked means they are taken with, and the
extra terms an algorithm adds (:class:`LossTerm`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llamagym.models.policy import Evaluation


@dataclass(frozen=True)
class LossTerm:
    """One more term of the clipped-policy-gradient loss: ``weight * compute(index,
    new)`` for the minibatch of turn positions ``index`` and its evaluation ``new``
    (e.g. PPO's value loss). Its mean over the update's steps is reported as ``name``."""

    name: str
    weight: float
    compute: Callable[[list[int], Evaluation], torch.Tensor]


def zero_metrics(extra_losses: Sequence[LossTerm]) -> dict[str, float]:
    """The metrics of a clipped-policy-gradient step, each at 0, in their report order."""
    metrics = {"policy_loss": 0.0, **{term.name: 0.0 for term in extra_losses}}
    metrics.update(entropy=0.0, kl_ref=0.0, approx_kl=0.0, clip_fraction=0.0)
    return metrics


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's unmasked units, then over rows (long replies don't dominate)."""
    per_row = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_row.mean()


@dataclass
class Surrogate:
    loss: torch.Tensor  # the clipped surrogate, to minimise
    approx_kl: float  # KL(rollout || current) on this minibatch, ((r - 1) - log r)
    clip_fraction: float  # share of units whose ratio left [1 - eps, 1 + eps]


def clipped_surrogate(
    new: Evaluation, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> Surrogate:
    """PPO's clipped objective per action unit; ``advantages`` is one number per turn.

    At the first step after a rollout the ratio is 1 and this is the plain policy
    gradient, so REINFORCE-style algorithms take the same path and stay safe over epochs.
    """
    log_ratio = (new.logprobs - old_logprobs) * new.mask
    ratio = log_ratio.exp()
    advantage = advantages[:, None]
    surrogate = torch.max(
        -advantage * ratio, -advantage * ratio.clamp(1 - clip_range, 1 + clip_range)
    )
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - log_ratio, new.mask).item()
        clipped = ((ratio - 1).abs() > clip_range).float()
        clip_fraction = masked_mean(clipped, new.mask).item()
    return Surrogate(masked_mean(surrogate, new.mask), approx_kl, clip_fraction)


def reference_kl(
    new_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """KL(current || reference) per unit with the non-negative ``k3`` estimator
    (exp(d) - 1 - d, d = log ref - log current), as in GRPO and TRL."""
    delta = (reference_logprobs - new_logprobs) * mask
    return masked_mean(delta.exp() - 1 - delta, mask)
