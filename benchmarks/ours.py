"""Measuring LlamaGym itself, inside a worker process: build the Blackjack agent the way
``llamagym run blackjack`` does, then time its rollout engine and its algorithm.

Only public pieces are used (the plugin registry, ``Agent.engine``, ``engine.collect``,
``Agent.algorithm.update``), so a number here is what a user's run spends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from benchmarks.common import peak_rss_mb


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def make_agent(
    mode: str,
    num_envs: int,
    seed: int,
    overrides: Mapping[str, Any] | None = None,
    agent_class: type | None = None,
) -> Any:
    """The registered Blackjack agent with its own defaults, ``mode`` and ``num_envs``."""
    from llamagym.plugin_runtime.manager import get_plugins
    from llamagym.training.loop.run_state import seed_everything

    if agent_class is None:
        agent_class = get_plugins().registry.get("agent", "blackjack").load()
    config = {"rollout": {"mode": mode, "num_envs": num_envs}, "training": {"seed": seed}}
    seed_everything(seed)
    return agent_class(config=deep_merge(config, overrides or {}))


def measure_rollout(agent: Any, seconds: float, warmup: bool = True) -> dict[str, Any]:
    """Play episodes on ``num_envs`` envs for at least ``seconds``; throughput numbers.

    Episodes are collected in rounds of ``4 * num_envs``, like the trainer's batches:
    the last steps of a round run with fewer envs active, as they do in training.
    """
    engine = agent.engine
    num_envs = agent.config.rollout.num_envs
    envs = [agent.make_env() for _ in range(num_envs)]
    if warmup:
        engine.collect(envs, num_envs)  # first calls allocate; not counted
    stats = engine.stats
    steps_before, model_before = stats.env_steps, stats.seconds_model
    tokens = turns = episodes = prompt_tokens = invalid = 0
    round_size = max(8, 4 * num_envs)
    started = time.perf_counter()
    while True:
        finished = engine.collect(envs, round_size)
        episodes += len(finished)
        for episode in finished:
            for turn in episode.turns:
                turns += 1
                tokens += len(turn.action_tokens)
                prompt_tokens += len(turn.prompt_tokens)
                invalid += not turn.valid
        if time.perf_counter() - started >= seconds:
            break
    elapsed = time.perf_counter() - started
    for env in envs:
        env.close()
    steps = stats.env_steps - steps_before
    generate = agent.config.rollout.mode == "generate"
    return {
        "env_steps": steps,
        "episodes": episodes,
        "seconds": elapsed,
        "env_steps_per_second": steps / elapsed,
        "generated_tokens": tokens if generate else None,
        "generated_tokens_per_second": tokens / elapsed if generate else None,
        "tokens_per_reply": tokens / max(1, turns) if generate else None,
        "prompt_tokens_mean": prompt_tokens / max(1, turns),
        "invalid_rate": invalid / max(1, turns),
        "model_seconds_share": (stats.seconds_model - model_before) / elapsed,
        "peak_rss_mb": peak_rss_mb(),
    }


def measure_updates(agent: Any, updates: int, warmup: bool = True) -> dict[str, Any]:
    """Collect ``episodes_per_update`` episodes and time ``algorithm.update`` on them."""
    engine, algorithm = agent.engine, agent.algorithm
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    seconds: list[float] = []
    turns: list[int] = []
    for index in range(updates + int(warmup)):
        batch = engine.collect(envs, algorithm.episodes_per_update, group_size=algorithm.group_size)
        started = time.perf_counter()
        algorithm.update(batch)
        if warmup and index == 0:
            continue  # the first update creates the optimizer's state
        seconds.append(time.perf_counter() - started)
        turns.append(sum(len(episode.turns) for episode in batch))
    for env in envs:
        env.close()
    return {
        "update_seconds": seconds,
        "turns_per_update": turns,
        "episodes_per_update": algorithm.episodes_per_update,
        "algorithm": agent.config.algorithm.name,
        "peak_rss_mb": peak_rss_mb(),
    }


def model_facts(agent: Any) -> dict[str, Any]:
    policy = agent.policy
    total = sum(p.numel() for p in policy.model.parameters())
    return {
        "name": agent.config.model.name,
        "parameters": total,
        "trainable_parameters": sum(p.numel() for p in policy.trainable_parameters()),
        "lora": bool(policy.uses_adapter),
    }
