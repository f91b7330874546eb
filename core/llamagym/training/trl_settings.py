"""What the TRL backend takes from a run's settings: what carries over to TRL's
``GRPOTrainer`` (:func:`check_supported`, refused before anything loads), the mapping
onto ``GRPOConfig`` (:func:`grpo_args`; ``trl.*`` keys pass through when the installed
TRL has them) and the dataset of environment seeds TRL hands the rollout function."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.training.budget import run_budgets

if TYPE_CHECKING:
    from llamagym.config_layers import ResolvedConfig

INSTALL_HINT = (
    'the TRL backend needs trl: pip install "trl>=1.16,<2" (or from a LlamaGym clone, '
    'pip install "./[trl]")'
)
SEED_PROMPT = "seed="
#: With only a time budget, the dataset holds this many episodes (it is never used up).
UNBOUNDED_EPISODES = 10_000_000


def require_trl() -> None:
    """One line, not a traceback, when trl is missing."""
    if importlib.util.find_spec("trl") is None:
        raise LlamaGymError(INSTALL_HINT)


# -- what carries over ------------------------------------------------------------------
def check_supported(resolved: ResolvedConfig, processes: int = 1) -> None:
    """Refuse, before anything loads or is written, every setting the TRL backend cannot
    honour in a run of ``processes`` processes; each problem is one line naming the
    alternative."""
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
        batch_rule = _batch_rule(algorithm, processes)
        if batch_rule:
            problems.append(batch_rule)
        if micro is not None and minibatch % micro:
            problems.append(
                f"algorithm.microbatch_size={micro}: TRL accumulates whole micro-batches, "
                f"so it must divide algorithm.minibatch_size={minibatch}"
            )
        warm_start = getattr(algorithm, "warm_start", None)
        if warm_start is not None and (warm_start.demonstrations or warm_start.replay):
            problems.append(
                "algorithm.warm_start: supervised warm starts run on the native backend "
                "only; warm-start there and continue with --backend trl from the export"
            )
    problems += _grpo_config_problems(config)
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


# -- the mapping onto GRPOConfig ----------------------------------------------------------
#: GRPOConfig fields the run's other sections set (grpo_args): ``trl.*`` may not set them.
SET_FROM_THE_RUN = {
    "output_dir": "from output.dir", "seed": "from training.seed",
    "use_cpu": "from model.device", "learning_rate": "from algorithm.lr",
    "lr_scheduler_type": "from algorithm.anneal_lr",
    "warmup_steps": "from algorithm.warmup_steps",
    "max_grad_norm": "from algorithm.max_grad_norm",
    "num_generations": "from algorithm.group_size",
    "generation_batch_size": "from algorithm.episodes_per_update",
    "per_device_train_batch_size": "from algorithm.microbatch_size",
    "gradient_accumulation_steps": "from algorithm.minibatch_size",
    "num_iterations": "from algorithm.epochs", "epsilon": "from algorithm.clip_range",
    "beta": "from algorithm.kl_coef", "entropy_coef": "from algorithm.entropy_coef",
    "scale_rewards": "from algorithm.scale_by_std",
    "temperature": "from rollout.temperature",
    "max_completion_length": "from rollout.max_new_tokens", "top_p": "from rollout.top_p",
    "top_k": "from rollout.top_k", "max_steps": "from the training budget",
    "logging_steps": "to one log row per update",
    "save_strategy": "from output.checkpoint_every",
    "save_steps": "from output.checkpoint_every",
    "save_total_limit": "from output.keep_checkpoints",
    "remove_unused_columns": "to False: the rollout reads the dataset's seed column",
    "shuffle_dataset": "to False: seed groups follow the run's seed",
    "disable_tqdm": "to True: the run shows its own progress",
    "dataloader_num_workers": "to 0: the dataset is a list of seeds",
    "trust_remote_code": "from --trust-remote-code (model.trust_remote_code)",
    "model_init_kwargs": "from the model section (model.dtype, model.quantize, ...): the "
    "backend loads the model itself",
    "hub_token": "from the environment (HF_TOKEN), never from a config: config.yaml would "
    "keep it",
}


def _grpo_config_problems(config: RunConfig) -> list[str]:
    """Each ``trl.*`` key that is not a field of the installed TRL's ``GRPOConfig``, or
    is one the run sets from another section, as a line naming what to use instead."""
    from trl import GRPOConfig

    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    allowed = sorted(fields - set(SET_FROM_THE_RUN))
    problems = []
    for key, value in (config.trl.model_extra or {}).items():
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"trl.{key}={value}: not a finite number")
        elif key in SET_FROM_THE_RUN:
            problems.append(f"trl.{key}: the TRL backend sets it {SET_FROM_THE_RUN[key]}")
        elif key == "ds3_gather_for_generation" and not value:
            problems.append(
                "trl.ds3_gather_for_generation=false: the processes play episodes of "
                "different lengths, so ZeRO-3 must gather the parameters for the rollout "
                "(each forward pass would otherwise wait for the other processes' "
                "passes); leave it unset"
            )
        elif key not in fields:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            problems.append(
                f"trl.{key}: not a field of GRPOConfig in the installed TRL; {hint}"
                f"allowed: {', '.join(allowed)}"
            )
    return problems


def _batch_rule(algorithm: Any, processes: int) -> str:
    """The problem with an update's batch under TRL (each process trains minibatch_size
    episodes per step), else ``""``."""
    per_step = algorithm.minibatch_size * processes
    if algorithm.episodes_per_update % per_step == 0:
        return ""
    return (
        f"algorithm.episodes_per_update={algorithm.episodes_per_update} must be a "
        f"multiple of algorithm.minibatch_size x processes = {per_step} under the TRL "
        "backend (each process trains minibatch_size episodes per step)"
    )


def steps_per_update(config: RunConfig, algorithm: Any, world_size: int) -> int:
    """Optimizer steps in one generation batch: episodes_per_update / (minibatch x ranks)."""
    problem = _batch_rule(algorithm, world_size)
    if problem:
        raise ConfigError(problem)
    return algorithm.episodes_per_update // (algorithm.minibatch_size * world_size)


def episode_budget(config: RunConfig) -> int:
    """The episodes TRL's dataset and step count are sized for: the native budget, or,
    with a time budget alone, :data:`UNBOUNDED_EPISODES` (the clock stops the run)."""
    episodes, _ = run_budgets(config.training)
    return UNBOUNDED_EPISODES if episodes is None else episodes


def mixed_precision_bf16(asked: bool | None) -> bool:
    """``GRPOConfig.bf16``: what ``trl.bf16`` asks, else what ``accelerate launch`` was
    told (it passes ``--mixed_precision`` or its config file's ``mixed_precision`` to
    each process as ``ACCELERATE_MIXED_PRECISION``); the two disagreeing is refused."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked is None:
        return launched == "bf16"
    if launched in ("no", "fp16", "bf16", "fp8") and asked != (launched == "bf16"):
        raise ConfigError(
            f"trl.bf16={str(asked).lower()} but accelerate was launched with "
            f"mixed_precision={launched}: drop trl.bf16 (the launcher's setting is taken) "
            "or launch with the mixed precision you want"
        )
    return asked


def grpo_args(resolved: ResolvedConfig, output_dir: Path, world_size: int, use_cpu: bool):
    """TRL's ``GRPOConfig`` from the run's settings: the algorithm section maps onto its
    GRPO fields, ``trl.*`` onto the rest; ``max_steps`` comes from the episode budget."""
    from trl import GRPOConfig

    config, settings = resolved.config, resolved.config.trl
    algorithm: Any = resolved.algorithm  # GRPO's settings (check_supported)
    steps = steps_per_update(config, algorithm, world_size)
    updates = math.ceil(episode_budget(config) / algorithm.episodes_per_update)
    # transformers 5 renamed gradient checkpointing (the old name warns).
    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    renamed: dict[str, Any] = {checkpointing: settings.gradient_checkpointing}
    extra = dict(settings.model_extra or {})
    micro = algorithm.microbatch_size or algorithm.minibatch_size
    arguments: dict[str, Any] = dict(
        output_dir=str(output_dir / "checkpoints"),
        seed=config.training.seed,
        use_cpu=use_cpu,
        bf16=mixed_precision_bf16(settings.bf16),
        learning_rate=algorithm.lr,
        lr_scheduler_type="linear" if algorithm.anneal_lr else "constant",
        warmup_steps=algorithm.warmup_steps,
        max_grad_norm=algorithm.max_grad_norm,
        num_generations=algorithm.group_size,
        generation_batch_size=algorithm.episodes_per_update,
        # A minibatch is one optimizer step, accumulated from micro-batches when set.
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=algorithm.minibatch_size // micro,
        num_iterations=algorithm.epochs,
        epsilon=algorithm.clip_range,
        beta=algorithm.kl_coef,
        entropy_coef=algorithm.entropy_coef,
        scale_rewards="group" if algorithm.scale_by_std else "none",
        temperature=config.rollout.temperature,
        max_completion_length=config.rollout.max_new_tokens,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
        max_steps=updates * steps * algorithm.epochs,
        loss_type=settings.loss_type,
        use_vllm=settings.use_vllm,
        vllm_mode=settings.vllm_mode,
        **renamed,
        logging_steps=steps * algorithm.epochs,  # one log row per update
        save_strategy="steps" if config.output.checkpoint_every else "no",
        save_steps=max(1, config.output.checkpoint_every) * steps * algorithm.epochs,
        save_total_limit=config.output.keep_checkpoints,
        report_to="none",
        disable_tqdm=True,
        shuffle_dataset=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    if "trust_remote_code" in fields:  # TRL's own switch: only the command line's flag
        arguments["trust_remote_code"] = config.model.trust_remote_code
    try:
        return GRPOConfig(**{**arguments, **extra})  # trl.* keys: checked by check_supported
    except (TypeError, ValueError) as error:
        given = ", ".join(f"trl.{key}={value!r}" for key, value in extra.items()) or "none"
        raise ConfigError(
            f"TRL's GRPOConfig refused the run's settings: {error} (trl.* settings given: "
            f"{given})"
        ) from None


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


