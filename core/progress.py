"""A live rich progress bar for a training run, and the end-of-run summary table."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


class RunProgress:
    """Episodes (or minutes) done, with the moving-average return and update stats."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self._minutes: float | None = None

    def start(self, episodes: int | None, minutes: float | None) -> None:
        self._minutes = minutes if episodes is None else None
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn() if self._minutes is None else TextColumn("{task.percentage:>3.0f}%"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
            transient=False,
        )
        total = episodes if self._minutes is None else self._minutes * 60
        self._task = self._progress.add_task("train", total=total, stats="")
        self._progress.start()

    def update(self, episodes: int, seconds: float, metrics: dict[str, float]) -> None:
        stats = (
            f"return(ma) {metrics.get('return_moving_average', 0):+.3f}  "
            f"invalid {100 * metrics.get('invalid_rate', 0):.1f}%  "
            f"{metrics.get('env_steps_per_second', 0):.0f} steps/s  "
            f"loss {metrics.get('policy_loss', 0):+.3f}  "
            f"kl {metrics.get('approx_kl', 0):.4f}"
        )
        completed = episodes if self._minutes is None else seconds
        self._progress.update(self._task, completed=completed, stats=stats)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


def summary_table(summary: Any) -> Table:
    table = Table(title="Greedy evaluation", title_justify="left")
    table.add_column("policy", style="bold")
    table.add_column("mean return", justify="right")
    table.add_column("95% CI", justify="right")
    table.add_column("episodes", justify="right")
    table.add_column("win / draw / loss", justify="right")
    rows = [summary.evaluation, *summary.baselines] if summary.evaluation else []
    for result in rows:
        outcomes = result.outcomes
        wdl = (
            f"{outcomes['win']:.1%} / {outcomes['draw']:.1%} / {outcomes['loss']:.1%}"
            if outcomes
            else ""
        )
        table.add_row(
            "trained agent" if result.name == "agent" else result.name,
            f"{result.mean:+.3f}",
            f"± {result.ci95:.3f}",
            str(result.episodes),
            wdl,
        )
    return table
