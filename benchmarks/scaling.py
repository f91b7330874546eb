"""Scaling: how env steps/s and update time change with model size (tiny, ~5M, ~20M,
~80M parameters) and with prompt length (0, 2 and 8 earlier turns in the prompt).

    python -m benchmarks scaling [--quick] [--threads N]

The larger models are Llama configs built locally with the tiny model's tokenizer and
random weights (speed does not depend on what the weights know), loaded through
``--model DIR`` like any local checkpoint; above 50M parameters LlamaGym switches
LoRA on by itself, as it would for a user. Prompt length is varied on a synthetic
long-history Blackjack, where one episode is a run of consecutive hands, so the
prompt can carry up to ``history_turns`` earlier hands and replies. Writes
``scaling.json`` and ``scaling.png``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Sequence
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

PART = "scaling"
NUM_ENVS = 32
# name -> Llama dimensions; parameter counts with the tiny tokenizer's 1,024 tokens.
SIZES: dict[str, dict[str, int] | None] = {
    "tiny": None,  # the built-in tiny model itself (~0.23M)
    "5M": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6,
           "num_attention_heads": 4},
    "20M": {"hidden_size": 512, "intermediate_size": 1376, "num_hidden_layers": 6,
            "num_attention_heads": 8},
    "80M": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 11,
            "num_attention_heads": 12},
}
HISTORY_TURNS = (0, 2, 8)
HANDS_PER_EPISODE = 12  # the synthetic long-history episode: this many hands in a row


def llama_parameters(dims: dict[str, int], vocab_size: int = 1024) -> int:
    """Parameter count of an untied Llama with full multi-head attention."""
    d, ff, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    per_layer = 4 * d * d + 3 * d * ff + 2 * d
    return layers * per_layer + 2 * vocab_size * d + d


# -- worker side ------------------------------------------------------------------------
def build_model(directory: Path, dims: dict[str, int], seed: int = 0) -> Path:
    """A random-weight Llama of ``dims`` with the tiny tokenizer, saved in ``directory``."""
    if (directory / "config.json").exists():
        return directory
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from llamagym.models.tiny import MODEL_CONFIG, build_tiny_model

    tiny = build_tiny_model(seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=MODEL_CONFIG["max_position_embeddings"],
        tie_word_embeddings=False,
        num_key_value_heads=dims["num_attention_heads"],
        **dims,
    )
    staging = Path(tempfile.mkdtemp(prefix=directory.name + ".tmp-", dir=directory.parent))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(staging)
    for item in tiny.iterdir():
        if item.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copyfile(item, staging / item.name)
    try:
        staging.rename(directory)
    except OSError:  # another worker finished first
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def long_history_agent_class() -> type:
    import gymnasium

    from llamagym.plugin_runtime.manager import get_plugins

    blackjack = get_plugins().registry.get("agent", "blackjack").load()

    class ManyHands(gymnasium.Wrapper):
        """One episode = ``hands`` Blackjack hands in a row (the env's own RNG deals
        the later ones, so a seeded reset fixes the whole run)."""

        def __init__(self, env: Any, hands: int):
            super().__init__(env)
            self.hands = hands
            self.left = hands

        def reset(self, **kwargs: Any) -> Any:
            self.left = self.hands
            return self.env.reset(**kwargs)

        def step(self, action: Any) -> Any:
            observation, reward, terminated, truncated, info = self.env.step(action)
            if terminated or truncated:
                self.left -= 1
                if self.left > 0:
                    observation, info = self.env.reset()
                    terminated = truncated = False
            return observation, reward, terminated, truncated, info

    class LongHistoryBlackjack(blackjack):  # type: ignore[misc, valid-type]
        def make_env(self) -> Any:
            return ManyHands(super().make_env(), HANDS_PER_EPISODE)

    return LongHistoryBlackjack


def work(spec: dict[str, Any]) -> dict[str, Any]:
    return {"results": [measure_item(item) for item in spec["items"]]}


def measure_item(item: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.ours import make_agent, measure_rollout, measure_updates, model_facts

    overrides: dict[str, Any] = {"algorithm": {"episodes_per_update": item["update_episodes"]}}
    agent_class = None
    if item.get("model_dir"):
        build_model(Path(item["model_dir"]), item["dims"])
        overrides["model"] = {"name": item["model_dir"]}
    if item.get("history_turns") is not None:
        overrides["rollout"] = {"history_turns": item["history_turns"]}
        agent_class = long_history_agent_class()
    agent = make_agent(item["mode"], NUM_ENVS, item["seed"], overrides, agent_class)
    rollout = measure_rollout(agent, item["seconds"])
    updates = measure_updates(agent, item["updates"], warmup=False)
    return {**item, **rollout, **updates, "model": model_facts(agent)}


# -- the run ----------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common_arguments(parser)


def run(args: argparse.Namespace) -> list[Path]:
    threads = threads_of(args)
    quick = args.quick
    sizes = ("tiny", "5M") if quick else tuple(SIZES)
    modes = ("score",) if quick else ("score", "generate")
    repeats, seconds, updates, update_episodes = (1, 0.5, 1, 16) if quick else (2, 15.0, 2, 64)
    history_episodes = 4 if quick else 16  # x12 hands: 48 / 192 turns per update
    models: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llamagym-scaling-") as workdir:
        items: list[dict[str, Any]] = []
        for repeat in range(repeats):
            for name in sizes:
                dims = SIZES[name]
                for mode in modes:
                    items.append({
                        "kind": "model", "size": name, "mode": mode, "seed": repeat,
                        "seconds": seconds, "updates": updates,
                        "update_episodes": update_episodes, "dims": dims,
                        "model_dir": str(Path(workdir) / name) if dims else None,
                    })
            for turns in HISTORY_TURNS:
                items.append({
                    "kind": "history", "history_turns": turns, "mode": "score", "seed": repeat,
                    "seconds": seconds, "updates": updates, "update_episodes": history_episodes,
                })
        # A fresh process per measurement; a smoke run shares one to save start-up time.
        batches = [items] if quick else [[item] for item in items]
        for batch in batches:
            answer = run_worker(PART, {"items": batch, "threads": threads}, threads)
            for result in answer["results"]:
                if result["kind"] == "model":
                    models.append(result)
                    log(PART, f"{result['size']} {result['mode']}: "
                              f"{result['env_steps_per_second']:.1f} env steps/s, "
                              f"update {result['update_seconds'][0]:.2f}s")
                else:
                    history.append(result)
                    log(PART, f"history {result['history_turns']}: "
                              f"{result['prompt_tokens_mean']:.0f} prompt tokens, "
                              f"{result['env_steps_per_second']:.1f} env steps/s")
    data = {
        "models": _summarise(models, ("size", "mode")),
        "history": _summarise(history, ("history_turns", "mode")),
        "settings": {
            "num_envs": NUM_ENVS, "seconds": seconds, "repeats": repeats,
            "model_update_episodes": update_episodes, "history_update_episodes": history_episodes,
            "hands_per_episode": HANDS_PER_EPISODE, "sizes": {k: SIZES[k] for k in sizes},
        },
        "raw": {"models": models, "history": history},
    }
    path = write_result(PART, data, args, part_command(PART, args))
    paths = [path]
    picture = plot({**data, "quick": args.quick}, path.with_suffix(".png"), threads)
    if picture is not None:
        paths.append(picture)
    return paths


def _summarise(results: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for result in results:
        groups.setdefault(tuple(result[k] for k in keys), []).append(result)
    rows = []
    for group_key, runs in groups.items():
        first = runs[0]
        rows.append({
            **dict(zip(keys, group_key, strict=True)),
            "parameters": first["model"]["parameters"],
            "trainable_parameters": first["model"]["trainable_parameters"],
            "lora": first["model"]["lora"],
            "num_envs": NUM_ENVS,
            "env_steps_per_second": spread(r["env_steps_per_second"] for r in runs),
            "generated_tokens_per_second": spread(r["generated_tokens_per_second"] for r in runs),
            "prompt_tokens_mean": spread(r["prompt_tokens_mean"] for r in runs),
            "update_seconds": spread(s for r in runs for s in r["update_seconds"]),
            "turns_per_update": spread(t for r in runs for t in r["turns_per_update"]),
            "episodes_per_update": first["episodes_per_update"],
            "peak_rss_mb": spread(r["peak_rss_mb"] for r in runs),
        })
    return rows


def plot(data: dict[str, Any], path: Path, threads: int) -> Path | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, (size_axis, history_axis) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode, marker in (("score", "o"), ("generate", "s")):
        rows = sorted((r for r in data["models"] if r["mode"] == mode),
                      key=lambda r: r["parameters"])
        if rows:
            size_axis.plot([r["parameters"] for r in rows],
                           [r["env_steps_per_second"]["median"] for r in rows],
                           marker=marker, label=f"env steps/s ({mode})")
            size_axis.plot([r["parameters"] for r in rows],
                           [r["turns_per_update"]["median"] / r["update_seconds"]["median"]
                            for r in rows], marker=marker, ls="--",
                           label=f"turns trained/s ({mode})")
    size_axis.set_xscale("log")
    size_axis.set_yscale("log")
    size_axis.tick_params(axis="x", which="minor", labelbottom=False)
    size_axis.set_xlabel("model parameters")
    size_axis.set_title(f"model size ({NUM_ENVS} envs)")
    rows = sorted(data["history"], key=lambda r: r["history_turns"])
    if rows:
        tokens = [r["prompt_tokens_mean"]["median"] for r in rows]
        history_axis.plot(tokens, [r["env_steps_per_second"]["median"] for r in rows],
                          marker="o", label="env steps/s (score)")
        history_axis.plot(tokens, [r["turns_per_update"]["median"] / r["update_seconds"]["median"]
                                   for r in rows], marker="o", ls="--",
                          label="turns trained/s (score)")
        for row, x in zip(rows, tokens, strict=True):
            history_axis.annotate(f"{row['history_turns']} turns", (x, row[
                "env_steps_per_second"]["median"]), fontsize=8)
    history_axis.set_yscale("log")
    history_axis.set_xlabel("mean prompt tokens (tiny model)")
    history_axis.set_title("prompt length (turns of history)")
    for axis in (size_axis, history_axis):
        axis.grid(alpha=0.3, which="both")
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.suptitle(f"Blackjack, {threads} thread(s)" + (" (quick)" if data.get("quick") else ""))
    return save_figure(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    return worker_main(argv, work)


if __name__ == "__main__":
    sys.exit(main())
