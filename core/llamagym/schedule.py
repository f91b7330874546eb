"""What a run's parts read about the run's course: its budgets (:func:`run_budgets`), the
:class:`Schedule` (the share of the budget used, and the sampling temperature and
learning rate that follow from it), an optimizer's :class:`LearningRate` on it, and the
:class:`Control` of an update (may it go on, which epoch is starting).

One owner moves the schedule (the trainer, before each collection and update, with
``schedule.set_progress``); the rollout engine and the algorithm only read it. A
hand-written loop that never moves it trains at progress 0: the starting temperature
and the full learning rate.

Top level: a floor of its own between the plugin runtime and the config: the
rollout, the algorithms, the trainer and the resolver's TRL arguments read it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llamagym.config import RolloutSettings

if TYPE_CHECKING:
    import torch

#: The episodes a run trains when neither ``training.episodes`` nor ``training.minutes``
#: is set anywhere.
DEFAULT_EPISODES = 1000
#: The annealed learning rate never drops below this share of the configured one.
LR_FLOOR = 0.05
#: The lowest temperature sampling uses. Logits divided by it stay finite in float32
#: (whose largest value is 3.4e38) for any logit below 1e32, while below it sampling is
#: already argmax; a smaller configured temperature (1e-320 passes ``> 0``) would make
#: inf and then nan probabilities.
MIN_TEMPERATURE = 1e-6


class Schedule:
    """The fraction of the run's budget used so far, and what is scheduled on it."""

    def __init__(self, rollout: RolloutSettings):
        self._rollout = rollout
        self._progress = 0.0

    @property
    def progress(self) -> float:
        """The share of the budget (episodes or minutes) used so far, from 0 to 1."""
        return self._progress

    def set_progress(self, fraction: float) -> None:
        """Move the schedule to ``fraction`` of the budget used (kept within 0 to 1: a
        run past its budget stays at the end of every schedule)."""
        fraction = float(fraction)
        if math.isnan(fraction):
            raise ValueError("progress must be a fraction from 0 to 1, got nan")
        self._progress = min(max(fraction, 0.0), 1.0)

    def temperature(self) -> float:
        """The sampling temperature now: ``rollout.temperature``, moved linearly to
        ``rollout.final_temperature`` over the budget when that is set, and never below
        :data:`MIN_TEMPERATURE`."""
        start, final = self._rollout.temperature, self._rollout.final_temperature
        now = start if final is None else start + self._progress * (final - start)
        return max(now, MIN_TEMPERATURE)

    def lr(self, base: float, anneal: bool) -> float:
        """The learning rate now: ``base``, or with ``anneal`` a linear decay to 5% of
        it over the budget (late updates then stop undoing what was learnt)."""
        return base * max(LR_FLOOR, 1.0 - self._progress) if anneal else base


@dataclass(frozen=True)
class LearningRate:
    """The one writer of an optimizer's learning rate: ``base`` on the run's
    :class:`Schedule` (with ``anneal``, the linear decay of :meth:`Schedule.lr`), of which
    optimizer step ``n`` (from 1) of the first ``warmup_steps`` takes ``n / warmup_steps``
    (Adam's first step moves every weight by the whole rate, whatever its gradient)."""

    schedule: Schedule
    base: float
    anneal: bool = False
    warmup_steps: int = 0

    def at(self, step: int) -> float:
        """The rate of optimizer step ``step`` (from 1) now."""
        share = min(1.0, step / self.warmup_steps) if self.warmup_steps else 1.0
        return self.schedule.lr(self.base, self.anneal) * share

    def set(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Give every parameter group of ``optimizer`` the rate of step ``step``."""
        rate = self.at(step)
        for group in optimizer.param_groups:
            group["lr"] = rate


def never_stop() -> bool:
    return False


def ignore_epoch(epoch: int, epochs: int) -> None:
    return None


@dataclass(frozen=True)
class WarmStartLimit:
    """Where a warm start's passes over its demonstrations end early: at ``deadline`` (a
    ``time.perf_counter()`` reading: a fresh run's share of its time budget) or after
    ``batches`` batches (a resumed run's: those the run it continues took, so its weights
    and KL reference are the unbroken run's). The default: no limit."""

    deadline: float | None = None
    batches: int | None = None

    def reached(self, batches: int) -> bool:
        """True when a warm start that has taken ``batches`` batches must stop."""
        if self.batches is not None:
            return batches >= self.batches
        return self.deadline is not None and time.perf_counter() >= self.deadline


@dataclass(frozen=True)
class Control:
    """How the one running an algorithm steers its updates.

    ``should_stop()`` turns True once a stop has been asked for (SIGINT/SIGTERM): an
    update then ends at its next minibatch boundary, keeping the steps already taken,
    and reports ``update_interrupted: 1.0``. ``on_epoch(k, epochs)`` is told when epoch
    ``k`` (from 1) of an update starts (the progress bar shows it). ``warm_start`` bounds
    the supervised steps before the first update. The defaults never stop and show
    nothing.
    """

    should_stop: Callable[[], bool] = never_stop
    on_epoch: Callable[[int, int], None] = ignore_epoch
    warm_start: WarmStartLimit = field(default_factory=WarmStartLimit)


def run_budgets(training: Any) -> tuple[int | None, float | None]:
    """A run's budgets: episodes (``training.episodes``, or :data:`DEFAULT_EPISODES` when
    neither it nor ``training.minutes`` is set; None: time alone) and seconds (None:
    episodes alone)."""
    episodes = training.episodes
    if episodes is None and training.minutes is None:
        episodes = DEFAULT_EPISODES
    return episodes, 60 * training.minutes if training.minutes else None
