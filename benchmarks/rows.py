"""What the row benchmarks share (``sparse_rewards.py``, ``many_actions.py``): a row is
one change from a baseline row, trained with each of a few seeds, one run at a time,
each run in a fresh worker process that prints its result (``common.run_command``).

Here: the :class:`Setup` of a row, the run loop, the per-row summary over seeds with a
Student t interval, the options every such script takes, a row's command, keeping the
other rows of an earlier result file, the warm-start demonstrations a row may record
and a run's update records.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import run_command

T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}  # two-sided Student t, by degrees of freedom
#: What a row's summary averages over its runs, besides its measures.
AVERAGED = ("invalid_rate", "episodes", "train_seconds", "wall_seconds")


@dataclass(frozen=True)
class Setup:
    """One row: what it changes from the baseline row, as config sections."""

    name: str
    what: str
    settings: Mapping[str, Any] = field(default_factory=dict)
    demonstrations: str | None = None  # a baseline whose play is recorded and taught first

    def assignments(self) -> list[str]:
        """The settings as ``--set KEY=VALUE`` words (for the table's command column)."""
        words: list[str] = []

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, Mapping):
                for key, inner in value.items():
                    walk(f"{prefix}.{key}" if prefix else key, inner)
            else:
                words.append(f"{prefix}={json.dumps(value) if isinstance(value, bool) else value}")

        walk("", self.settings)
        return words


# -- options and commands -----------------------------------------------------------------
def add_row_arguments(
    parser: argparse.ArgumentParser,
    setups: Sequence[Setup],
    result_name: str,
    eval_default: int,
) -> None:
    """The options every row benchmark takes besides ``--quick`` and its budget."""
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=None,
        help=f"greedy evaluation episodes per run (default {eval_default})",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default: 0 1")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[s.name for s in setups],
        help="run only these rows (the others are kept from an earlier "
        "result file with the same budget)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"where the JSON goes (default: results/{result_name}.json)",
    )
    parser.add_argument(
        "--keep-runs",
        type=Path,
        default=None,
        help="keep the run directories here (default: a temporary one)",
    )


def without_only(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--only`` and its names: each row's command adds its own."""
    kept, skipping = [], False
    for word in argv:
        if word == "--only" or word.startswith("--only="):
            skipping = word == "--only"
        elif skipping and not word.startswith("-"):
            continue
        else:
            kept.append(word)
            skipping = False
    return kept


# -- running the rows ---------------------------------------------------------------------
def run_rows(
    script: Path,
    setups: Sequence[Setup],
    seeds: Sequence[int],
    spec: Callable[[Setup, int], Mapping[str, Any]],
    threads: int,
    line: Callable[[Mapping[str, Any]], str],
) -> list[dict[str, Any]]:
    """Every row with every seed, one run at a time (each is timed on the clock it
    shares), each as ``python SCRIPT --worker SPEC`` in a fresh process; ``line`` is
    what stderr gets about a finished run."""
    runs: list[dict[str, Any]] = []
    for setup in setups:
        for seed in seeds:
            command = [sys.executable, str(script), "--worker", json.dumps(dict(spec(setup, seed)))]
            run = run_command(command, threads)
            runs.append(run)
            print(f"{setup.name:<16} seed {seed}: {line(run)}", file=sys.stderr, flush=True)
    return runs


def ci95_over_seeds(values: Sequence[float]) -> float | None:
    """Half-width of the 95% interval of the mean over seeds (Student t); None for one."""
    n = len(values)
    if n < 2:
        return None
    return T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)


def summarise(
    setup: Setup,
    runs: Sequence[Mapping[str, Any]],
    command: str,
    measure: str = "success",
    also_per_seed: Iterable[str] = (),
    averaged: Iterable[str] = AVERAGED,
) -> dict[str, Any]:
    """One row over its seeds: ``measure`` per seed, its mean and interval, the same
    (without interval) for ``also_per_seed``, the mean of ``averaged`` and the row's
    command."""
    values = [run[measure] for run in runs]
    row: dict[str, Any] = {
        "what": setup.what,
        "settings": setup.assignments(),
        "seeds": [run["seed"] for run in runs],
        measure: statistics.fmean(values),
        f"{measure}_per_seed": values,
        "ci95_over_seeds": ci95_over_seeds(values),
    }
    for name in also_per_seed:
        per_seed = [run[name] for run in runs]
        row[name] = statistics.fmean(per_seed)
        row[f"{name}_per_seed"] = per_seed
    for name in averaged:
        row[name] = statistics.fmean(run[name] for run in runs)
    row["command"] = f"{command} --only {setup.name}"
    return row


def keep_earlier_rows(
    output: Path,
    budget: Mapping[str, Any],
    summary: dict[str, Any],
    runs: list[dict[str, Any]],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """With ``--only``: the rows of the earlier file at ``output`` that were not run
    again, beside the new ones, if that file's ``budget`` keys hold the same values."""
    if not output.is_file():
        return summary, runs
    earlier = json.loads(output.read_text(encoding="utf-8"))
    if any(earlier.get(key) != value for key, value in budget.items()):
        return summary, runs
    again = {run["setup"] for run in runs}
    summary = {**{k: v for k, v in earlier["summary"].items() if k not in again}, **summary}
    return summary, [r for r in earlier["runs"] if r["setup"] not in again] + runs


# -- inside a worker ----------------------------------------------------------------------
def with_demonstrations(
    agent_class: type,
    setup: Setup,
    layers: Mapping[str, Any],
    episodes: int,
    run_dir: Path,
    seed: int,
) -> tuple[dict[str, Any], Any]:
    """``layers`` with ``algorithm.warm_start.demonstrations`` pointing at ``episodes``
    recorded episodes of the row's baseline (and the recording), or unchanged (and None)
    for a row without demonstrations."""
    from llamagym.config import deep_merge
    from llamagym.config_layers import resolve_agent_config
    from llamagym.rollout.demonstrations import record_demonstrations

    if setup.demonstrations is None:
        return dict(layers), None
    plain = agent_class(config=resolve_agent_config(agent_class, [("row", layers)]))
    recording = record_demonstrations(
        plain,
        setup.demonstrations,
        episodes,
        run_dir.parent / f"{run_dir.name}-demonstrations.jsonl",
        seed=seed,
    )
    moved = {"algorithm": {"warm_start": {"demonstrations": str(recording.path)}}}
    return deep_merge(dict(layers), moved), recording


def update_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``kind: update`` lines of ``metrics.jsonl``, in order."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "update"]
