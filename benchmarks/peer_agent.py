"""Blackjack with the original LlamaGym 0.1.1 ("the peer"), for the benchmarks.

Runs INSIDE the peer's venv (``benchmarks/peer.py`` creates it and starts this script
with ``python -P peer_agent.py --spec JSON``); it imports the peer's ``llamagym`` and
nothing of ours. The agent below is written in the peer's API (``Agent`` subclass,
``act`` / ``assign_reward`` / ``terminate_episode`` in our own loop), with our
Blackjack prompts, on our tiny model: the same Llama dimensions and the same starting
weights, loaded through ``trl.AutoModelForCausalLMWithValueHead.from_pretrained(dir,
peft_config=LoraConfig(r=16, ...))``, with our tokenizer and a Llama-2 style chat
template, since the peer cuts replies out of the decoded text at ``[/INST]``.

Tasks (``spec["task"]``):

* ``throughput``: play episodes (training as the peer does, a PPO step every
  ``batch_size`` turns) until ``min_steps`` env steps and ``min_updates`` updates are
  done, or ``max_seconds`` pass. Prints env steps/s, generated tokens/s, seconds per
  PPO update and peak RSS.
* ``learning``: train for ``minutes`` of wall clock, then evaluate with greedy decoding
  (``do_sample=False``, which the peer's ``generate_config_dict`` allows) on
  ``eval_episodes`` seeded episodes.

The result is one ``BENCHMARK-RESULT {json}`` line on stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import resource
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULT_MARKER = "BENCHMARK-RESULT "
STICK, HIT = 0, 1

# Llama-2's chat layout in our words: the system prompt sits inside the first [INST]
# block; a reply follows "[/INST] " and ends with the tokenizer's end token. The peer
# splits on "[/INST]" to find replies, and on "[/INST] " to cut queries from responses.
LLAMA2_CHAT_TEMPLATE = (
    "{%- set state = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- set state.system = '<<SYS>>\\n' + message['content'] + '\\n<</SYS>>\\n\\n' -%}"
    "{%- elif message['role'] == 'user' -%}"
    "{{- '[INST] ' + state.system + message['content'] + ' [/INST]' -}}"
    "{%- set state.system = '' -%}"
    "{%- else -%}"
    "{{- ' ' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)

# The peer's own defaults (Agent.__init__ when no dicts are given).
PEER_DEFAULT_GENERATE: dict[str, Any] = {
    "max_new_tokens": 32, "do_sample": True, "top_p": 0.6, "top_k": 0, "temperature": 0.9,
}
PEER_DEFAULT_PPO: dict[str, Any] = {"batch_size": 16, "mini_batch_size": 16}


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024


def load_model(
    model_dir: Path, seed: int, lora_rank: int, max_positions: int | None = None
) -> tuple[Any, Any, dict[str, Any]]:
    """The tiny Llama as the peer wants it: value-head wrapper around a LoRA model.

    ``max_positions`` replaces ``max_position_embeddings`` (no weight depends on it).
    transformers 4.38, which the peer is pinned to, rebuilds a causal mask of
    max_positions x max_positions on every forward pass; at our tiny model's 2048 that
    mask, not the model, takes ~95% of the peer's time, so the benchmarks give the
    peer 512 (enough for any Blackjack conversation) unless told otherwise.
    """
    import torch
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from trl import AutoModelForCausalLMWithValueHead

    spec = json.loads((model_dir / "peer_model.json").read_text(encoding="utf-8"))
    if max_positions:
        spec["config"]["max_position_embeddings"] = max_positions
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), **spec["tokens"]
    )
    tokenizer.chat_template = LLAMA2_CHAT_TEMPLATE
    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(**spec["config"]))
    # Same starting weights as our tiny model (parameter names are the same in
    # transformers 4.38 and 5.x); rotary buffers are rebuilt, not loaded.
    missing, unexpected = base.load_state_dict(
        load_file(str(model_dir / "model.safetensors")), strict=False
    )
    missing = [name for name in missing if "rotary_emb" not in name]
    if missing or unexpected:
        raise RuntimeError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
    lora = LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.05, bias="none",
        task_type="CAUSAL_LM",
    )
    with tempfile.TemporaryDirectory(prefix="peer-tiny-") as local_dir:
        base.save_pretrained(local_dir)
        tokenizer.save_pretrained(local_dir)
        model = AutoModelForCausalLMWithValueHead.from_pretrained(local_dir, peft_config=lora)
    info = {
        "parameters": sum(p.numel() for p in base.parameters()),
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "lora_rank": lora_rank,
        "max_position_embeddings": base.config.max_position_embeddings,
    }
    return model, tokenizer, info


def make_agent_class() -> type:
    from llamagym import Agent

    class BlackjackPeerAgent(Agent):
        """Our Blackjack prompts in the peer's API. A reply no rule understands becomes
        "stick" (the peer's ``act`` would return None on an exception, which
        ``env.step`` cannot take)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.replies = 0
            self.unparsable = 0
            self.update_seconds: list[float] = []
            super().__init__(*args, **kwargs)

        def get_system_prompt(self) -> str:
            return "Play blackjack: stick or hit."

        def format_observation(self, observation: Any) -> str:
            total, dealer, usable_ace = observation
            ace = "yes" if usable_ace else "no"
            return f"Sum {int(total)}, dealer {int(dealer)}, usable ace {ace}."

        def extract_action(self, response: str) -> int:
            self.replies += 1
            text = response.lower()
            found = re.search(r'"action"\s*:\s*"?(\w+)', text)
            words = [found.group(1)] if found else re.findall(r"[a-z]+|\d", text)
            for word in words:
                if word in ("stick", "stay", "stand", "0"):
                    return STICK
                if word in ("hit", "1"):
                    return HIT
            self.unparsable += 1
            return STICK

        def train_batch(self, batch_queries: Any, batch_responses: Any, batch_rewards: Any) -> Any:
            started = time.perf_counter()
            stats = super().train_batch(batch_queries, batch_responses, batch_rewards)
            self.update_seconds.append(time.perf_counter() - started)
            return stats

    return BlackjackPeerAgent


class TokenCounter:
    """Wraps ``model.generate`` to count the tokens each reply generated."""

    def __init__(self, generate: Callable[..., Any]):
        self._generate = generate
        self.tokens = 0
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        prompt = kwargs.get("inputs", args[0] if args else None)
        started = time.perf_counter()
        output = self._generate(*args, **kwargs)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        self.tokens += int(output.shape[-1]) - (int(prompt.shape[-1]) if prompt is not None else 0)
        return output


def play_episode(agent: Any, env: Any, seed: int | None, train: bool) -> tuple[float, int]:
    """One episode in the peer's loop; returns (return, steps)."""
    observation, _ = env.reset(seed=seed)
    total, steps, done = 0.0, 0, False
    while not done:
        action = agent.act(observation)
        observation, reward, terminated, truncated, _ = env.step(action)
        agent.assign_reward(reward)
        total += float(reward)
        steps += 1
        done = terminated or truncated
    agent.terminate_episode(train=train)
    return total, steps


def build(spec: dict[str, Any]) -> tuple[Any, Any, TokenCounter, dict[str, Any]]:
    import gymnasium as gym
    import torch

    torch.set_num_threads(int(spec["threads"]))
    torch.manual_seed(int(spec["seed"]))
    model, tokenizer, info = load_model(
        Path(spec["model_dir"]),
        int(spec["seed"]),
        int(spec.get("lora_rank", 16)),
        spec.get("max_position_embeddings"),
    )
    agent_class = make_agent_class()
    agent = agent_class(
        model, tokenizer, "cpu",
        spec.get("generate_config") or dict(PEER_DEFAULT_GENERATE),
        spec.get("ppo_config") or dict(PEER_DEFAULT_PPO),
    )
    counter = TokenCounter(agent.model.generate)
    agent.model.generate = counter
    env = gym.make("Blackjack-v1")
    info.update(
        threads=torch.get_num_threads(),
        generate_config=agent.generate_config_dict,
        ppo_batch_size=agent.ppo_config.batch_size,
        ppo_mini_batch_size=agent.ppo_config.mini_batch_size,
        ppo_epochs=agent.ppo_config.ppo_epochs,
    )
    return agent, env, counter, info


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    agent, env, counter, info = build(spec)
    seed = int(spec["seed"])
    play_episode(agent, env, seed, train=False)  # warm-up, not counted
    counter.tokens = counter.calls = 0
    counter.seconds = 0.0
    agent.replies = agent.unparsable = 0
    steps = episodes = 0
    started = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - started
        done = steps >= spec["min_steps"] and len(agent.update_seconds) >= spec["min_updates"]
        if done or elapsed >= spec["max_seconds"]:
            break
        _, taken = play_episode(agent, env, seed + 1 + episodes, train=True)
        steps += taken
        episodes += 1
    seconds = time.perf_counter() - started
    update_total = sum(agent.update_seconds)
    rollout_seconds = seconds - update_total
    return {
        "task": "throughput",
        "env_steps": steps,
        "episodes": episodes,
        "seconds": seconds,
        "rollout_seconds": rollout_seconds,
        "env_steps_per_second": steps / rollout_seconds,
        "env_steps_per_second_with_updates": steps / seconds,
        "generated_tokens": counter.tokens,
        "generated_tokens_per_second": counter.tokens / rollout_seconds,
        "tokens_per_reply": counter.tokens / max(1, counter.calls),
        "generate_seconds": counter.seconds,
        "update_seconds": agent.update_seconds,
        "updates": len(agent.update_seconds),
        "turns_per_update": info["ppo_batch_size"],
        "unparsable_rate": agent.unparsable / max(1, agent.replies),
        "peak_rss_mb": peak_rss_mb(),
        "model": info,
    }


def greedy_generate_config(config: dict[str, Any]) -> dict[str, Any]:
    """The peer's generate settings with sampling switched off (argmax decoding)."""
    kept = {key: value for key, value in config.items()
            if key not in ("do_sample", "top_p", "top_k", "temperature")}
    return {**kept, "do_sample": False}


def learning(spec: dict[str, Any]) -> dict[str, Any]:
    agent, env, counter, info = build(spec)
    seed = int(spec["seed"])
    budget = 60.0 * float(spec["minutes"])
    curve: list[tuple[float, int, float]] = []  # (seconds, episodes, return)
    steps = episodes = 0
    started = time.perf_counter()
    while time.perf_counter() - started < budget:
        episode_return, taken = play_episode(agent, env, seed * 1_000_003 + episodes, True)
        steps += taken
        episodes += 1
        curve.append((time.perf_counter() - started, episodes, episode_return))
    train_seconds = time.perf_counter() - started
    train_unparsable = agent.unparsable / max(1, agent.replies)

    # Greedy evaluation. Greedy decoding is deterministic, so a conversation seen before
    # gets the same reply; caching replies by conversation only saves time.
    agent.generate_config_dict = greedy_generate_config(agent.generate_config_dict)
    generate_reply = agent.llm
    replies: dict[str, str] = {}

    def cached_reply(messages: list[dict[str, str]]) -> str:
        key = json.dumps(messages)
        if key not in replies:
            replies[key] = generate_reply(messages)
        return replies[key]

    agent.llm = cached_reply
    agent.replies = agent.unparsable = 0
    returns: list[float] = []
    eval_started = time.perf_counter()
    eval_budget = 60.0 * float(spec.get("eval_max_minutes", 30))
    for k in range(int(spec["eval_episodes"])):
        if time.perf_counter() - eval_started > eval_budget:
            break
        episode_return, _ = play_episode(agent, env, int(spec["eval_seed_base"]) + k, False)
        returns.append(episode_return)
    n = len(returns)
    mean = sum(returns) / n if n else float("nan")
    variance = sum((r - mean) ** 2 for r in returns) / (n - 1) if n > 1 else float("nan")
    return {
        "task": "learning",
        "seed": seed,
        "minutes": spec["minutes"],
        "train_seconds": train_seconds,
        "train_episodes": episodes,
        "train_env_steps": steps,
        "updates": len(agent.update_seconds),
        "train_unparsable_rate": train_unparsable,
        "curve": downsample(curve, 200),
        "evaluation": {
            "greedy": True,
            "decoding": "generate_config_dict with do_sample=False (argmax)",
            "episodes": n,
            "episodes_asked": int(spec["eval_episodes"]),
            "mean": mean,
            "ci95": 1.96 * math.sqrt(variance / n) if n > 1 else float("nan"),
            "unparsable_rate": agent.unparsable / max(1, agent.replies),
            "distinct_conversations": len(replies),
            "seconds": time.perf_counter() - eval_started,
        },
        "peak_rss_mb": peak_rss_mb(),
        "model": info,
    }


def downsample(curve: list[tuple[float, int, float]], points: int) -> list[dict[str, float]]:
    """Moving-average training return (last 500 episodes) at up to ``points`` times."""
    if not curve:
        return []
    every = max(1, len(curve) // points)
    window: list[float] = []
    total = 0.0
    out = []
    for index, (seconds, episodes, episode_return) in enumerate(curve):
        window.append(episode_return)
        total += episode_return
        if len(window) > 500:
            total -= window.pop(0)
        if index % every == 0 or index == len(curve) - 1:
            out.append({"seconds": seconds, "episodes": episodes,
                        "return_moving_average": total / len(window)})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="the task, as JSON")
    spec = json.loads(parser.parse_args(argv).spec)
    tasks = {"throughput": throughput, "learning": learning}
    result = tasks[spec["task"]](spec)
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
