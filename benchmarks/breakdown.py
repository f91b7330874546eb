"""Where the rollout's time goes at 32 envs: the model's forward pass against prompt
rendering, tokenisation, action extraction, ``env.step`` and the engine's own loop.

    python -m benchmarks breakdown [--quick] [--threads N]

Instrumented from outside: in a worker process the engine's, policy's, tokenizer's,
hooks' and envs' methods are wrapped with timers (nothing in ``llamagym`` is edited),
and each wrapper's time is split into its own part and its callees' (a timer stack),
so the shares add up to the rollout's wall time. A second, shorter pass under
cProfile lists the functions with the most time of their own. Writes
``breakdown.json`` and ``breakdown.png``. Target: forward >= 85% of rollout time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import pstats
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    add_common_arguments,
    log,
    part_command,
    pyplot,
    run_worker,
    save_figure,
    spread,
    threads_of,
    worker_main,
    write_result,
)

PART = "breakdown"
NUM_ENVS = 32
MODES = ("score", "generate")
TARGET_FORWARD_SHARE = 0.85

# Timer label -> category of the report. Labels are the wrapped methods.
CATEGORIES: dict[str, str] = {
    "model forward": "model forward",
    "chat template": "prompt rendering",
    "format_observation hook": "prompt rendering",
    "system_prompt hook": "prompt rendering",
    "history and messages": "prompt rendering",
    "render_prompts (own)": "prompt rendering",
    "tokenizer call": "tokenisation",
    "candidate_tokens (own)": "tokenisation",
    "decode replies": "tokenisation",
    "extract_action hook": "extraction",
    "env.step": "env.step",
    "env.reset": "env.reset",
    "policy.score (own)": "policy tensors (padding, log-softmax, gathers)",
    "policy.evaluate_replies (own)": "policy tensors (padding, log-softmax, gathers)",
    "policy.generate (own)": "policy tensors (padding, log-softmax, gathers)",
    "hf generate loop (own)": "generate loop (sampling, stopping)",
    "choose action (own)": "sampling and turn records",
    "legal_actions": "engine loop",
    "episode_end hook": "engine loop",
    "decide (own)": "engine loop",
    "collect (own)": "engine loop",
}


class Timers:
    """Inclusive and own (exclusive) wall time per label, from nested wrappers."""

    def __init__(self) -> None:
        self.own: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.missing: list[str] = []  # methods this version of llamagym does not have
        self._stack: list[list[float]] = []  # [start, time spent in callees]

    def wrap(self, function: Callable[..., Any], label: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - frame[0]
                self._stack.pop()
                self.own[label] = self.own.get(label, 0.0) + elapsed - frame[1]
                self.calls[label] = self.calls.get(label, 0) + 1
                if self._stack:
                    self._stack[-1][1] += elapsed

        return timed

    def patch(self, owner: Any, attribute: str, label: str) -> None:
        """Replace ``owner.attribute`` (on this instance only) with a timed version."""
        if not hasattr(owner, attribute):
            self.missing.append(f"{type(owner).__name__}.{attribute}")
            return
        setattr(owner, attribute, self.wrap(getattr(owner, attribute), label))

    def patch_call(self, owner: Any, label: str) -> None:
        """Time ``owner(...)``: special methods are looked up on the class, so give this
        one object a subclass of its own whose ``__call__`` is timed."""
        cls = type(owner)
        timed = self.wrap(cls.__call__, label)
        owner.__class__ = type(cls.__name__, (cls,), {"__call__": timed})


def instrument(timers: Timers, agent: Any, envs: list[Any]) -> None:
    engine, policy = agent.engine, agent.policy
    tokenizer, plugins = policy.tokenizer, engine.plugins
    timers.patch(engine, "collect", "collect (own)")
    timers.patch(engine, "decide", "decide (own)")
    timers.patch(engine, "render_prompts", "render_prompts (own)")
    timers.patch(engine, "_history", "history and messages")
    timers.patch(engine, "_messages", "history and messages")
    timers.patch(engine, "candidate_tokens", "candidate_tokens (own)")
    timers.patch(engine, "_decide_by_score", "choose action (own)")
    timers.patch(engine, "_decide_by_generation", "choose action (own)")
    timers.patch(agent, "legal_actions", "legal_actions")
    timers.patch(plugins, "format_observation", "format_observation hook")
    timers.patch(plugins, "system_prompt", "system_prompt hook")
    timers.patch(plugins, "extract_action", "extract_action hook")
    timers.patch(plugins, "episode_end", "episode_end hook")
    timers.patch(tokenizer, "apply_chat_template", "chat template")
    timers.patch(tokenizer, "decode", "decode replies")
    timers.patch_call(tokenizer, "tokenizer call")
    timers.patch(policy, "score", "policy.score (own)")
    timers.patch(policy, "evaluate_replies", "policy.evaluate_replies (own)")
    timers.patch(policy, "generate", "policy.generate (own)")
    timers.patch(policy.model, "generate", "hf generate loop (own)")
    timers.patch(policy.model, "forward", "model forward")
    for env in envs:
        timers.patch(env, "step", "env.step")
        timers.patch(env, "reset", "env.reset")


def cprofile_top(agent: Any, envs: list[Any], seconds: float, count: int = 20) -> list[dict]:
    """The functions with the most own time in a cProfile'd rollout."""
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    while time.perf_counter() - started < seconds:
        agent.engine.collect(envs, 4 * NUM_ENVS)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    rows = sorted(stats.stats.items(), key=lambda item: item[1][2], reverse=True)  # type: ignore[attr-defined]
    top = []
    for (filename, line, name), (_, calls, own, cumulative, _) in rows[:count]:
        top.append({
            "function": f"{Path(filename).name}:{line}({name})",
            "calls": calls,
            "own_seconds": own,
            "own_share": own / total if total else None,
            "cumulative_seconds": cumulative,
        })
    return top


# -- the worker -------------------------------------------------------------------------
def work(spec: dict[str, Any]) -> dict[str, Any]:
    return {"results": [profile_item(item) for item in spec["items"]]}


def profile_item(item: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.ours import make_agent, model_facts

    overrides: dict[str, Any] = {}
    if item.get("model_dir"):
        from benchmarks.scaling import build_model

        build_model(Path(item["model_dir"]), item["dims"])
        overrides["model"] = {"name": item["model_dir"]}
    agent = make_agent(item["mode"], NUM_ENVS, item["seed"], overrides)
    engine = agent.engine
    envs = [agent.make_env() for _ in range(NUM_ENVS)]
    engine.collect(envs, NUM_ENVS)  # warm-up
    top = cprofile_top(agent, envs, item["cprofile_seconds"]) if item["cprofile_seconds"] else []
    timers = Timers()
    instrument(timers, agent, envs)
    steps_before, model_before = engine.stats.env_steps, engine.stats.seconds_model
    started = time.perf_counter()
    while time.perf_counter() - started < item["seconds"]:
        engine.collect(envs, 4 * NUM_ENVS)
    wall = time.perf_counter() - started
    measured = sum(timers.own.values())
    categories: dict[str, float] = {}
    for label, seconds in timers.own.items():
        category = CATEGORIES.get(label, "other")
        categories[category] = categories.get(category, 0.0) + seconds
    return {
        **item,
        "model": model_facts(agent),
        "wall_seconds": wall,
        "instrumented_seconds": measured,
        "env_steps": engine.stats.env_steps - steps_before,
        "labels": {label: {"seconds": s, "share": s / measured, "calls": timers.calls[label]}
                   for label, s in sorted(timers.own.items(), key=lambda kv: -kv[1])},
        "categories": {name: s / measured
                       for name, s in sorted(categories.items(), key=lambda kv: -kv[1])},
        "engine_seconds_model_share": (engine.stats.seconds_model - model_before) / wall,
        "cprofile_top": top,
        "not_instrumented": timers.missing,
    }


# -- the run ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> list[Path]:
    from benchmarks.scaling import SIZES

    threads = threads_of(args)
    repeats, seconds, cprofile_seconds = (1, 2.0, 1.0) if args.quick else (3, 20.0, 10.0)
    models = ("tiny",) if args.quick else ("tiny", "5M")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llamagym-profile-") as workdir:
        items = [
            {"model_name": name, "mode": mode, "seed": repeat, "seconds": seconds,
             "cprofile_seconds": cprofile_seconds if repeat == 0 else 0,
             "dims": SIZES[name], "model_dir": str(Path(workdir) / name) if SIZES[name] else None}
            for repeat in range(repeats) for name in models for mode in MODES
        ]
        batches = [items] if args.quick else [[item] for item in items]
        for batch in batches:
            answer = run_worker(PART, {"items": batch, "threads": threads}, threads)
            for result in answer["results"]:
                results.append(result)
                log(PART, f"{result['model_name']} {result['mode']} x{NUM_ENVS} seed "
                          f"{result['seed']}: forward "
                          f"{result['categories'].get('model forward', 0):.0%} of rollout time")
    summary = []
    for name in models:
        for mode in MODES:
            runs = [r for r in results if r["model_name"] == name and r["mode"] == mode]
            summary.append(_summarise(name, mode, runs))
    data = {
        "summary": summary,
        "settings": {"num_envs": NUM_ENVS, "seconds": seconds, "repeats": repeats,
                     "models": list(models), "target_forward_share": TARGET_FORWARD_SHARE,
                     "categories": CATEGORIES},
        "runs": results,
    }
    path = write_result(PART, data, args, part_command(PART, args))
    paths = [path]
    picture = plot(summary, path.with_suffix(".png"), threads)
    if picture is not None:
        paths.append(picture)
    return paths


def _by_median(shares: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]["median"]))


def _summarise(name: str, mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = {category for r in runs for category in r["categories"]}
    shares = _by_median({category: spread(r["categories"].get(category, 0.0) for r in runs)
                         for category in names})
    labels = {label for r in runs for label in r["labels"]}
    label_shares = _by_median({
        label: spread(r["labels"].get(label, {}).get("share", 0.0) for r in runs)
        for label in labels})
    forward = shares.get("model forward")
    env = sum(shares[c]["median"] for c in ("env.step", "env.reset") if c in shares)
    return {
        "model_name": name,
        "parameters": runs[0]["model"]["parameters"],
        "mode": mode,
        "num_envs": NUM_ENVS,
        "forward_share": forward,
        # The same share with the environment's own time left out: what the framework
        # costs beside the model.
        "forward_share_excluding_env": (forward["median"] / (1 - env)) if forward else None,
        # The share if the framework cost nothing at all: only the model and the env's own
        # reset/step left. Where this is below the target, no framework change reaches it.
        "forward_share_ceiling": (
            forward["median"] / (forward["median"] + env) if forward else None
        ),
        "meets_target": bool(forward and forward["median"] >= TARGET_FORWARD_SHARE),
        "categories": shares,
        "labels": label_shares,
        "engine_seconds_model_share": spread(r["engine_seconds_model_share"] for r in runs),
        "cprofile_top": next((r["cprofile_top"] for r in runs if r["cprofile_top"]), []),
    }


def plot(summary: list[dict[str, Any]], path: Path, threads: int) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    names = sorted({n for s in summary for n in s["categories"]},
                   key=lambda n: -max(s["categories"].get(n, {"median": 0})["median"]
                                      for s in summary))
    fig, axis = plt.subplots(figsize=(9, 2.2 + 0.45 * len(summary)))
    for row, entry in enumerate(summary):
        left = 0.0
        for index, name in enumerate(names):
            share = entry["categories"].get(name, {"median": 0.0})["median"]
            axis.barh(row, share, left=left, color=plt.cm.tab10(index % 10),
                      label=name if row == 0 else None)
            left += share
    axis.axvline(TARGET_FORWARD_SHARE, color="black", ls="--", lw=1)
    axis.set_yticks(range(len(summary)),
                    [f"{s['model_name']}, {s['mode']} mode" for s in summary])
    axis.set_xlim(0, 1)
    axis.set_xlabel(f"share of rollout wall time, {NUM_ENVS} envs, {threads} thread(s) "
                    f"(dashed: forward target {TARGET_FORWARD_SHARE:.0%})")
    axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3)
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(argv, work)


if __name__ == "__main__":
    sys.exit(main())
