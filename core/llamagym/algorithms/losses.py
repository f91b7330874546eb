"""The terms of the clipped-policy-gradient loss that
:meth:`~llamagym.algorithms.algorithm.Algorithm.optimise` minimises: PPO's clipped
surrogate, and the terms an algorithm lists beside it (:class:`LossTerm`: its own, the
:func:`entropy_bonus`, the KL to the reference, :func:`reference_penalty`), with the
masked means they are taken with."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from llamagym.algorithms.turn_scoring import TurnScoring
from llamagym.models.policy import Evaluation
from llamagym.rollout.trajectory import Turn


@dataclass(frozen=True)
class LossTerm:
    """One term of the clipped-policy-gradient loss beside the surrogate: ``weight *
    compute(index, new)`` for the minibatch of turn positions ``index`` and its
    evaluation ``new`` (PPO's value loss, the entropy bonus, the KL to the reference).
    Its mean over the update's steps is reported as ``name``; a ``compute`` that gives
    None adds nothing (and 0 to the mean). ``prepare``, when there is one, runs once per
    update before its first step, on all the update's turns, so many per pass."""

    name: str
    weight: float
    compute: Callable[[list[int], Evaluation], torch.Tensor | None]
    prepare: Callable[[Sequence[Turn], int], None] | None = None


def entropy_bonus(coef: float) -> LossTerm:
    """The policy's entropy (over the legal actions, where the agent names them),
    rewarded with weight ``coef``: its term is ``-coef x`` the mean entropy."""
    return LossTerm("entropy", -coef, lambda index, new: masked_mean(new.entropy, new.mask))


def reference_penalty(scoring: TurnScoring, coef: float) -> LossTerm:
    """``coef x`` KL(current || reference) (:func:`reference_kl`). The reference never
    moves during an update, so its log-probabilities of every turn are scored once,
    before the first step; with ``coef`` 0 nothing is scored and the term adds nothing."""
    scored: list[list[list[float]]] = []  # this update's, once prepared

    def prepare(turns: Sequence[Turn], chunk: int) -> None:
        scored.clear()
        if coef > 0 and turns:
            scored.append(scoring.reference_logprob_lists(turns, chunk))

    def compute(index: list[int], new: Evaluation) -> torch.Tensor | None:
        if not scored:
            return None
        reference = scoring.padded([scored[0][i] for i in index], new.logprobs.shape[1])
        return reference_kl(new.logprobs, reference, new.mask)

    return LossTerm("kl_ref", coef, compute, prepare)


def zero_metrics(terms: Sequence[LossTerm]) -> dict[str, float]:
    """The metrics of a clipped-policy-gradient step, each at 0, in their report order."""
    metrics = {"policy_loss": 0.0, **{term.name: 0.0 for term in terms}}
    metrics.update(approx_kl=0.0, clip_fraction=0.0)
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
