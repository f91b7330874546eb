"""What the TRL backend costs over the native one: the same agent and batches trained by
LlamaGym's GRPO and by TRL's ``GRPOTrainer`` (``--backend trl``), per model.

    python benchmarks/trl_overhead.py                  # tiny and SmolLM2-135M
    python benchmarks/trl_overhead.py --models tiny    # one model
    python benchmarks/trl_overhead.py --quick          # tiny only, 3 updates (< 2 minutes)

Each run is ``llamagym run blackjack --mode generate --algorithm grpo --seed 0`` with the
same batch settings under both backends (``SETTINGS``: 64 episodes per update in seed
groups of 8, minibatches of 32, 2 epochs; ``rollout.history_turns`` unset and no
target-KL stop on both sides, as the TRL backend requires), the model's own defaults
otherwise (SmolLM2: LoRA on every layer, micro-batches of 8, 16 envs), one torch
thread, no checkpoints, no final evaluation. Every run is in a fresh worker process,
which starts the command in-process with timers wrapped around methods from outside
(nothing in ``llamagym`` is edited) and reads the run's ``metrics.jsonl``.

Per model and backend: ``seconds_per_update`` (median over the updates after the first,
from ``metrics.jsonl``), ``first_update_seconds``, and ``split``: per update, the
rollout (playing the episodes: ``Trainer._collect`` natively, the rollout function
``EpisodeRollouts.__call__`` under TRL) against optimisation (everything else), and
within it the parts the timers see (TRL: the no-grad log-prob passes, i.e. old policy
and reference; the loss's forward pass; the rest of the loss; backward; optimizer step;
the metrics callback; whatever is left is TRL's and transformers' own loop). ``ratio``
is TRL over native, for the whole update and for its two halves.

A Python profile (cProfile over ``GRPOTrainer.train`` only, start-up excluded) of one
TRL run on the tiny model is summarised as own time per package (TRL, transformers,
accelerate, torch, LlamaGym, ...), the time under each of TRL's entry points into
LlamaGym (rollout, reward, callbacks), and the top functions by cumulative time.

``--patch NAME`` applies one of ``PATCHES`` (a proposed change to the TRL backend,
monkeypatched in the worker) to the TRL runs, so its effect is measured on the same
batches. Writes ``benchmarks/results/trl-overhead.json`` (``trl-overhead-quick.json``
with ``--quick``; a smoke run never replaces a full result).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    REPO_ROOT,
    BenchmarkError,
    add_allow_dirty,
    emit_result,
    log,
    refuse_dirty_tree,
    run_command,
    write_script_result,
)

NAME = "trl-overhead"
BACKENDS = ("native", "trl")
MODELS = ("tiny", "smollm2-135m")
SEED = 0
#: The batch both backends train on (what LlamaGym's settings mean under TRL:
#: core/llamagym/trl_backend/settings.py, grpo_args).
SETTINGS: dict[str, Any] = {
    "algorithm.episodes_per_update": 64,
    "algorithm.group_size": 8,
    "algorithm.minibatch_size": 32,
    "algorithm.epochs": 2,
    # The TRL backend trains each episode as one sequence and has no target-KL stop:
    # the native run gets the same prompts and always runs its epochs.
    "rollout.history_turns": None,
    "algorithm.target_kl": None,
}
#: Updates per run: the first is warm-up (TRL's includes building the trainer).
UPDATES = {"tiny": 12, "smollm2-135m": 4}
QUICK_UPDATES = 3


# -- timers (in the worker) ---------------------------------------------------------------
class Timers:
    """Every call of the wrapped methods as (label, start, end), and the ends of the
    updates, so each update's time splits into the labelled parts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float]] = []
        self.update_ends: list[float] = []
        self.grpo_config: dict[str, Any] | None = None  # TRL's settings, as the run made them
        self.started: float | None = None  # the training loop's start

    def wrap(
        self, owner: Any, name: str, label: str | Callable[..., str | None]
    ) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            chosen = label(*args, **kwargs) if callable(label) else label
            self.mark_start()  # the first timed call starts the training loop
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if chosen is not None:
                    self.calls.append((chosen, started, time.perf_counter()))

        setattr(owner, name, timed)

    def mark_update_end(self, owner: Any, name: str, counts: Callable[..., bool]) -> None:
        """After each call of ``owner.name`` for which ``counts(*args)`` holds, an update
        ended."""
        original = getattr(owner, name)

        @functools.wraps(original)
        def marked(*args: Any, **kwargs: Any) -> Any:
            try:
                return original(*args, **kwargs)
            finally:
                if counts(*args, **kwargs):
                    self.update_ends.append(time.perf_counter())

        setattr(owner, name, marked)

    def mark_start(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()

    def per_update(self, first: bool = False) -> list[dict[str, float]]:
        """Per update after the first (``first``: the first alone, from the start of
        training): its wall time and each label's seconds in it."""
        rows = []
        ends = self.update_ends[:1] if first else self.update_ends
        starts = [self.started or 0.0] if first else self.update_ends
        for start, end in zip(starts, ends if first else ends[1:], strict=False):
            row = {"wall": end - start}
            for label, began, ended in self.calls:
                if start < began <= end:
                    row[label] = row.get(label, 0.0) + (ended - began)
            rows.append(row)
        return rows


#: GRPOConfig fields that decide how much work TRL does per update (recorded per run).
GRPO_FIELDS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size",
    "steps_per_generation", "num_generations", "num_iterations", "beta", "loss_type",
    "gradient_checkpointing", "activation_checkpointing", "bf16", "disable_dropout",
    "use_liger_kernel", "cast_lm_head_to_fp32", "top_entropy_quantile", "torch_compile",
    "logging_steps", "save_strategy", "max_completion_length", "mask_truncated_completions",
)


def _grad_label(inside: str, outside: str) -> Callable[..., str]:
    def label(*_: Any, **__: Any) -> str:
        import torch

        return inside if torch.is_grad_enabled() else outside

    return label


def instrument_native(timers: Timers) -> None:
    import torch

    from llamagym.training.loop.trainer import Trainer

    timers.wrap(Trainer, "_collect", "rollout")
    timers.wrap(Trainer, "_update", "update")
    timers.wrap(torch.Tensor, "backward", "backward")
    timers.wrap(torch.optim.Adam, "step", "optimizer step")
    timers.mark_update_end(Trainer, "_record", lambda *a, **k: True)


def instrument_trl(timers: Timers) -> None:
    import torch
    from trl import GRPOTrainer

    from llamagym.trl_backend import rollout as trl_rollout
    from llamagym.trl_backend import trainer as trl_backend

    timers.wrap(GRPOTrainer, "train", "train")  # its start is the training loop's
    timers.wrap(trl_rollout.EpisodeRollouts, "__call__", "rollout")
    timers.wrap(trl_rollout.EpisodeRollouts, "reward", "reward")
    timers.wrap(
        GRPOTrainer,
        "_get_per_token_logps_and_entropies",
        _grad_label("loss forward", "no-grad log-probs"),
    )
    timers.wrap(GRPOTrainer, "compute_loss", "compute_loss")
    timers.wrap(GRPOTrainer, "_generate_and_score_completions", "generate_and_score")
    timers.wrap(torch.Tensor, "backward", "backward")
    timers.wrap(torch.optim.AdamW, "step", "optimizer step")
    # The sequence engine's own chat-template renders (the base engine's are its own
    # module's): part of the rollout.
    timers.wrap(trl_rollout, "render_chat", "rollout: SequenceEngine chat template")
    timers.wrap(trl_backend._Clock, "on_log", "metrics callback")
    timers.wrap(trl_backend._Clock, "on_step_end", "stop check callback")
    original_args = trl_backend.grpo_args

    @functools.wraps(original_args)
    def grpo_args(*args: Any, **kwargs: Any) -> Any:
        made = original_args(*args, **kwargs)
        timers.grpo_config = {key: getattr(made, key, None) for key in GRPO_FIELDS}
        return made

    trl_backend.grpo_args = grpo_args
    timers.mark_update_end(
        trl_backend._Clock,
        "on_log",
        lambda *args, **kwargs: bool(kwargs.get("logs")) and "loss" in kwargs["logs"],
    )


def split_of(backend: str, rows: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """The median seconds per update of each part; ``rollout`` + ``optimisation`` is
    the update's wall time, and the named parts of optimisation are inside it."""

    def part(row: Mapping[str, float]) -> dict[str, float]:
        wall, rollout = row["wall"], row.get("rollout", 0.0)
        parts = {"wall": wall, "rollout": rollout, "optimisation": wall - rollout}
        if backend == "native":
            update = row.get("update", 0.0)
            backward, step = row.get("backward", 0.0), row.get("optimizer step", 0.0)
            parts.update({
                "update forward and loss": update - backward - step,
                "backward": backward,
                "optimizer step": step,
                "bookkeeping": wall - rollout - update,
            })
            return parts
        compute = row.get("compute_loss", 0.0)
        forward = row.get("loss forward", 0.0)
        score = row.get("generate_and_score", 0.0)
        named = {
            "no-grad log-probs": row.get("no-grad log-probs", 0.0),
            "reward": row.get("reward", 0.0),
            "batch preparation": score - rollout - row.get("no-grad log-probs", 0.0)
            - row.get("reward", 0.0),
            "loss forward": forward,
            "loss math": compute - forward,
            "backward": row.get("backward", 0.0),
            "optimizer step": row.get("optimizer step", 0.0),
            "metrics callback": row.get("metrics callback", 0.0),
            "stop check callback": row.get("stop check callback", 0.0),
        }
        parts.update(named)
        parts["rollout: SequenceEngine chat template"] = row.get(
            "rollout: SequenceEngine chat template", 0.0
        )
        parts["TRL and transformers loop"] = wall - rollout - sum(named.values())
        return parts

    measured = [part(row) for row in rows]
    if not measured:
        return {}
    return {key: statistics.median(m[key] for m in measured) for key in measured[0]}


# -- the profile -------------------------------------------------------------------------
PACKAGES = ("trl", "transformers", "accelerate", "peft", "torch", "datasets", "gymnasium",
            "numpy", "tokenizers")


def package_of(filename: str, function: str) -> str:
    """Which code a profiled function is: a site-packages package, LlamaGym (the
    repository's sources), torch's C functions, or the rest of Python."""
    if filename == "~":  # a C function: torch's if it names torch or a tensor
        return "torch" if "torch" in function or "Tensor" in function else "python"
    if "site-packages/" in filename:
        top = filename.split("site-packages/", 1)[1].split("/", 1)[0]
        return top if top in PACKAGES else "other libraries"
    if filename.startswith(str(REPO_ROOT)) and "/benchmarks/" not in filename:
        return "llamagym"
    return "python"


#: The TRL backend's entry points from TRL into LlamaGym, and TRL's big parts.
ENTRY_POINTS = {
    "trl_backend/rollout.py:EpisodeRollouts.__call__ (rollout, LlamaGym)": (
        "trl_backend/rollout.py", "__call__"),
    "trl_backend/rollout.py:EpisodeRollouts.reward (LlamaGym)": (
        "trl_backend/rollout.py", "reward"),
    "trl_backend/trainer.py:_Clock.on_log (LlamaGym)": ("trl_backend/trainer.py", "on_log"),
    "trl_backend/trainer.py:_Clock.on_step_end (LlamaGym)": (
        "trl_backend/trainer.py", "on_step_end"),
    "GRPOTrainer.training_step (TRL)": ("grpo_trainer.py", "training_step"),
    "GRPOTrainer._generate_and_score_completions (TRL)": (
        "grpo_trainer.py", "_generate_and_score_completions"),
    "GRPOTrainer._get_per_token_logps_and_entropies (TRL)": (
        "grpo_trainer.py", "_get_per_token_logps_and_entropies"),
    "GRPOTrainer._compute_loss (TRL)": ("grpo_trainer.py", "_compute_loss"),
    "torch autograd backward": ("~", "run_backward"),
    "optimizer step (torch)": ("adamw.py", "step"),
}


def summarise_profile(profile: cProfile.Profile, top: int = 20) -> dict[str, Any]:
    stats = pstats.Stats(profile)
    table: Mapping[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = stats.total_tt  # type: ignore[attr-defined]
    own: dict[str, float] = {}
    for (filename, _, function), (_, _, tottime, _, _) in table.items():
        package = package_of(filename, function)
        own[package] = own.get(package, 0.0) + tottime
    entries = {}
    for label, (file_part, function) in ENTRY_POINTS.items():
        cumulative = [
            value[3]
            for (filename, _, name), value in table.items()
            if name == function and filename.endswith(file_part)
        ]
        # A recursive or re-entered function counts its outermost calls once.
        entries[label] = max(cumulative, default=0.0)
    heaviest = sorted(table.items(), key=lambda item: item[1][3], reverse=True)
    functions = []
    for (filename, line, function), (_, calls, tottime, cumulative, _) in heaviest:
        if "/benchmarks/" in filename or filename.startswith("<"):
            continue  # the wrappers of this script, exec
        shown = filename.split("site-packages/", 1)[-1].replace(str(REPO_ROOT) + "/", "")
        functions.append({
            "function": f"{shown}:{line}({function})",
            "package": package_of(filename, function),
            "calls": calls,
            "cumulative_seconds": round(cumulative, 4),
            "own_seconds": round(tottime, 4),
        })
        if len(functions) == top:
            break
    return {
        "seconds": total,
        "own_seconds_by_package": dict(sorted(own.items(), key=lambda kv: -kv[1])),
        "own_share_by_package": {
            k: v / total for k, v in sorted(own.items(), key=lambda kv: -kv[1])
        },
        "cumulative_seconds_by_entry_point": entries,
        "top_cumulative": functions,
    }


@contextlib.contextmanager
def profiled_training(sink: dict[str, Any]) -> Any:
    """cProfile around ``GRPOTrainer.train`` only (imports and loading excluded)."""
    from trl import GRPOTrainer

    original = GRPOTrainer.train

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        profile = cProfile.Profile()
        profile.enable()
        try:
            return original(self, *args, **kwargs)
        finally:
            profile.disable()
            sink["profile"] = summarise_profile(profile)

    GRPOTrainer.train = train  # type: ignore[method-assign]
    try:
        yield
    finally:
        GRPOTrainer.train = original  # type: ignore[method-assign]


# -- proposed changes to the TRL backend, applied from outside --------------------------
def _cache_rendered_texts() -> None:
    """``SequenceEngine.render_prompts`` renders every turn's conversation through the
    chat template (sandboxed and traced) although the engine's prompt cache already
    spares the native rollout that work: the same bounded cache, for the texts."""
    from llamagym.rollout.engine import RolloutEngine
    from llamagym.rollout.prompts import PROMPT_CACHE_TOKENS
    from llamagym.trl_backend import rollout as trl_rollout
    from llamagym.trl_backend.rollout import SequenceEngine

    def chat_texts(self: Any, conversations: Sequence[Sequence[dict[str, str]]]) -> list[str]:
        cache = self.__dict__.setdefault("_text_cache", {})
        keys = [tuple((m["role"], m["content"]) for m in c) for c in conversations]
        texts = [cache.get(key) for key in keys]
        missing = [row for row, text in enumerate(texts) if text is None]
        if missing:
            rendered = trl_rollout.render_chat(  # through the module: timed as its renders
                self.policy.tokenizer, [conversations[r] for r in missing]
            )
            for row, text in zip(missing, rendered, strict=True):
                texts[row] = text
                used = self.__dict__.get("_text_cache_chars", 0)
                if used + len(text) <= 4 * PROMPT_CACHE_TOKENS:
                    cache[keys[row]] = text
                    self.__dict__["_text_cache_chars"] = used + len(text)
        return cast(list[str], texts)

    def render_prompts(self: Any, slots: Any, prefixes: Any = None) -> Any:
        from llamagym.errors import LlamaGymError

        user_texts, ids, conversations = RolloutEngine.render_prompts(self, slots, prefixes)
        tokenizer = self.policy.tokenizer
        texts = chat_texts(self, conversations)
        for row, slot in enumerate(slots):
            state = self._sequences.get(id(slot))
            if state is None or state[0] is not slot:
                continue
            _, sequence, so_far = state
            text = texts[row]
            if not text.startswith(so_far):
                raise LlamaGymError("the chat template renders an earlier turn differently")
            between = tokenizer(text[len(so_far):], add_special_tokens=False)["input_ids"]
            if sequence and between and sequence[-1] == between[0] == self.policy.eos_id:
                between = between[1:]
            ids[row] = sequence + between
        self._rendered = list(texts)
        return user_texts, ids, conversations

    SequenceEngine.render_prompts = render_prompts  # type: ignore[method-assign]


def _score_completion_positions_only() -> None:
    """Not a change of LlamaGym's: TRL's fused LM head scores only the completion
    positions where Triton runs, and every position (the prompt's too) elsewhere, such
    as on a CPU. Measures what that costs here (the kernel itself stays torch's)."""
    import trl.trainer.utils as trl_utils

    trl_utils._use_triton = lambda device: True


PATCHES: dict[str, Callable[[], None]] = {
    "render-cache": _cache_rendered_texts,
    "trl-compact-lm-head": _score_completion_positions_only,
}


# -- the worker ----------------------------------------------------------------------------
def run_arguments(spec: Mapping[str, Any], run_dir: Path) -> list[str]:
    """``llamagym run ...`` (without the program name) for one measurement."""
    updates, settings = spec["updates"], spec["settings"]
    words = [
        "run", "blackjack", "--model", spec["model"], "--mode", "generate",
        "--algorithm", "grpo", "--seed", str(spec["seed"]),
        "--episodes", str(updates * settings["algorithm.episodes_per_update"]),
        "--eval-episodes", "0", "--checkpoint-every", "0", "--quiet",
        "--threads", str(spec["threads"]), "--output", str(run_dir),
        "--set", "output.report=false",
    ]
    for key, value in settings.items():
        words += ["--set", f"{key}={'null' if value is None else value}"]
    if spec["backend"] == "trl":
        words += ["--backend", "trl"]
    return words


def without_output(words: Sequence[str]) -> list[str]:
    """The command's words without ``--output DIR`` (a temporary directory)."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word == "--output":
            skip = True
        else:
            kept.append(word)
    return kept


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """One run in this process: its timers, its metrics.jsonl and (if asked) a profile."""
    import yaml

    from llamagym.cli import main as cli_main

    timers = Timers()
    backend = spec["backend"]
    if backend == "trl":
        instrument_trl(timers)
        for name in spec.get("patches", []):
            PATCHES[name]()
    else:
        instrument_native(timers)
    sink: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="llamagym-trl-overhead-") as directory:
        run_dir = Path(directory) / "run"
        words = run_arguments(spec, run_dir)
        sys.argv = ["llamagym", *words]
        profiling = profiled_training(sink) if spec.get("profile") else contextlib.nullcontext()
        started = time.perf_counter()
        with profiling:
            try:
                cli_main()
            except SystemExit as stop:
                if stop.code not in (0, None):
                    raise BenchmarkError(f"llamagym run exited with {stop.code}") from None
        wall = time.perf_counter() - started
        lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        updates = [r for r in map(json.loads, lines) if r.get("kind") == "update"]
        resolved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    seconds = [updates[0]["seconds"]] + [
        later["seconds"] - earlier["seconds"] for earlier, later in pairwise(updates)
    ]
    per_update = timers.per_update()
    result = {
        "model": spec["model"],
        "backend": backend,
        "patches": spec.get("patches", []),
        "command": "llamagym " + " ".join(without_output(words)),
        "updates": len(updates),
        "episodes": updates[-1]["total_episodes"] if updates else 0,
        "env_steps": updates[-1]["env_steps"] if updates else 0,
        "update_seconds": seconds,
        "first_update_seconds": seconds[0] if seconds else None,
        "seconds_per_update": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "split": split_of(backend, per_update),
        "first_update_split": split_of(backend, timers.per_update(first=True)),
        "timers_per_update": per_update,
        "grpo_config": timers.grpo_config,
        "wall_seconds": wall,
        "episode_length": statistics.fmean(r["episode_length"] for r in updates),
        "invalid_rate": statistics.fmean(r["invalid_rate"] for r in updates),
        "metrics": {
            key: [r.get(key) for r in updates]
            for key in ("env_steps_per_second", "return_mean", "reply_tokens", "policy_loss")
        },
        "resolved": {
            "algorithm": resolved.get("algorithm"),
            "rollout": {k: resolved.get("rollout", {}).get(k)
                        for k in ("num_envs", "max_new_tokens", "top_k", "history_turns")},
            "model": resolved.get("model"),
        },
    }
    if "profile" in sink:
        result["profile"] = sink["profile"]
    return result


# -- the parent -----------------------------------------------------------------------------
def worker(spec: Mapping[str, Any], threads: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.trl_overhead", "--worker", json.dumps(dict(spec))]
    return run_command(command, threads)


def ratio(trl: float | None, native: float | None) -> float | None:
    return None if not trl or not native else trl / native


def compare(runs: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """TRL over native for one model: the whole update and its two halves."""
    native, trl = runs["native"], runs["trl"]
    return {
        "seconds_per_update": ratio(trl["seconds_per_update"], native["seconds_per_update"]),
        "rollout": ratio(trl["split"].get("rollout"), native["split"].get("rollout")),
        "optimisation": ratio(trl["split"].get("optimisation"),
                              native["split"].get("optimisation")),
        "extra_seconds_per_update": trl["seconds_per_update"] - native["seconds_per_update"],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help=f"tiny only, {QUICK_UPDATES} updates per run (< 2 minutes)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=None,
                        help="default: both (--quick: tiny)")
    parser.add_argument("--updates", type=int, default=None,
                        help=f"updates per run for every model (default: {UPDATES})")
    parser.add_argument("--no-profile", action="store_true",
                        help="skip the profiled TRL run on the tiny model")
    parser.add_argument("--patch", nargs="+", choices=sorted(PATCHES), default=[],
                        help="also measure TRL with these proposed changes applied")
    parser.add_argument("--patch-models", nargs="+", choices=MODELS, default=None,
                        help="measure the patches on these models only (default: every one)")
    parser.add_argument("--reuse", action="store_true",
                        help="take each model's native and TRL runs from the earlier result "
                        "file when it measured the same settings and updates (then only the "
                        "patches run); models it holds and this run does not are kept")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--output", type=Path, default=None,
                        help="where the JSON goes (default: results/trl-overhead.json)")
    add_allow_dirty(parser)
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        import torch

        torch.set_num_threads(int(spec["threads"]))
        emit_result(measure(spec))
        return 0
    refuse_dirty_tree(NAME, args.quick, args.allow_dirty)

    models = args.models or (["tiny"] if args.quick else list(MODELS))
    output = args.output or DEFAULT_RESULTS_DIR / f"{NAME}{'-quick' if args.quick else ''}.json"
    earlier: dict[str, Any] = {}
    if args.reuse and output.is_file():
        before = json.loads(output.read_text(encoding="utf-8"))
        if before.get("settings") == SETTINGS and before.get("threads") == args.threads:
            earlier = before.get("models", {})
    # The commands whose measurements a reusing run keeps, oldest first.
    kept_commands: list[str] = []
    if earlier:
        kept_commands = [*before.get("earlier_commands", []), before["command"]]
    results: dict[str, Any] = {m: e for m, e in earlier.items() if m not in models}
    try:
        for model in models:
            updates = args.updates or (QUICK_UPDATES if args.quick else UPDATES[model])
            base = {"model": model, "seed": SEED, "updates": updates, "threads": args.threads,
                    "settings": SETTINGS}
            runs: dict[str, Any] = {}
            kept = earlier.get(model, {}).get("runs", {})
            for backend in BACKENDS:
                if kept.get(backend, {}).get("updates") == updates:
                    runs[backend] = kept[backend]
                    log(NAME, f"{model}, {backend}: kept from {output}")
                    continue
                log(NAME, f"{model}, {backend}: {updates} updates")
                runs[backend] = worker({**base, "backend": backend}, args.threads)
                log(NAME, f"{model}, {backend}: {runs[backend]['seconds_per_update']:.3f} s/update")
            entry: dict[str, Any] = {"runs": runs, "ratio": compare(runs)}
            if earlier.get(model, {}).get("patched"):
                entry["patched"] = dict(earlier[model]["patched"])
            patches = args.patch if model in (args.patch_models or models) else []
            for name in patches:
                log(NAME, f"{model}, trl with {name}")
                patched = worker({**base, "backend": "trl", "patches": [name]}, args.threads)
                entry.setdefault("patched", {})[name] = {
                    "run": patched,
                    "seconds_per_update_before": runs["trl"]["seconds_per_update"],
                    "seconds_per_update_after": patched["seconds_per_update"],
                    "gain": 1 - patched["seconds_per_update"] / runs["trl"]["seconds_per_update"],
                }
            results[model] = entry
        profile = None
        if args.reuse and output.is_file() and earlier:
            profile = json.loads(output.read_text(encoding="utf-8")).get("profile_tiny_trl")
        if not args.no_profile and "tiny" in models:
            updates = args.updates or (QUICK_UPDATES if args.quick else UPDATES["tiny"])
            log(NAME, f"tiny, trl under cProfile: {updates} updates")
            profiled = worker({"model": "tiny", "seed": SEED, "updates": updates,
                               "threads": args.threads, "settings": SETTINGS, "backend": "trl",
                               "profile": True}, args.threads)
            profile = {**profiled["profile"], "seconds_per_update_profiled":
                       profiled["seconds_per_update"], "updates": profiled["updates"]}
    except BenchmarkError as error:
        log(NAME, f"failed: {error}")
        return 1
    data = {
        "agent": "blackjack",
        "mode": "generate",
        "algorithm": "grpo",
        "seed": SEED,
        "threads": args.threads,
        "settings": SETTINGS,
        "models": results,
        "summary": {
            model: {
                "seconds_per_update": {b: entry["runs"][b]["seconds_per_update"]
                                       for b in BACKENDS},
                "rollout_seconds": {b: entry["runs"][b]["split"].get("rollout")
                                    for b in BACKENDS},
                "optimisation_seconds": {b: entry["runs"][b]["split"].get("optimisation")
                                         for b in BACKENDS},
                "ratio": entry["ratio"],
            }
            for model, entry in results.items()
        },
        "profile_tiny_trl": profile,
        "earlier_commands": kept_commands,
    }
    path = write_script_result(NAME, args.quick, args.output, data, argv)
    print(json.dumps(data["summary"], indent=2))
    log(NAME, f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
