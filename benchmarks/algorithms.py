"""Every algorithm on Blackjack with the tiny model, for a fixed wall-clock budget.

    python benchmarks/algorithms.py            # 5 min x 3 seeds x 5 runs, 20,000 eval episodes
    python benchmarks/algorithms.py --quick    # a smoke run, under 2 minutes in all
    python benchmarks/algorithms.py --jobs 2   # two runs at a time, one core each

Each run is the CLI a user would type (``llamagym run blackjack --algorithm X --minutes M
--seed S --eval-episodes N --output DIR --quiet``), one after another by default, or
``--jobs`` at a time, each on its own core (a run uses one torch thread). The greedy
evaluation's mean, 95% CI and invalid-reply rate, the episodes trained and the wall time
go to ``benchmarks/results/algorithms.json``, per seed and as a summary over seeds (mean
of the seed means, with a t-based 95% CI over seeds), beside each row's target.
``--quick`` checks that every row runs end to end (its numbers mean nothing after 8 s of
training) and writes ``algorithms-quick.json`` instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    ci95_over_seeds,
    refuse_dirty_tree,
    result_header,
    script_command,
    write_record,
)

RESULTS = Path(__file__).resolve().parent / "results" / "algorithms.json"
QUICK_RESULTS = RESULTS.with_name("algorithms-quick.json")


@dataclass(frozen=True)
class Setup:
    """One row of the table: an algorithm, a mode and the settings it runs with."""

    name: str
    algorithm: str
    mode: str = "score"
    settings: tuple[str, ...] = ()  # extra ``--set KEY=VALUE`` on top of the agent defaults
    target: float | None = None  # the mean return over seeds to reach
    max_invalid_rate: float | None = None
    # A baseline whose play (``llamagym record``) the run warm-starts on, if any.
    demonstrations: str | None = None


# The critic-free rows take PPO's batch shape from the Blackjack defaults (512 episodes,
# minibatches of 128, 4 epochs, entropy 0.01) and a KL pull to the untrained policy:
# without it the shared "stick" bias wins in a few updates, every seed group then
# returns the same reward, and no signal is left to learn the state-dependent play.
CRITIC_FREE = (
    "algorithm.episodes_per_update=512",
    "algorithm.minibatch_size=128",
    "algorithm.epochs=4",
    "algorithm.entropy_coef=0.01",
    "algorithm.kl_coef=0.05",
)
SETUPS = (
    Setup("ppo", "ppo", target=-0.055),
    Setup("grpo", "grpo", settings=("algorithm.group_size=8", *CRITIC_FREE), target=-0.09),
    Setup("rloo", "rloo", settings=("algorithm.group_size=4", *CRITIC_FREE), target=-0.09),
    Setup("reinforce", "reinforce", settings=CRITIC_FREE),
    Setup("ppo-generate", "ppo", mode="generate", target=-0.08, max_invalid_rate=0.01),
    # Generate mode warm-started on 2,000 episodes of *random* play: the demonstrations
    # teach the reply format and no strategy (hit and stick equally often); the KL pull
    # to that warm-started policy keeps both replies alive while PPO learns which is
    # better where. Without it, "stick" takes over before the states are told apart.
    Setup(
        "ppo-generate-warm",
        "ppo",
        mode="generate",
        settings=(
            "algorithm.warm_start.lr=1e-3",
            "algorithm.warm_start.demonstration_epochs=2",
            "algorithm.kl_coef=0.2",
            "algorithm.entropy_coef=0",
            "algorithm.lr=3e-4",
        ),
        target=-0.08,
        max_invalid_rate=0.01,
        demonstrations="random",
    ),
)
ALWAYS_STICK = -0.180  # what every trained row must beat by a clear margin


@dataclass
class RunResult:
    setup: str
    seed: int
    mean: float
    ci95: float
    invalid_rate: float
    episodes: int
    train_seconds: float
    wall_seconds: float
    baselines: dict[str, float] = field(default_factory=dict)


def command(
    setup: Setup, seed: int, minutes: float, eval_episodes: int, output: Path, quick: bool
) -> list[str]:
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    line = [
        executable,
        "run",
        "blackjack",
        "--algorithm",
        setup.algorithm,
        "--mode",
        setup.mode,
        "--minutes",
        str(minutes),
        "--seed",
        str(seed),
        "--eval-episodes",
        str(eval_episodes),
        "--output",
        str(output),
        "--quiet",
    ]
    for assignment in setup.settings:
        line += ["--set", assignment]
    if quick:  # a smoke run needs no report, picture or TensorBoard events
        line += ["--set", "output.report=false", "--set", "output.tensorboard=false"]
    return line


def read_run(setup: Setup, seed: int, output: Path, wall_seconds: float) -> RunResult:
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if r.get("kind") == "update"]
    evaluation = next(r for r in reversed(records) if r.get("kind") == "evaluation")
    return RunResult(
        setup=setup.name,
        seed=seed,
        mean=evaluation["mean"],
        ci95=evaluation["ci95"],
        invalid_rate=evaluation.get("invalid_rate", 0.0),
        episodes=int(evaluation.get("total_episodes") or updates[-1]["total_episodes"]),
        train_seconds=float(updates[-1]["seconds"]) if updates else 0.0,
        wall_seconds=wall_seconds,
        baselines={b["name"]: b["mean"] for b in evaluation.get("baselines", [])},
    )


def run_one(
    setup: Setup, seed: int, minutes: float, eval_episodes: int, runs_dir: Path, quick: bool
) -> RunResult:
    output = runs_dir / f"{setup.name}-seed{seed}"
    shutil.rmtree(output, ignore_errors=True)
    started = time.perf_counter()
    line = command(setup, seed, minutes, eval_episodes, output, quick)
    if setup.demonstrations is not None:
        demos = runs_dir / f"{setup.name}-seed{seed}-demonstrations.jsonl"
        record = [line[0], "record", "blackjack", "--baseline", setup.demonstrations,
                  "--mode", setup.mode, "--episodes", "200" if quick else "2000",
                  "--seed", str(seed), "-o", str(demos)]
        subprocess.run(record, capture_output=True, text=True, check=True)
        line += ["--set", f"algorithm.warm_start.demonstrations={demos}"]
    completed = subprocess.run(line, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(
            f"{setup.name} seed {seed} failed ({completed.returncode}):\n{completed.stderr[-2000:]}"
        )
    return read_run(setup, seed, output, wall)


def read_comparable(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """An earlier result file with the same budget, evaluation and seeds, or {}."""
    if not path.is_file():
        return {}
    earlier = json.loads(path.read_text())
    same = (earlier.get("quick"), earlier.get("minutes_per_run"), earlier.get("eval_episodes"),
            earlier.get("seeds"))
    return earlier if same == (args.quick, args.minutes, args.eval_episodes, args.seeds) else {}


def summarise(setup: Setup, runs: list[RunResult]) -> dict[str, Any]:
    means = [run.mean for run in runs]
    n = len(means)
    mean = statistics.fmean(means)
    # Over seeds when there are several; one seed: its own evaluation's CI.
    spread = ci95_over_seeds(means)
    ci95 = spread if spread is not None else runs[0].ci95
    invalid = statistics.fmean(run.invalid_rate for run in runs)
    summary = {
        "algorithm": setup.algorithm,
        "mode": setup.mode,
        "settings": list(setup.settings),
        "seeds": n,
        "mean": mean,
        "ci95": ci95,
        "invalid_rate": invalid,
        "episodes": statistics.fmean(run.episodes for run in runs),
        "wall_seconds": statistics.fmean(run.wall_seconds for run in runs),
        "target": setup.target,
        "beats_always_stick": mean > ALWAYS_STICK,
    }
    if setup.target is not None:
        summary["meets_target"] = mean >= setup.target and (
            setup.max_invalid_rate is None or invalid < setup.max_invalid_rate
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="One seed, 8 s of training and 500 eval episodes per row.",
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="Training budget per run.")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--eval-episodes", type=int, default=20_000)
    parser.add_argument(
        "--only", nargs="+", choices=[s.name for s in SETUPS], help="Run only these rows."
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"Where the JSON goes (default {RESULTS.name}, or {QUICK_RESULTS.name} with --quick).",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="Runs at a time (each uses one core; at most the core count).",
    )
    parser.add_argument(
        "--runs-dir",
        type=Path,
        default=None,
        help="Keep the run directories here (default: a temporary directory).",
    )
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    refuse_dirty_tree("algorithms", args.quick, args.allow_dirty)
    if args.quick:
        args.minutes, args.seeds, args.eval_episodes = 8 / 60, [0], 500
    # A smoke run never overwrites the real results.
    args.output = args.output or (QUICK_RESULTS if args.quick else RESULTS)
    setups = [s for s in SETUPS if not args.only or s.name in args.only]

    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="llamagym-bench-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    def run_and_print(setup: Setup, seed: int) -> RunResult:
        run = run_one(setup, seed, args.minutes, args.eval_episodes, runs_dir, args.quick)
        print(
            f"{setup.name:<17} seed {seed}: {run.mean:+.3f} ± {run.ci95:.3f}  "
            f"invalid {run.invalid_rate:.1%}  {run.episodes} episodes  "
            f"{run.wall_seconds:.0f}s",
            flush=True,
        )
        return run

    # Each run uses one torch thread, so --jobs 2 fills a 2-core machine without two
    # runs sharing a core; more jobs than cores would slow every run's clock budget.
    pairs = [(setup, seed) for setup in setups for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        finished = list(pool.map(lambda pair: run_and_print(*pair), pairs))
    results: dict[str, list[RunResult]] = {}
    for run in finished:
        results.setdefault(run.setup, []).append(run)
    if args.runs_dir is None:
        shutil.rmtree(runs_dir, ignore_errors=True)

    command = script_command("algorithms.py", argv if argv is not None else sys.argv[1:])
    header = result_header("algorithms", command, args.quick)
    # Each row names what measured it: a rerun with --only keeps the other rows' own.
    provenance = {k: header[k] for k in ("command", "date", "commit", "dirty", "machine")}
    summary = {s.name: {**summarise(s, results[s.name]), **provenance} for s in setups}
    runs = [vars(run) for runs in results.values() for run in runs]
    # Rerunning some rows (--only) keeps the other rows of a comparable earlier file.
    previous = read_comparable(args.output, args) if args.only else {}
    summary = {**{k: v for k, v in previous.get("summary", {}).items() if k not in summary},
               **summary}
    runs = [r for r in previous.get("runs", []) if r["setup"] not in results] + runs
    report = {
        "task": "blackjack, tiny model, greedy evaluation",
        "minutes_per_run": args.minutes,
        "eval_episodes": args.eval_episodes,
        "seeds": args.seeds,
        "jobs": args.jobs,
        "total_wall_seconds": time.perf_counter() - started,
        "summary": {s.name: summary[s.name] for s in SETUPS if s.name in summary},
        "runs": runs,
    }
    write_record(args.output, header, report)
    print(f"\n{'row':<17} {'mean':>7} {'ci95':>6} {'invalid':>8} {'episodes':>9}  target")
    for name, row in report["summary"].items():
        target = "" if row["target"] is None else f"{row['target']:+.3f}"
        verdict = {True: " met", False: " missed"}.get(row.get("meets_target"), "")
        print(
            f"{name:<17} {row['mean']:+7.3f} {row['ci95']:6.3f} {row['invalid_rate']:8.2%} "
            f"{row['episodes']:9.0f}  {target}{verdict}"
        )
    print(f"written to {args.output} in {report['total_wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
