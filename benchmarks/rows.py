"""What the row benchmarks share (``sparse_rewards.py``, ``many_actions.py``): a row is
one change from a baseline row, trained with each of a few seeds, one run at a time,
each run in a fresh worker process that prints its result (``common.run_command``).

Here: the :class:`Setup` of a row, the run loop, the per-row summary over seeds with a
Student t interval, the options every such script takes, a row's command, keeping the
other rows of an earlier result file, a script's whole ``main`` (:class:`RowBenchmark`
says what differs), the warm-start demonstrations a row may record and a run's update
records.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import (
    DEFAULT_RESULTS_DIR,
    add_allow_dirty,
    ci95_over_seeds,
    emit_result,
    refuse_dirty_tree,
    result_path,
    run_command,
    script_command,
    write_script_result,
)

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


# -- a row benchmark's main ---------------------------------------------------------------
#: Quick and full: evaluation episodes and demonstration episodes per run, and seeds.
QUICK_EVAL_EPISODES = 20
DEMONSTRATION_EPISODES = {True: 20, False: 200}
SEEDS = {True: [0], False: [0, 1]}


@dataclass(frozen=True)
class RowBenchmark:
    """What one row benchmark script brings to :func:`main`; the rest is shared."""

    script: Path  # the file a worker runs
    result_name: str  # results/<result_name>[-quick].json
    setups: Sequence[Setup]
    quick_setup: str  # the one row of a --quick run
    description: str
    eval_episodes: int  # greedy evaluation episodes per run of a full run
    add_budget: Callable[[argparse.ArgumentParser], None]  # the training budget's options
    # The budget from the options and --quick, as worker spec keys (``episodes``,
    # ``minutes``); the result file records each as ``<key>_per_run``.
    budget: Callable[[argparse.Namespace], dict[str, Any]]
    train: Callable[[Mapping[str, Any]], dict[str, Any]]  # one run, in the worker
    line: Callable[[Mapping[str, Any]], str]  # stderr's line about a finished run
    # The result's fields before the budget (the env, the model) and after the threads
    # (exact values, the baselines over the runs kept), from every run kept.
    head: Mapping[str, Any]
    findings: Callable[[Sequence[Mapping[str, Any]]], dict[str, Any]]
    measure: str = "success"
    also_per_seed: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The result's name in its header: the script's file name without ``.py``."""
        return self.script.stem


def main(benchmark: RowBenchmark, argv: Sequence[str] | None = None) -> int:
    """A row benchmark script's ``main``: ``--worker SPEC`` trains one run in this
    process; otherwise every chosen row with every seed, each in a fresh worker, the
    summary per row, the result file (keeping the other rows of a comparable earlier
    one with ``--only``) and the summary as JSON on stdout."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        emit_result(benchmark.train(json.loads(argv[argv.index("--worker") + 1])))
        return 0
    setups = benchmark.setups
    parser = argparse.ArgumentParser(description=benchmark.description)
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: row {benchmark.quick_setup!r}, seed 0, 64 episodes, "
        f"{QUICK_EVAL_EPISODES} eval",
    )
    benchmark.add_budget(parser)
    add_row_arguments(parser, setups, benchmark.result_name, benchmark.eval_episodes)
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    quick = args.quick
    refuse_dirty_tree(benchmark.name, quick, args.allow_dirty)
    budget = benchmark.budget(args)
    eval_episodes = args.eval_episodes or (
        QUICK_EVAL_EPISODES if quick else benchmark.eval_episodes
    )
    seeds = args.seeds or SEEDS[quick]
    names = args.only or ([benchmark.quick_setup] if quick else [s.name for s in setups])
    chosen = [s for s in setups if s.name in names]

    runs_dir = args.keep_runs or Path(
        tempfile.mkdtemp(prefix=f"llamagym-{benchmark.result_name}-")
    )
    started = time.perf_counter()

    def spec(setup: Setup, seed: int) -> dict[str, Any]:
        return {
            "setup": setup.name,
            "seed": seed,
            **budget,
            "eval_episodes": eval_episodes,
            "demonstration_episodes": DEMONSTRATION_EPISODES[quick],
            "threads": args.threads,
            "run_dir": str(runs_dir / f"{setup.name}-seed{seed}"),
        }

    runs = run_rows(benchmark.script, chosen, seeds, spec, args.threads, benchmark.line)
    if args.keep_runs is None:
        shutil.rmtree(runs_dir, ignore_errors=True)

    command = script_command(benchmark.script.name, without_only(argv))
    summary = {
        s.name: summarise(
            s,
            [r for r in runs if r["setup"] == s.name],
            command,
            measure=benchmark.measure,
            also_per_seed=benchmark.also_per_seed,
        )
        for s in chosen
    }
    recorded = {f"{key}_per_run": value for key, value in budget.items()}
    output = args.output or result_path(DEFAULT_RESULTS_DIR, benchmark.result_name, quick)
    if args.only:  # keep the other rows of a comparable earlier file
        comparable = {**recorded, "eval_episodes": eval_episodes, "seeds": seeds}
        summary, runs = keep_earlier_rows(output, comparable, summary, runs)
    order = [s.name for s in setups]
    result = {
        **benchmark.head,
        **recorded,
        "eval_episodes": eval_episodes,
        "seeds": seeds,
        "threads": args.threads,
        **benchmark.findings(runs),
        "summary": {name: summary[name] for name in order if name in summary},
        "runs": sorted(runs, key=lambda r: (order.index(r["setup"]), r["seed"])),
        "total_wall_seconds": time.perf_counter() - started,
    }
    path = write_script_result(benchmark.name, quick, output, result, argv)
    print(json.dumps({k: result[k] for k in ("exact", "baselines", "summary")}, indent=2))
    print(f"written to {path}", file=sys.stderr)
    return 0


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
    from llamagym.resolver.layers import resolve_agent_config
    from llamagym.rollout.demonstrations import record_demonstrations

    if setup.demonstrations is None:
        return dict(layers), None
    plain = agent_class(config=resolve_agent_config(agent_class, [("row", layers)]))
    engine = plain.evaluation_engine(1)
    try:
        recording = record_demonstrations(
            engine,
            setup.demonstrations,
            episodes,
            run_dir.parent / f"{run_dir.name}-demonstrations.jsonl",
            seed=seed,
        )
    finally:
        engine.close()
    moved = {"algorithm": {"warm_start": {"demonstrations": str(recording.path)}}}
    return deep_merge(dict(layers), moved), recording


def worker_output(run_dir: Path) -> dict[str, Any]:
    """A worker run's ``output`` config section: its files in ``run_dir`` (replaced if
    there), nothing printed, and no report, TensorBoard log or checkpoint to slow it."""
    return {
        "dir": str(run_dir),
        "quiet": True,
        "overwrite": True,
        "report": False,
        "tensorboard": False,
        "checkpoint_every": 0,
    }


def update_records(run_dir: Path) -> list[dict[str, Any]]:
    """The run's ``kind: update`` lines of ``metrics.jsonl``, in order."""
    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "update"]
