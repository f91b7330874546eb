"""Throughput: LlamaGym at 1, 8, 32 and 64 envs (score and generate mode) beside the
original LlamaGym 0.1.1, on Blackjack with the same tiny model and thread count.

    python -m benchmarks throughput [--quick] [--threads N] [--skip-peer]

Every measurement runs in a fresh process and is repeated (median, min, max over
seeds 0..R-1); repeats go round-robin over all configurations, the peer included, so
a slow minute on a shared machine hits every configuration rather than one. Writes
``throughput.json`` and ``throughput.png``.

What is compared: env steps per second of the rollout (choosing actions and stepping
envs; PPO updates are timed separately), generated tokens per second (generate
mode), seconds per update, peak RSS. The peer plays one env at a time and trains
every 16 turns inside ``terminate_episode``; its update time is taken out of its
rollout time, and both sides also get a "with updates" rate.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BenchmarkError,
    add_common_arguments,
    log,
    median_of,
    part_command,
    pyplot,
    run_worker,
    save_figure,
    spread,
    threads_of,
    worker_main,
    write_result,
)
from benchmarks.peer import PEER_MAX_POSITIONS

PART = "throughput"
BATCH_SIZES = (1, 8, 32, 64)
MODES = ("score", "generate")
HEADLINE_BATCH = 32
TARGET_RATIO = 100.0
UPDATE_NUM_ENVS = 64  # envs used to collect the batches an update is timed on

#: Fields of every ``rows`` entry in throughput.json (one per side, mode and batch).
ROW_FIELDS = {
    "side": '"llamagym" or "llamagym-0.1.1" (the peer)',
    "mode": '"score" or "generate" (the peer only generates)',
    "num_envs": "environments stepped together (the peer: always 1)",
    "env_steps_per_second": "rollout env steps per second: {median, min, max, n, values}",
    "generated_tokens_per_second": "reply tokens per rollout second (generate mode; else null)",
    "tokens_per_reply": "mean reply length in tokens (generate mode; else null)",
    "peak_rss_mb": "peak resident memory of the measuring process, MiB",
}
#: Fields of every ``updates`` entry (seconds per update do not depend on num_envs).
UPDATE_FIELDS = {
    "side": "as in rows",
    "mode": "as in rows",
    "update_seconds": "wall seconds of one algorithm update: {median, min, max, n, values}",
    "turns_per_update": "turns (= env steps) the update trained on",
    "episodes_per_update": "episodes per update (ours: the agent's default unless --quick)",
}
#: Fields of every ``ratios`` entry (ours / peer at HEADLINE_BATCH).
RATIO_FIELDS = {
    "mode": "our mode compared with the peer's (always generating) agent",
    "num_envs": "our batch size",
    "env_steps_per_second": "{ratio (median/median), low (our min/peer max), high}",
    "env_steps_per_second_with_updates": "the same ratio with update time included",
    "generated_tokens_per_second": "ratio of token rates (generate mode; else null)",
    "meets_target": f"ratio >= {TARGET_RATIO:g}",
}
TOP_FIELDS = ("rows", "updates", "ratios", "settings", "peer")


@dataclass(frozen=True)
class Plan:
    repeats: int
    rollout_seconds: float
    updates: int
    update_episodes: int | None  # None: the agent's own episodes_per_update
    peer_min_steps: int
    peer_min_updates: int
    peer_max_seconds: float
    peer_at_2048: bool  # also measure the peer with our config's 2048 positions


FULL = Plan(3, 15.0, 2, None, 200, 4, 600.0, True)
QUICK = Plan(1, 0.5, 1, 64, 16, 1, 40.0, False)
# At 2048 positions the peer makes ~0.4 env steps/s: a shorter measurement suffices.
PEER_2048_STEPS, PEER_2048_UPDATES = 32, 1


# -- the worker (runs in a fresh process) -----------------------------------------------
def work(spec: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.ours import make_agent, measure_rollout, measure_updates, model_facts

    results = []
    for item in spec["items"]:
        if item["task"] == "rollout":
            agent = make_agent(item["mode"], item["num_envs"], item["seed"])
            measured = measure_rollout(agent, item["seconds"])
        else:
            overrides = {}
            if item.get("episodes_per_update"):
                overrides = {"algorithm": {"episodes_per_update": item["episodes_per_update"]}}
            agent = make_agent(item["mode"], UPDATE_NUM_ENVS, item["seed"], overrides)
            measured = measure_updates(agent, item["updates"], warmup=item.get("warmup", True))
        results.append({**item, **measured, "model": model_facts(agent)})
    return {"results": results}


# -- the run ----------------------------------------------------------------------------
def _rollout_item(mode: str, num_envs: int, seed: int, plan: Plan) -> dict[str, Any]:
    return {"task": "rollout", "mode": mode, "num_envs": num_envs, "seed": seed,
            "seconds": plan.rollout_seconds}


def _update_item(mode: str, seed: int, plan: Plan) -> dict[str, Any]:
    return {"task": "update", "mode": mode, "seed": seed, "updates": plan.updates,
            "episodes_per_update": plan.update_episodes, "warmup": plan.update_episodes is None}


def peer_generate_config() -> dict[str, Any]:
    """Our generate-mode defaults, given to the peer so both write replies of one length."""
    from llamagym.config import RolloutSettings

    ours = RolloutSettings()
    return {"max_new_tokens": ours.max_new_tokens, "do_sample": True, "top_p": ours.top_p,
            "top_k": ours.top_k, "temperature": ours.temperature}


def measure(args: argparse.Namespace, plan: Plan) -> dict[str, Any]:
    threads = threads_of(args)
    ours: list[dict[str, Any]] = []
    peer: dict[int, list[dict[str, Any]]] = {}
    peer_error = None
    venv = None
    model_dir = None
    workdir = tempfile.TemporaryDirectory(prefix="llamagym-bench-")
    if not args.skip_peer:
        from benchmarks.peer import ensure_peer_venv, export_peer_model

        try:
            venv = ensure_peer_venv(args.peer_venv)
            model_dir = export_peer_model(Path(workdir.name) / "peer-model")
        except BenchmarkError as error:
            peer_error = str(error)
            log(PART, f"peer skipped: {error}")
    generate_config = peer_generate_config()
    peer_positions = [PEER_MAX_POSITIONS] + ([2048] if plan.peer_at_2048 else [])

    def run_peer_once(seed: int) -> None:
        nonlocal peer_error
        from benchmarks.peer import run_peer

        for positions in peer_positions:
            short = positions != PEER_MAX_POSITIONS
            spec = {
                "task": "throughput", "model_dir": str(model_dir), "seed": seed,
                "threads": threads,
                "min_steps": PEER_2048_STEPS if short else plan.peer_min_steps,
                "min_updates": PEER_2048_UPDATES if short else plan.peer_min_updates,
                "max_seconds": plan.peer_max_seconds,
                "max_position_embeddings": positions, "generate_config": generate_config,
            }
            try:
                result = run_peer(venv, spec, threads)  # type: ignore[arg-type]
            except BenchmarkError as error:
                peer_error = str(error)
                log(PART, f"peer failed: {error}")
                return
            peer.setdefault(positions, []).append(result)
            log(PART, f"peer ({positions} positions) seed {seed}: "
                      f"{result['env_steps_per_second']:.2f} env steps/s")

    try:
        for repeat in range(plan.repeats):
            seed = repeat
            if venv is not None and model_dir is not None and peer_error is None:
                run_peer_once(seed)
            items = [_rollout_item(m, n, seed, plan) for m in args.modes for n in args.batch_sizes]
            items += [_update_item(m, seed, plan) for m in args.modes]
            batches = [items] if args.quick else [[item] for item in items]
            for batch in batches:
                answer = run_worker(PART, {"items": batch, "threads": threads}, threads)
                for result in answer["results"]:
                    result["repeat"] = repeat
                    result["shared_process"] = len(batch) > 1
                    ours.append(result)
                    log(PART, _describe(result))
    finally:
        workdir.cleanup()
    return {"ours": ours, "peer": peer, "peer_error": peer_error, "venv": str(venv or "")}


def _describe(result: dict[str, Any]) -> str:
    if result["task"] == "rollout":
        return (f"ours {result['mode']} x{result['num_envs']} seed {result['seed']}: "
                f"{result['env_steps_per_second']:.1f} env steps/s")
    seconds = ", ".join(f"{s:.2f}" for s in result["update_seconds"])
    return f"ours {result['mode']} update seed {result['seed']}: {seconds} s"


def summarise(raw: dict[str, Any], batch_sizes: Sequence[int]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    for mode in MODES:
        for num_envs in sorted(batch_sizes):
            runs = [r for r in raw["ours"]
                    if r["task"] == "rollout" and r["mode"] == mode and r["num_envs"] == num_envs]
            if not runs:
                continue
            rows.append({
                "side": "llamagym", "mode": mode, "num_envs": num_envs,
                **{key: spread(r[key] for r in runs) for key in (
                    "env_steps_per_second", "generated_tokens_per_second", "tokens_per_reply",
                    "peak_rss_mb", "prompt_tokens_mean", "invalid_rate", "model_seconds_share")},
                "shared_process": any(r["shared_process"] for r in runs),
                "model": runs[0]["model"],
            })
        runs = [r for r in raw["ours"] if r["task"] == "update" and r["mode"] == mode]
        if runs:
            updates.append({
                "side": "llamagym", "mode": mode,
                "update_seconds": spread(s for r in runs for s in r["update_seconds"]),
                "turns_per_update": spread(t for r in runs for t in r["turns_per_update"]),
                "episodes_per_update": runs[0]["episodes_per_update"],
                "peak_rss_mb": spread(r["peak_rss_mb"] for r in runs),
            })
    peer_rows = {}
    for positions, runs in raw["peer"].items():
        row = {
            "side": "llamagym-0.1.1", "mode": "generate", "num_envs": 1,
            "max_position_embeddings": positions,
            **{key: spread(r[key] for r in runs) for key in (
                "env_steps_per_second", "env_steps_per_second_with_updates",
                "generated_tokens_per_second", "tokens_per_reply", "peak_rss_mb",
                "unparsable_rate")},
            "model": runs[0]["model"],
            "versions": runs[0].get("versions"),
        }
        peer_rows[positions] = row
        rows.append(row)
        updates.append({
            "side": "llamagym-0.1.1", "mode": "generate",
            "max_position_embeddings": positions,
            "update_seconds": spread(s for r in runs for s in r["update_seconds"]),
            "turns_per_update": spread(r["turns_per_update"] for r in runs),
            "episodes_per_update": None,
            "peak_rss_mb": spread(r["peak_rss_mb"] for r in runs),
        })
    ratios = _ratios(rows, updates, peer_rows.get(PEER_MAX_POSITIONS))
    return {"rows": rows, "updates": updates, "ratios": ratios}


def _with_updates(rate: float | None, update: dict[str, Any] | None) -> float | None:
    """Steps per second of a train loop: collect one update's turns, then update."""
    if rate is None or update is None:
        return None
    turns = median_of(update["turns_per_update"])
    seconds = median_of(update["update_seconds"])
    if not turns or seconds is None:
        return None
    return turns / (turns / rate + seconds)


def _ratio(ours: dict[str, Any] | None, theirs: dict[str, Any] | None) -> dict[str, float] | None:
    if not ours or not theirs:
        return None
    return {
        "ratio": ours["median"] / theirs["median"],
        "low": ours["min"] / theirs["max"],
        "high": ours["max"] / theirs["min"],
    }


def _ratios(
    rows: list[dict[str, Any]], updates: list[dict[str, Any]], peer: dict[str, Any] | None
) -> list[dict[str, Any]]:
    if peer is None:
        return []
    ratios = []
    for row in rows:
        if row["side"] != "llamagym" or row["num_envs"] != HEADLINE_BATCH:
            continue
        our_update = next((u for u in updates
                           if u["side"] == "llamagym" and u["mode"] == row["mode"]), None)
        steps = _ratio(row["env_steps_per_second"], peer["env_steps_per_second"])
        ours_e2e = _with_updates(median_of(row["env_steps_per_second"]), our_update)
        peer_e2e = median_of(peer["env_steps_per_second_with_updates"])
        ratios.append({
            "mode": row["mode"],
            "num_envs": HEADLINE_BATCH,
            "env_steps_per_second": steps,
            "env_steps_per_second_with_updates": (
                ours_e2e / peer_e2e if ours_e2e and peer_e2e else None),
            "generated_tokens_per_second": _ratio(
                row["generated_tokens_per_second"], peer["generated_tokens_per_second"]),
            "meets_target": bool(steps and steps["ratio"] >= TARGET_RATIO),
        })
    return ratios


def plot(result: dict[str, Any], path: Path) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (steps_axis, tokens_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (mode, marker) in enumerate(zip(MODES, "os", strict=True)):
        rows = [r for r in result["rows"] if r["side"] == "llamagym" and r["mode"] == mode]
        if not rows:
            continue
        batches = [r["num_envs"] for r in rows]
        for axis, key in ((steps_axis, "env_steps_per_second"),
                          (tokens_axis, "generated_tokens_per_second")):
            stats = [r[key] for r in rows]
            if any(s is None for s in stats):
                continue
            medians = [s["median"] for s in stats]
            errors = [[m - s["min"] for m, s in zip(medians, stats, strict=True)],
                      [s["max"] - m for m, s in zip(medians, stats, strict=True)]]
            axis.errorbar(batches, medians, yerr=errors, marker=marker, capsize=3,
                          color=f"C{index}", label=f"LlamaGym, {mode} mode")
    for row in result["rows"]:
        if row["side"] == "llamagym":
            continue
        label = f"LlamaGym 0.1.1 ({row['max_position_embeddings']} positions)"
        style = "--" if row["max_position_embeddings"] == PEER_MAX_POSITIONS else ":"
        steps_axis.axhline(row["env_steps_per_second"]["median"], color="gray", ls=style,
                           label=label)
        if row["generated_tokens_per_second"]:
            tokens_axis.axhline(row["generated_tokens_per_second"]["median"], color="gray",
                                ls=style, label=label)
    for axis, title in ((steps_axis, "env steps / s (rollout)"),
                        (tokens_axis, "generated tokens / s")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        batches = result["settings"]["batch_sizes"]
        axis.set_xticks(batches, [str(b) for b in batches])
        axis.set_xlabel("environments per batch (num_envs)")
        axis.set_title(title)
        axis.grid(alpha=0.3, which="both")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.suptitle(f"Blackjack, tiny model, {result['threads']} thread(s)"
                 + (" (quick)" if result["quick"] else ""))
    return save_figure(fig, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES),
                        help=f"num_envs values to measure (default: {BATCH_SIZES})")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="action modes to measure (default: both)")


def run(args: argparse.Namespace) -> list[Path]:
    # `python -m benchmarks all` has only the common options.
    args.batch_sizes = getattr(args, "batch_sizes", None) or list(BATCH_SIZES)
    args.modes = getattr(args, "modes", None) or list(MODES)
    plan = QUICK if args.quick else FULL
    raw = measure(args, plan)
    summary = summarise(raw, args.batch_sizes)
    settings = {
        "plan": asdict(plan),
        "batch_sizes": sorted(args.batch_sizes),
        "modes": list(args.modes),
        "headline_batch": HEADLINE_BATCH,
        "target_ratio": TARGET_RATIO,
        "peer_generate_config": peer_generate_config(),
        "peer_max_position_embeddings": PEER_MAX_POSITIONS,
        "update_num_envs": UPDATE_NUM_ENVS,
    }
    data = {
        **summary,
        "settings": settings,
        "peer": {"venv": raw["venv"], "error": raw["peer_error"], "skipped": args.skip_peer},
        "raw": {"ours": raw["ours"],
                "peer": {str(k): v for k, v in raw["peer"].items()}},
    }
    extra = []
    if sorted(args.batch_sizes) != sorted(BATCH_SIZES):
        extra += ["--batch-sizes", *map(str, args.batch_sizes)]
    if list(args.modes) != list(MODES):
        extra += ["--modes", *args.modes]
    path = write_result(PART, data, args, part_command(PART, args, extra))
    paths = [path]
    picture = plot(json.loads(path.read_text(encoding="utf-8")), path.with_suffix(".png"))
    if picture is not None:
        paths.append(picture)
    for ratio in summary["ratios"]:
        steps = ratio["env_steps_per_second"]
        log(PART, f"ours/peer at {HEADLINE_BATCH} envs, {ratio['mode']} mode: "
                  f"{steps['ratio']:.0f}x env steps/s (target {TARGET_RATIO:g}x)")
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(argv, work)


if __name__ == "__main__":
    sys.exit(main())
