"""What a person sees during a run: a live rich progress bar, and the end-of-run table."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from llamagym.training.records.report import format_speed

# The algorithm statistics worth a glance, in order of preference; the first three an
# algorithm reports are shown.
KEY_STATS = (
    ("policy_loss", "loss", "+.3f"),
    ("approx_kl", "kl", ".4f"),
    ("entropy", "entropy", ".3f"),
    ("value_loss", "value loss", ".3f"),
    ("kl_ref", "kl(ref)", ".4f"),
    ("loss", "loss", "+.3f"),
)


def format_stats(metrics: Mapping[str, float]) -> str:
    """One line: moving-average return, invalid replies, speed, the update's key stats."""
    parts = [
        f"return {metrics.get('return_moving_average', 0.0):+.3f}",
        f"invalid {metrics.get('invalid_rate', 0.0):.1%}",
        format_speed(metrics.get("env_steps_per_second", 0.0)),
    ]
    shown = 0
    for key, label, spec in KEY_STATS:
        if key in metrics and shown < 3:
            parts.append(f"{label} {metrics[key]:{spec}}")
            shown += 1
    return " │ ".join(parts)


class ElapsedColumn(ProgressColumn):
    """Time since the bar appeared. Unlike rich's own column it keeps counting once the
    bar is full: a run past its time budget is still finishing an update."""

    def render(self, task: Task) -> Text:
        if task.start_time is None:
            return Text("-:--:--", style="progress.elapsed")
        seconds = int(max(0.0, task.get_time() - task.start_time))
        return Text(str(timedelta(seconds=seconds)), style="progress.elapsed")


class RunProgress:
    """A bar over episodes (or over minutes for a time budget) with, on the line below,
    the last update's stats: two lines fit a normal terminal where one would be cut.

    The bar's label is the current phase ("collecting 12/64 episodes", "update epoch
    2/4"), set through :meth:`phase`, which also moves a time budget's bar on between
    updates."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self._progress: Progress | None = None
        self._live: Live | None = None
        self._stats = Text("waiting for the first update", style="dim")
        self._task: TaskID | None = None
        self._by_minutes = False
        self._minutes: float | None = None
        self._episodes: int | None = None
        self._done_episodes = 0

    def start(
        self,
        episodes: int | None,
        minutes: float | None,
        done_episodes: int = 0,
        done_seconds: float = 0.0,
    ) -> None:
        """Show the bar; a resumed run starts it where the checkpoint left off."""
        self._by_minutes = episodes is None and minutes is not None
        self._minutes = minutes
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.fields[phase]}"),
            BarColumn(bar_width=24),
            TextColumn("{task.fields[amount]}"),
            ElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.console,
        )
        total = minutes * 60 if self._by_minutes and minutes else episodes
        completed = done_seconds if self._by_minutes else done_episodes
        self._task = self._progress.add_task(
            "train",
            total=total,
            # rich annotates add_task's completed as int; a task's progress is a float.
            completed=completed,  # type: ignore[arg-type]
            amount=self._amount(done_episodes, done_seconds, episodes),
            phase="training",
        )
        self._episodes = episodes
        self._done_episodes = done_episodes
        self._live = Live(
            Group(self._progress, self._stats), console=self.console, refresh_per_second=4
        )
        self._live.start()

    def _amount(self, episodes: int, seconds: float, total: int | None) -> str:
        if self._by_minutes:
            return f"{seconds / 60:.1f}/{self._minutes:g} min, {episodes:,} episodes"
        return f"{episodes:,}/{total:,} episodes" if total else f"{episodes:,} episodes"

    def phase(self, text: str, seconds: float | None = None) -> None:
        """Say what the run is doing now; with ``seconds`` (training time so far) a time
        budget's bar and amount move on too, so they do not wait for the next update."""
        if self._progress is None or self._task is None:
            return
        fields: dict[str, Any] = {"phase": text}
        if seconds is not None and self._by_minutes:
            fields["completed"] = seconds
            fields["amount"] = self._amount(self._done_episodes, seconds, self._episodes)
        self._progress.update(self._task, **fields)

    def update(self, episodes: int, seconds: float, metrics: Mapping[str, float]) -> None:
        if self._progress is None or self._task is None:
            return
        self._done_episodes = episodes
        self._progress.update(
            self._task,
            completed=seconds if self._by_minutes else episodes,
            amount=self._amount(episodes, seconds, self._episodes),
            phase="training",
        )
        self._stats.plain = f"update {int(metrics.get('update', 0))}: {format_stats(metrics)}"
        self._stats.style = ""

    def evaluation(self) -> EvaluationProgress:
        """A bar for the evaluation after training, on the same console."""
        return EvaluationProgress(self.console)

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
            if not self.console.is_terminal:
                self.console.line()  # a terminal ends the live lines itself; a pipe does not
        self._progress = None


class EvaluationProgress:
    """A bar over an evaluation's episodes: the agent's, then each baseline's on the
    same seeds. Use it as a context manager and call it with ``(policy, episodes
    finished, episodes in all)``, as
    :func:`llamagym.training.loop.final_evaluation.evaluate_with_baselines` does.

    It draws on a terminal only, and is gone once the evaluation ends (the table comes
    next): a log file or a pipe gets no bar lines, and output on stdout (``llamagym eval
    --json``) is never touched. ``calls`` counts the reports received, shown or not."""

    def __init__(self, console: Console | None = None):
        self.console = console or Console(stderr=True)
        self.calls = 0
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._policy: str | None = None

    def __enter__(self) -> EvaluationProgress:
        if self.console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(),
                TextColumn("[bold]{task.description}"),
                BarColumn(bar_width=24),
                MofNCompleteColumn(),
                TextColumn("episodes"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self._progress.start()
        return self

    def __call__(self, policy: str, finished: int, total: int) -> None:
        self.calls += 1
        if self._progress is None:
            return
        if self._task is None or policy != self._policy:
            # A new policy: a new bar, so its clock and eta start from zero.
            if self._task is not None:
                self._progress.remove_task(self._task)
            label = "evaluating the agent" if policy == "agent" else f"baseline {policy}"
            self._task = self._progress.add_task(label, total=total)
            self._policy = policy
        self._progress.update(self._task, completed=finished, total=total)

    def __exit__(self, *exc_info: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress, self._task, self._policy = None, None, None


def outcome_names(results: Sequence[Any]) -> list[str]:
    """The outcomes named in ``results`` (evaluation results), in the agent's order."""
    names: list[str] = []
    for result in results:
        names += [name for name in result.outcomes if name not in names]
    return names


def evaluation_table(
    agent_result: Any,
    baselines: Sequence[Any],
    title: str = "Evaluation",
    greedy: bool = True,
    agent_label: str = "trained agent",
) -> Table:
    """The agent's result and every baseline's, on the same episode seeds, with the
    share of each outcome the agent names (no outcome column when it names none). A
    policy whose episodes were all the same one shows "identical episodes" instead of
    a 95% CI."""
    how = "greedy" if greedy else "sampled"
    table = Table(
        title=f"{title}: {agent_result.episodes:,} episodes ({how}), baselines on the same seeds",
        title_justify="left",
    )
    rows = [agent_result, *sorted(baselines, key=lambda b: -b.mean)]
    names = outcome_names(rows)
    table.add_column("policy", style="bold")
    table.add_column("mean return", justify="right")
    table.add_column("95% CI", justify="right")
    if names:
        table.add_column(" / ".join(names), justify="right")
    table.add_column("invalid", justify="right")
    for result in rows:
        cells = [
            agent_label if result is agent_result else result.name,
            f"{result.mean:+.3f}",
            "identical episodes" if result.identical else f"± {result.ci95:.3f}",
        ]
        if names:
            outcomes = result.outcomes
            cells.append(
                " / ".join(f"{outcomes.get(name, 0.0):.0%}" for name in names)
                if outcomes
                else "n/a"
            )
        cells.append(f"{result.invalid_rate:.1%}" if result is agent_result else "")
        table.add_row(*cells)
    if agent_result.identical:
        table.caption = (
            f"The agent's {agent_result.episodes:,} episodes were all the same episode: "
            "no confidence interval (see the warning above)."
        )
        table.caption_justify = "left"
    return table


def summary_table(summary: Any) -> Table:
    """The end-of-run evaluation table of a :class:`llamagym.training.loop.trainer.RunSummary`."""
    if summary.evaluation is None:
        return Table(title="No evaluation")
    greedy = getattr(summary, "greedy", True)
    return evaluation_table(
        summary.evaluation, summary.baselines, title="Final evaluation", greedy=greedy
    )
