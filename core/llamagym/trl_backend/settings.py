"""What the TRL backend takes from a run's settings: what carries over to TRL's
``GRPOTrainer`` (:func:`check_supported`, refused before anything loads or is written)
and the dataset of environment seeds TRL hands the rollout function. The mapping onto
``GRPOConfig`` and the check of every ``trl.*`` value are :mod:`llamagym.resolver.trl_arguments`
(the config resolver runs that check too)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.resolver.trl_arguments import (
    UNBOUNDED_EPISODES,
    batch_rule,
    episode_budget,
    trl_problems,
)

if TYPE_CHECKING:
    from llamagym.resolver.layers import ResolvedConfig

SEED_PROMPT = "seed="


# -- what carries over ------------------------------------------------------------------
def check_supported(resolved: ResolvedConfig, processes: int = 1) -> None:
    """Refuse, before anything loads or is written, every setting the TRL backend cannot
    honour in a run of ``processes`` processes, every ``trl.*`` value included
    (:func:`~llamagym.resolver.trl_arguments.trl_problems`, which the config resolver runs too:
    here it runs again for the number of processes, and for a resumed run's settings);
    each problem is one line naming the alternative."""
    config = resolved.config
    algorithm = resolved.algorithm
    problems = []
    if config.rollout.mode != "generate":
        problems.append(
            "rollout.mode=score: the TRL backend trains generated replies (TRL's loss is "
            "per token); use --mode generate, or the native backend for score mode"
        )
    if config.algorithm.name != "grpo":
        problems.append(
            f"algorithm.name={config.algorithm.name}: the TRL backend runs TRL's GRPO "
            "(no value head, so no PPO); use --algorithm grpo, or the native backend for "
            f"{config.algorithm.name}"
        )
    else:
        credit = getattr(algorithm, "credit", "discounted")
        gamma = getattr(algorithm, "gamma", 1.0)
        if credit != "discounted" or gamma != 1.0:
            problems.append(
                f"algorithm.credit={credit}, gamma={gamma:g}: under TRL every token of an "
                "episode is credited with the episode's return; use algorithm.credit="
                "discounted with algorithm.gamma=1, or the native backend"
            )
        for key, fix in (
            ("target_kl", "TRL has no target-KL stop; use algorithm.kl_coef"),
            ("adaptive_kl_target", "TRL's KL weight is fixed; set algorithm.kl_coef"),
        ):
            if getattr(algorithm, key, None) is not None:
                problems.append(f"algorithm.{key}: {fix}, or the native backend")
        micro = getattr(algorithm, "microbatch_size", None)
        minibatch = getattr(algorithm, "minibatch_size", 1)
        batch_problem = batch_rule(algorithm, processes)
        if batch_problem:
            problems.append(batch_problem)
        if micro is not None and minibatch % micro:
            problems.append(
                f"algorithm.microbatch_size={micro}: TRL accumulates whole micro-batches, "
                f"so it must divide algorithm.minibatch_size={minibatch}"
            )
        warm_start = getattr(algorithm, "warm_start", None)
        if warm_start is not None and (
            warm_start.demonstrations or warm_start.replay or getattr(warm_start, "baseline", None)
        ):
            problems.append(
                "algorithm.warm_start: supervised warm starts (demonstrations, a baseline's "
                "with --warm-start, replay) run on the native backend only; warm-start there "
                "and continue with --backend trl from the export"
            )
    problems += trl_problems(config, algorithm, processes)
    if config.trl.use_vllm and config.trl.vllm_mode == "server" and processes > 1:
        problems.append(
            "trl.vllm_mode=server: a vLLM server takes every process's prompts in "
            "lockstep, which turn-by-turn multi-turn rollouts cannot keep; use "
            "trl.vllm_mode=colocate (a vLLM engine in each process)"
        )
    if config.rollout.history_turns is not None:
        problems.append(
            "rollout.history_turns: an episode is trained as one growing sequence, so no "
            "turn can be dropped from the prompt; leave rollout.history_turns unset"
        )
    if config.rollout.final_temperature is not None:
        problems.append(
            "rollout.final_temperature: TRL scores replies at one temperature; leave "
            "rollout.final_temperature unset"
        )
    if config.rollout.invalid_action.policy == "reprompt":
        problems.append(
            "rollout.invalid_action.policy=reprompt: a re-prompt rewrites the episode's "
            "sequence; use fallback, random or end_episode with the TRL backend"
        )
    if problems:
        raise ConfigError("\n".join(problems))


def seed_dataset(config: RunConfig, group_size: int):
    """One row per seed group: ``prompt`` names the seed, ``seed`` holds it."""
    from datasets import Dataset

    groups = math.ceil(episode_budget(config) / group_size)
    if config.training.episodes is None:
        groups = min(groups, UNBOUNDED_EPISODES // group_size)
    seeds = np.random.default_rng(config.training.seed).integers(0, 2**31 - 1, size=groups)
    return Dataset.from_dict(
        {"prompt": [f"{SEED_PROMPT}{int(s)}" for s in seeds], "seed": [int(s) for s in seeds]}
    )


def seed_of(prompt: Any) -> int:
    text = prompt if isinstance(prompt, str) else str(prompt)
    if not text.startswith(SEED_PROMPT):
        raise LlamaGymError(f"a TRL dataset row that names no seed: {text[:60]!r}")
    return int(text[len(SEED_PROMPT) :])


