"""A run's budget: episodes, minutes or both (whichever ends first), the share of it
used, and the watch over a collection that stops it when a signal comes or the minutes
are used up."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llamagym.errors import LlamaGymError
from llamagym.schedule import run_budgets
from llamagym.training.loop.run_state import Counters

TIME_BUDGET = "time budget"  # the stop reason when --minutes is used up


def stop_cause(reason: str | None) -> str:
    """A stop reason as the warnings say it: "time budget used up", "SIGTERM received"."""
    if reason is None:
        return "stop requested"
    return "time budget used up" if reason == TIME_BUDGET else f"{reason} received"


class CollectionWatch:
    """Handed to :meth:`RolloutEngine.collect` for one update's batch: counts the
    finished episodes for the progress bar and, after every env step, moves the bar's
    clock on and says whether to stop: a signal was received or the time budget is
    used up. ``may_stop`` False (several processes, which stop together between
    updates) only shows progress."""

    def __init__(
        self,
        progress: Any,
        time_used: Callable[[], float],
        stop_reason: Callable[[], str | None],
        wanted: int,
        may_stop: bool,
    ):
        self.progress, self.time_used, self.stop_reason = progress, time_used, stop_reason
        self.wanted, self.may_stop = wanted, may_stop
        self.finished = 0
        #: why the collection was cut short ("time budget", "SIGTERM"...), else None
        self.reason: str | None = None

    def show(self) -> None:
        if self.progress is not None and hasattr(self.progress, "phase"):
            self.progress.phase(
                f"collecting {self.finished:,}/{self.wanted:,} episodes", self.time_used()
            )

    def on_episode(self, episode: Any) -> None:
        self.finished += 1
        self.show()

    def should_stop(self) -> bool:
        self.show()
        if self.may_stop and self.reason is None:
            self.reason = self.stop_reason()
        return self.reason is not None


def refuse_a_spent_budget(
    agent: str, resume: Path | None, meta: dict[str, Any], training: Any
) -> None:
    """A resumed run whose checkpoint has used the whole budget would only evaluate
    again: refused, with the flags that train on and the command that evaluates."""
    counters = meta.get("counters") or {}
    episodes, seconds = counters.get("episodes", 0), counters.get("seconds", 0.0)
    episode_budget, time_budget = run_budgets(training)
    spent = []
    if episode_budget is not None and episodes >= episode_budget:
        spent.append(f"{episodes:,} of {episode_budget:,} episodes")
    if time_budget is not None and seconds >= time_budget:
        spent.append(f"{seconds / 60:.1f} of {training.minutes:g} minutes")
    if not spent:
        return
    raise LlamaGymError(
        f"the run in {str(resume)!r} has used its budget ({' and '.join(spent)}): to train "
        f"on, give a larger one (e.g. --resume {resume} --episodes {2 * max(episodes, 1)} "
        f"or --minutes M), or evaluate it with `llamagym eval {agent} --checkpoint {resume}`"
    )


def budget_fraction(
    counters: Counters, episode_budget: int | None, time_budget: float | None
) -> float:
    """How much of the training budget is used, 0..1 (the larger of the two budgets'
    shares when both are set)."""
    shares = [0.0]
    if episode_budget:
        shares.append(counters.episodes / episode_budget)
    if time_budget:
        shares.append(counters.seconds / time_budget)
    return min(1.0, max(shares))
