"""Learning per wall-clock second: Blackjack greedy return vs training time, LlamaGym
with its default settings against the original LlamaGym 0.1.1, same budget, 3 seeds.

    python -m benchmarks learning [--quick] [--threads N] [--skip-peer] [--jobs 2]

Ours is the command a user types, ``llamagym run blackjack --minutes M --seed S
--eval-episodes 20000 --quiet --output DIR`` (plus ``--threads``, the same for both
sides, and a checkpoint every 2 updates kept on disk). ``metrics.jsonl`` gives the
training curve and the final greedy evaluation on 20,000 episodes; it holds no
evaluations during training, so the kept checkpoints are evaluated afterwards, outside
the budget: each one's greedy policy (one batched decision for each of the 280 states a
hand can reach; with no history in the prompt the state decides the action) gets its
exact expected return from ``llamagym_blackjack.exact``, and a few, log-spaced, are also
played on the same 20,000 evaluation seeds (what ``llamagym eval blackjack --checkpoint
C`` does) as a cross-check. Time to -0.08 is the training time of the first checkpoint
whose exact greedy value is above -0.08.

The peer trains for the same minutes with its own defaults, then is evaluated with
greedy decoding (``do_sample=False``) on the same seeds. Writes ``learning.json`` and
``learning.png``.
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
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    BenchmarkError,
    add_common_arguments,
    log,
    part_command,
    pyplot,
    run_worker,
    save_figure,
    spread,
    threads_of,
    worker_environment,
    worker_main,
    write_result,
)

PART = "learning"
THRESHOLD = -0.08
# Blackjack-v1 baselines (mean return per episode), drawn on the plot.
BASELINES = {
    "random": -0.393,
    "always-stick": -0.180,
    "hit-below-17": -0.083,
    "basic strategy": -0.046,
}


@dataclass(frozen=True)
class Plan:
    minutes: float
    seeds: tuple[int, ...]
    eval_episodes: int
    curve_points: int  # checkpoints also played on the eval seeds (besides the last)
    checkpoint_every: int
    peer_eval_episodes: int
    peer_eval_max_minutes: float


FULL = Plan(10.0, (0, 1, 2), 20_000, 6, 2, 20_000, 30.0)
QUICK = Plan(0.1, (0,), 200, 1, 2, 10, 0.25)


# -- ours -------------------------------------------------------------------------------
def llamagym_executable() -> str:
    found = shutil.which("llamagym", path=str(Path(sys.executable).parent))
    if found is None:
        raise BenchmarkError("the `llamagym` command is not installed in this venv")
    return found


def our_command(plan: Plan, seed: int, threads: int, output: Path, quick: bool) -> list[str]:
    command = [
        llamagym_executable(), "run", "blackjack",
        "--minutes", f"{plan.minutes:g}",
        "--seed", str(seed),
        "--eval-episodes", str(plan.eval_episodes),
        "--threads", str(threads),
        "--quiet",
        "--output", str(output),
        "--checkpoint-every", str(plan.checkpoint_every),
        "--set", "output.keep_checkpoints=100000",
    ]
    if quick:  # a smoke run needs no report picture or TensorBoard events
        command += ["--set", "output.report=false", "--set", "output.tensorboard=false"]
    return command


def run_ours(plan: Plan, seed: int, threads: int, workdir: Path, quick: bool) -> dict[str, Any]:
    output = workdir / f"ours-seed{seed}"
    command = our_command(plan, seed, threads, output, quick)
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO_ROOT, env=worker_environment(threads),
                               capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    if completed.returncode != 0:
        tail = "\n".join(completed.stderr.strip().splitlines()[-10:])
        raise BenchmarkError(f"llamagym run failed (exit {completed.returncode}):\n{tail}")
    records = [json.loads(line) for line in
               (output / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    updates = [r for r in records if r.get("kind") == "update"]
    final = next(r for r in reversed(records) if r.get("kind") == "evaluation")
    from llamagym.training.checkpoint import store as checkpoints

    kept = checkpoints.list_checkpoints(output)
    metas = [(path, checkpoints.read_meta(path)) for path in kept]
    last_update = updates[-1]["update"] if updates else 0
    # Every checkpoint gets its exact greedy value; a few (log-spaced, the last one is
    # the run's own final evaluation) are also played on the evaluation seeds.
    earlier = [index for index, (_, m) in enumerate(metas) if m["update"] != last_update]
    sampled = {earlier[i] for i in log_spaced(len(earlier), plan.curve_points)}
    items = [{"checkpoint": str(path), "episodes": plan.eval_episodes if i in sampled else 0}
             for i, (path, _) in enumerate(metas)]
    evaluations = []
    if items:
        spec = {"items": items, "seed": seed, "threads": threads}
        evaluations = run_worker(PART, spec, threads)["evaluations"]
    curve = []
    for (_, meta), evaluation in zip(metas, evaluations, strict=True):
        point = {"seconds": meta["counters"]["seconds"], "update": meta["update"],
                 "episodes": meta["episodes"], "exact": evaluation["exact"],
                 "mean": None, "ci95": None}
        if meta["update"] == last_update:
            point.update(mean=final["mean"], ci95=final["ci95"])
        elif evaluation["sampled"] is not None:
            point.update(mean=evaluation["sampled"]["mean"], ci95=evaluation["sampled"]["ci95"])
        curve.append(point)
    exact_points = [p for p in curve if p["exact"] is not None]
    sampled_points = [p for p in curve if p["mean"] is not None]
    if exact_points:
        first = next((p for p in exact_points if p["exact"] > THRESHOLD), None)
        measured_by = "exact greedy value of each kept checkpoint"
    else:
        first = next((p for p in sampled_points if p["mean"] > THRESHOLD), None)
        measured_by = f"greedy mean over {plan.eval_episodes} episodes at sampled checkpoints"
    sure = next((p for p in sampled_points if p["mean"] - p["ci95"] > THRESHOLD), None)
    return {
        "seed": seed,
        "command": " ".join(["llamagym", *command[1:]]),
        "wall_seconds": wall,
        "train_seconds": updates[-1]["seconds"] if updates else 0.0,
        "episodes": final["total_episodes"],
        "updates": last_update,
        "env_steps": updates[-1]["env_steps"] if updates else 0,
        "final": {key: final[key] for key in ("mean", "ci95", "episodes", "invalid_rate",
                                               "greedy")},
        "final_exact": curve[-1]["exact"] if curve else None,
        "measured_baselines": {b["name"]: b["mean"] for b in final.get("baselines", [])},
        "curve": curve,
        "training_curve": [{"seconds": r["seconds"], "episodes": r["total_episodes"],
                            "return_moving_average": r["return_moving_average"]}
                           for r in updates],
        "time_to_threshold": first["seconds"] if first else None,
        "time_to_threshold_measured_by": measured_by,
        "time_to_threshold_sampled_ci_clear": sure["seconds"] if sure else None,
    }


def log_spaced(count: int, points: int) -> list[int]:
    """Up to ``points`` indices into ``count`` items, denser early (learning is fastest
    at the start, so that is where time-to-threshold needs resolution)."""
    if count <= points:
        return list(range(count))
    ratio = count ** (1 / points)
    return sorted({min(count, max(1, round(ratio**k))) - 1 for k in range(1, points + 1)})


def work(spec: dict[str, Any]) -> dict[str, Any]:
    """Evaluate checkpoints greedily: the exact value (Blackjack's exact module) and,
    where asked, a run on the evaluation seeds (what `llamagym eval` does)."""
    from llamagym import load_agent
    from llamagym.rollout.evaluation import evaluate_agent
    from llamagym.training.checkpoint import store as checkpoints

    results = []
    agent = None
    for item in spec["items"]:
        path = Path(item["checkpoint"])
        if agent is None:
            agent = load_agent(path, overrides={"training": {"seed": spec["seed"]}})
        else:
            checkpoints.load_checkpoint(agent.policy, path)
        sampled = None
        if item["episodes"]:
            sampled = evaluate_agent(
                agent.evaluation_engine(), item["episodes"], seed=spec["seed"]
            ).as_dict()
        results.append({"checkpoint": str(path), "exact": exact_greedy_value(agent),
                        "sampled": sampled})
    return {"evaluations": results}


def exact_greedy_value(agent: Any) -> float | None:
    """The exact expected return of the agent's greedy policy, or None where it is not a
    function of the state alone (earlier turns in the prompt) or the plugin has no
    exact evaluator. One batched decision for every state a hand can reach."""
    try:
        from llamagym_blackjack.exact import policy_value, reachable_states
    except ImportError:
        return None
    if agent.config.rollout.history_turns != 0:
        return None
    states = reachable_states()
    engine = agent.engine
    policy = agent.policy
    was_training = policy.training
    policy.eval()
    try:
        slots = [engine.new_slot(state, {}, None, None) for state in states]
        turns = engine.decide(slots, greedy=True)
    finally:
        policy.train(was_training)
    action = {state: turn.legal_actions[turn.action_index]
              for state, turn in zip(states, turns, strict=True)}
    return policy_value(lambda state: action[state])


def exact_baselines() -> dict[str, float]:
    """Exact values of the deterministic Blackjack baselines (empty without the plugin)."""
    try:
        from llamagym_blackjack.agent import always_stick, basic_strategy, hit_below_17
        from llamagym_blackjack.exact import policy_value
    except ImportError:
        return {}
    legal = ["stick", "hit"]
    return {
        name: policy_value(lambda state, choose=choose: choose(state, {}, legal, None))
        for name, choose in (("always-stick", always_stick), ("hit-below-17", hit_below_17),
                             ("basic strategy", basic_strategy))
    }


# -- the peer ---------------------------------------------------------------------------
def run_peer_seed(plan: Plan, seed: int, threads: int, venv: Path, model_dir: Path) -> dict:
    from benchmarks.peer import PEER_MAX_POSITIONS, run_peer
    from llamagym.rollout.evaluation import evaluation_seeds

    spec = {
        "task": "learning", "model_dir": str(model_dir), "seed": seed, "threads": threads,
        "minutes": plan.minutes, "eval_episodes": plan.peer_eval_episodes,
        "eval_seed_base": evaluation_seeds(seed, 1)[0],
        "eval_max_minutes": plan.peer_eval_max_minutes,
        "max_position_embeddings": PEER_MAX_POSITIONS,
    }
    return run_peer(venv, spec, threads)


# -- the run ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--minutes", type=float, default=None,
                        help="training budget per run (default: 10; --quick: 0.1)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default 3)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="runs at a time: 2 trains each seed's two sides side by side, "
                        "one core each (at most the core count)")


def run(args: argparse.Namespace) -> list[Path]:
    # `python -m benchmarks all` has only the common options.
    args.minutes = getattr(args, "minutes", None)
    args.seeds = getattr(args, "seeds", None)
    args.jobs = getattr(args, "jobs", 1)
    plan = QUICK if args.quick else FULL
    if args.minutes:
        plan = Plan(**{**asdict(plan), "minutes": args.minutes})
    if args.seeds:
        plan = Plan(**{**asdict(plan), "seeds": tuple(range(args.seeds))})
    threads = threads_of(args)
    ours: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    peer_error = None
    with tempfile.TemporaryDirectory(prefix="llamagym-learning-") as name:
        workdir = Path(name)
        venv = model_dir = None
        if not args.skip_peer:
            from benchmarks.peer import ensure_peer_venv, export_peer_model

            try:
                venv = ensure_peer_venv(args.peer_venv)
                model_dir = export_peer_model(workdir / "peer-model")
            except BenchmarkError as error:
                peer_error = str(error)
        # With --jobs 2, each seed's two sides train at the same time, one core each.
        jobs: list[tuple[str, int, Future]] = []
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for seed in plan.seeds:
                jobs.append(("ours", seed, pool.submit(
                    run_ours, plan, seed, threads, workdir, args.quick)))
                if venv is not None and model_dir is not None and peer_error is None:
                    jobs.append(("peer", seed, pool.submit(
                        run_peer_seed, plan, seed, threads, venv, model_dir)))
            for side, seed, job in jobs:
                if side == "ours":
                    result = job.result()
                    ours.append(result)
                    log(PART, f"ours seed {seed}: {result['final']['mean']:+.3f} ± "
                              f"{result['final']['ci95']:.3f} after "
                              f"{result['train_seconds']:.0f}s; "
                              f"time to {THRESHOLD}: {result['time_to_threshold']}")
                    continue
                try:
                    answer = job.result()
                except BenchmarkError as error:
                    peer_error = peer_error or str(error)
                    log(PART, f"peer seed {seed} failed: {error}")
                    continue
                peer.append(answer)
                evaluation = answer["evaluation"]
                log(PART, f"peer seed {seed}: {evaluation['mean']:+.3f} ± "
                          f"{evaluation['ci95']:.3f} ({evaluation['episodes']} episodes)")
    data = {
        "budget_minutes": plan.minutes,
        "seeds": list(plan.seeds),
        "threshold": THRESHOLD,
        "baselines": BASELINES,
        "baselines_exact": exact_baselines(),
        "ours": {
            "final_mean": spread(r["final"]["mean"] for r in ours),
            "final_mean_over_seeds": statistics.fmean(r["final"]["mean"] for r in ours),
            "time_to_threshold": spread(r["time_to_threshold"] for r in ours),
            "seeds_reaching_threshold": sum(r["time_to_threshold"] is not None for r in ours),
            "runs": ours,
        },
        "peer": {
            "final_mean": spread(r["evaluation"]["mean"] for r in peer),
            "final_mean_over_seeds": (statistics.fmean(r["evaluation"]["mean"] for r in peer)
                                      if peer else None),
            "error": peer_error,
            "skipped": args.skip_peer,
            "runs": peer,
        },
        "settings": asdict(plan),
    }
    command = part_command(PART, args, _extra_flags(args))
    path = write_result(PART, data, args, command)
    paths = [path]
    picture = plot(data, path.with_suffix(".png"), args.quick)
    if picture is not None:
        paths.append(picture)
    return paths


def _extra_flags(args: argparse.Namespace) -> list[str]:
    flags = []
    if args.minutes:
        flags += ["--minutes", f"{args.minutes:g}"]
    if args.seeds:
        flags += ["--seeds", str(args.seeds)]
    if args.jobs != 1:
        flags += ["--jobs", str(args.jobs)]
    return flags


def plot(data: dict[str, Any], path: Path, quick: bool) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (greedy_axis, train_axis) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    colours = plt.cm.tab10
    for index, run in enumerate(data["ours"]["runs"]):
        alpha = 0.4 + 0.2 * index
        exact = [p for p in run["curve"] if p["exact"] is not None]
        if exact:
            greedy_axis.plot([p["seconds"] / 60 for p in exact], [p["exact"] for p in exact],
                             color=colours(0), alpha=alpha, lw=1.2,
                             label="LlamaGym (exact value)" if index == 0 else None)
        sampled = [p for p in run["curve"] if p["mean"] is not None]
        greedy_axis.errorbar([p["seconds"] / 60 for p in sampled], [p["mean"] for p in sampled],
                             yerr=[p["ci95"] for p in sampled], ls="none", marker="o", ms=3,
                             capsize=2, color=colours(0), alpha=alpha,
                             label="LlamaGym (eval episodes)" if index == 0 else None)
        train_axis.plot([p["seconds"] / 60 for p in run["training_curve"]],
                        [p["return_moving_average"] for p in run["training_curve"]],
                        color=colours(0), alpha=0.4 + 0.2 * index,
                        label="LlamaGym" if index == 0 else None)
    for index, run in enumerate(data["peer"]["runs"]):
        evaluation = run["evaluation"]
        greedy_axis.errorbar([run["train_seconds"] / 60], [evaluation["mean"]],
                             yerr=[evaluation["ci95"]], marker="s", capsize=3, color=colours(1),
                             label="LlamaGym 0.1.1" if index == 0 else None)
        train_axis.plot([p["seconds"] / 60 for p in run["curve"]],
                        [p["return_moving_average"] for p in run["curve"]], color=colours(1),
                        alpha=0.4 + 0.2 * index, label="LlamaGym 0.1.1" if index == 0 else None)
    for axis in (greedy_axis, train_axis):
        for (name, value), style in zip(BASELINES.items(), (":", "-.", "--", "-"), strict=True):
            axis.axhline(value, color="gray", ls=style, lw=1)
            axis.annotate(name, (0.01, value), xycoords=("axes fraction", "data"),
                          xytext=(0, 2), textcoords="offset points", fontsize=7, color="gray")
        axis.set_xlabel("training wall time (minutes)")
        axis.set_xlim(left=0)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8, loc="lower right")
    # Blackjack returns that matter lie between random and basic strategy; the first
    # few training episodes' averages swing far outside and would flatten the rest.
    greedy_axis.set_ylim(-0.45, 0.1)
    greedy_axis.set_ylabel("mean return per episode")
    greedy_axis.set_title("greedy evaluation (95% CI)")
    train_axis.set_title("training episodes (moving average of 500)")
    fig.suptitle(f"Blackjack, {data['budget_minutes']:g}-minute budget"
                 + (" (quick)" if quick else ""))
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(argv, work)


if __name__ == "__main__":
    sys.exit(main())
