"""CartPole-v1 with the tiny model: greedy mean episode length after a wall-clock budget.

    python benchmarks/cartpole.py            # 15 min x 3 seeds, 100 greedy eval episodes
    python benchmarks/cartpole.py --quick    # a smoke run: 1 seed, 1 min, under 2 min in all
    python benchmarks/cartpole.py --jobs 2   # two seeds at a time, one core each
    python benchmarks/cartpole.py --set algorithm.epochs=2   # settings other than the defaults

Each seed is the CLI a user would type (``llamagym run cartpole --minutes M --seed S
--eval-episodes 100 --output DIR --quiet``), one after another by default or ``--jobs``
at a time (each run uses one torch thread), with the agent's default settings. The run
keeps a checkpoint every few updates; afterwards, outside the training budget, each
checkpoint is played greedily on a few episodes, which gives the learning curve: greedy
length against the training wall time at which the checkpoint was written. The training
batches' own mean length (sampled actions) is recorded too. Everything goes to
``benchmarks/results/cartpole.json`` (``cartpole-quick.json`` for ``--quick``), beside
the random and heuristic baselines and the target (>= 475 of a possible 500), and the
curves to ``cartpole.png``.
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
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    ci95_over_seeds,
    pyplot,
    refuse_dirty_tree,
    save_figure,
    write_script_result,
)

TARGET = 475.0


def train_command(seed: int, minutes: float, eval_episodes: int, output: Path,
                  checkpoint_every: int, quick: bool, overrides: list[str]) -> list[str]:
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    line = [
        executable, "run", "cartpole",
        "--minutes", str(minutes),
        "--seed", str(seed),
        "--eval-episodes", str(eval_episodes),
        "--output", str(output),
        "--quiet",
        "--set", f"output.checkpoint_every={checkpoint_every}",
        "--set", "output.keep_checkpoints=100000",  # the curve needs every one of them
    ]
    if quick:  # a smoke run needs no report, picture or TensorBoard events
        line += ["--set", "output.report=false", "--set", "output.tensorboard=false"]
    for override in overrides:
        line += ["--set", override]
    return line


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def greedy_curve(run_dir: Path, updates: list[dict[str, Any]], episodes: int,
                 max_points: int) -> list[dict[str, float]]:
    """Greedy mean length of (up to ``max_points`` evenly spread) checkpoints of a run."""
    import torch

    from llamagym import load_agent
    from llamagym.rollout.evaluation import evaluate_agent
    from llamagym.training.checkpoint import store as checkpoints

    torch.set_num_threads(1)
    seconds_at = {int(r["update"]): float(r["seconds"]) for r in updates}
    found = checkpoints.list_checkpoints(run_dir)
    if len(found) > max_points:
        step = (len(found) - 1) / (max_points - 1)
        found = [found[round(k * step)] for k in range(max_points)]
    curve = []
    for directory in found:
        meta = checkpoints.read_meta(directory)
        update = int(meta.get("update", 0))
        agent = load_agent(directory, agent="cartpole")
        # Seed 7: other episodes than the final evaluation (seed = the run's seed).
        result = evaluate_agent(agent.evaluation_engine(), episodes, seed=7, greedy=True)
        curve.append({
            "update": update,
            "seconds": seconds_at.get(update, float("nan")),
            "greedy_mean_length": result.mean,
            "ci95": result.ci95,
        })
    return curve


def run_seed(seed: int, minutes: float, eval_episodes: int, runs_dir: Path,
             checkpoint_every: int, curve_episodes: int, curve_points: int,
             quick: bool, overrides: list[str]) -> dict[str, Any]:
    output = runs_dir / f"seed{seed}"
    shutil.rmtree(output, ignore_errors=True)
    line = train_command(seed, minutes, eval_episodes, output, checkpoint_every, quick, overrides)
    print("$", " ".join(line), flush=True)
    started = time.perf_counter()
    completed = subprocess.run(line, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"seed {seed} failed ({completed.returncode}):\n"
                           f"{completed.stderr[-2000:]}")
    records = read_records(output)
    updates = [r for r in records if r.get("kind") == "update"]
    evaluation = next(r for r in reversed(records) if r.get("kind") == "evaluation")
    curve = greedy_curve(output, updates, curve_episodes, curve_points) if curve_points else []
    return {
        "seed": seed,
        "greedy_mean_length": evaluation["mean"],
        "ci95": evaluation["ci95"],
        "eval_episodes": evaluation["episodes"],
        "baselines": {b["name"]: b["mean"] for b in evaluation.get("baselines", [])},
        "updates": len(updates),
        "episodes": int(updates[-1]["total_episodes"]) if updates else 0,
        "env_steps": int(updates[-1]["env_steps"]) if updates else 0,
        "train_seconds": float(updates[-1]["seconds"]) if updates else 0.0,
        "wall_seconds": wall,
        # Length of the sampled training episodes, batch by batch.
        "training_curve": [
            {"seconds": float(r["seconds"]), "update": int(r["update"]),
             "mean_length": float(r["episode_length"])}
            for r in updates
        ],
        "greedy_curve": curve,
        "command": " ".join(line[1:]),
    }


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    means = [run["greedy_mean_length"] for run in runs]
    n = len(means)
    mean = statistics.fmean(means)
    ci95 = ci95_over_seeds(means)
    baselines = {
        name: statistics.fmean(run["baselines"][name] for run in runs)
        for name in runs[0]["baselines"]
    }
    return {
        "seeds": n,
        "greedy_mean_length": mean,
        "ci95_over_seeds": ci95,
        "worst_seed": min(means),
        "target": TARGET,
        "meets_target": mean >= TARGET,
        "baselines": baselines,
    }


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Length against training wall time per seed: greedy at each checkpoint (thick),
    the training batches' sampled episodes (thin), beside the baselines and the target."""
    plt = pyplot()
    if plt is None or not any(run["greedy_curve"] for run in result["runs"]):
        return None
    fig, axis = plt.subplots(figsize=(8, 4.5))
    for index, run in enumerate(result["runs"]):
        color = plt.cm.tab10(index)
        greedy = run["greedy_curve"]
        axis.plot([p["seconds"] / 60 for p in greedy], [p["greedy_mean_length"] for p in greedy],
                  "o-", color=color, lw=2, label=f"seed {run['seed']}, greedy")
        sampled = run["training_curve"]
        axis.plot([p["seconds"] / 60 for p in sampled], [p["mean_length"] for p in sampled],
                  color=color, lw=0.7, alpha=0.5)
    for name, length in result["summary"]["baselines"].items():
        axis.axhline(length, color="grey", ls=":", lw=1)
        axis.annotate(name, (0, length), textcoords="offset points", xytext=(2, 2), fontsize=7)
    axis.axhline(TARGET, color="black", ls="--", lw=1, label=f"target {TARGET:.0f}")
    axis.set_xlabel("training wall time (min); thin lines: sampled training episodes")
    axis.set_ylabel("episode length")
    axis.set_title(f"CartPole-v1, tiny model, {result['minutes_per_seed']:g} min per seed")
    axis.legend(fontsize=7, loc="lower right")
    return save_figure(fig, path, bbox_inches=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 minute: a smoke run.")
    parser.add_argument("--minutes", type=float, help="Training budget per seed.")
    parser.add_argument("--seeds", type=int, nargs="+", help="Seeds to run.")
    parser.add_argument("--keep-runs", type=Path, help="Keep run directories here.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    parser.add_argument("--jobs", type=int, default=1,
                        help="Seeds at a time (each uses one core; at most the core count).")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="A setting passed to every run (repeatable).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    quick = args.quick
    refuse_dirty_tree("cartpole", quick, args.allow_dirty)
    minutes = args.minutes or (1.0 if quick else 15.0)
    seeds = args.seeds or ([0] if quick else [0, 1, 2])
    eval_episodes = 10 if quick else 100
    curve_points, curve_episodes = (0, 0) if quick else (12, 10)
    checkpoint_every = 5

    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix="llamagym-cartpole-bench-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # One torch thread per run: --jobs 2 runs two seeds at once on a 2-core machine.
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(
            lambda seed: run_seed(seed, minutes, eval_episodes, runs_dir, checkpoint_every,
                                  curve_episodes, curve_points, quick, args.overrides),
            seeds,
        ))
    summary = summarise(runs)
    result = {
        "minutes_per_seed": minutes,
        "eval_episodes": eval_episodes,
        "model": "tiny",
        "jobs": args.jobs,
        "overrides": args.overrides,
        "summary": summary,
        "runs": runs,
        "total_seconds": time.perf_counter() - started,
    }
    path = write_script_result("cartpole", quick, args.output, result)
    picture = plot(result, path.with_suffix(".png"))
    if args.keep_runs is None:
        shutil.rmtree(runs_dir, ignore_errors=True)

    for run in runs:
        print(f"seed {run['seed']}: greedy mean length {run['greedy_mean_length']:.1f} "
              f"± {run['ci95']:.1f} after {run['train_seconds']:.0f}s "
              f"({run['episodes']} episodes, {run['env_steps']} steps)")
        for point in run["greedy_curve"]:
            print(f"    {point['seconds']:7.0f}s  update {point['update']:4d}  "
                  f"greedy length {point['greedy_mean_length']:6.1f}")
    spread = summary["ci95_over_seeds"]
    print(f"mean over {summary['seeds']} seed(s): {summary['greedy_mean_length']:.1f}"
          + (f" ± {spread:.1f}" if spread is not None else "")
          + f" (target {TARGET:.0f}: {'met' if summary['meets_target'] else 'not met'}); "
          + ", ".join(f"{k} {v:.1f}" for k, v in summary["baselines"].items()))
    print(f"written to {path}" + (f" and {picture}" if picture else ""))


if __name__ == "__main__":
    main()
