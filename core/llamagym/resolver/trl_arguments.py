"""TRL's ``GRPOConfig`` from a run's settings (:func:`grpo_args`), and every ``trl.*``
value checked before anything is written (:func:`trl_problems`, which the config
resolver runs for the TRL backend, so ``llamagym config show`` and ``llamagym run``
refuse the same settings).

``trl.*`` keys pass through to the installed TRL's ``GRPOConfig``; a value is data, so
it is checked the way TRL and transformers would check it later, before a run writes a
file: its field's type, TRL's own validation (``GRPOConfig`` built from the whole run),
the optimizer and learning-rate schedule built from it, and what this machine can
honour (an integration not installed, the Hub switched off, a setting the backend sets
up another way). Each problem is one line naming the setting.

torch, transformers and trl are imported only inside the functions that need them: the
config resolver imports this module, and a native run never does.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, TypeAdapter, ValidationError

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.schedule import run_budgets

INSTALL_HINT = (
    'the TRL backend needs trl: pip install "trl>=1.16,<2" (or from a LlamaGym clone, '
    'pip install "./[trl]")'
)
#: With only a time budget, the dataset holds this many episodes (it is never used up).
UNBOUNDED_EPISODES = 10_000_000


class RunSettingsRefused(ConfigError):
    """GRPOConfig refused what the run's own sections set, with no ``trl.*`` value to
    blame (:func:`check_supported <llamagym.trl_backend.settings.check_supported>`
    names the setting to change)."""


def require_trl() -> None:
    """One line, not a traceback, when trl is missing."""
    if importlib.util.find_spec("trl") is None:
        raise LlamaGymError(INSTALL_HINT)


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
    "reward_weights": "to one reward function: the episode's return",
}

_DEEPSPEED = (
    "DeepSpeed is set up by the launcher: accelerate launch --config_file "
    "docs/accelerate/zero2.yaml (or zero3.yaml), see docs/laptop-to-cluster.md; drop it"
)
_FSDP = (
    "FSDP is set up by the launcher: accelerate launch --config_file "
    "docs/accelerate/fsdp2.yaml, see docs/laptop-to-cluster.md; drop it"
)
_COMPILE = "the rollout runs the model's forward passes itself, uncompiled; drop it"
_EVALUATION = (
    "the run evaluates the trained agent itself (training.eval_episodes); TRL is given "
    "no evaluation dataset, so leave it unset"
)
#: Settings the TRL backend does not take from ``trl.*``, whatever this machine has,
#: when they are on (anything but unset, false, "no" or empty).
NOT_FROM_TRL_SETTINGS = {
    "deepspeed": _DEEPSPEED, "fsdp": _FSDP, "fsdp_config": _FSDP,
    "torch_compile": _COMPILE, "torch_compile_backend": _COMPILE,
    "torch_compile_mode": _COMPILE,
    "eval_strategy": _EVALUATION, "do_eval": _EVALUATION, "load_best_model_at_end": _EVALUATION,
    "resume_from_checkpoint": "a run resumes with llamagym run --resume RUN_OR_CHECKPOINT; "
    "drop it",
}
#: The settings TRL's optimizer and learning-rate schedule are built from.
OPTIMIZER_SETTINGS = (
    "optim", "optim_args", "optim_target_modules", "adam_beta1", "adam_beta2",
    "adam_epsilon", "weight_decay", "lr_scheduler_kwargs",
)


# -- each value on its own --------------------------------------------------------------
def _non_finite(value: Any, path: str) -> str | None:
    """The dotted path of the first NaN or infinity anywhere in ``value``, else None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{path}={value}"
    if isinstance(value, Mapping):
        items: Any = ((f"{path}.{key}", item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    return next((found for p, v in items if (found := _non_finite(v, p)) is not None), None)


def _is_on(value: Any) -> bool:
    return value not in (None, False, "", "no", "none") and value != [] and value != {}


def _field_types() -> dict[str, Any]:
    """Each GRPOConfig field and its declared type (None: left to TRL)."""
    from trl import GRPOConfig

    try:
        hints = typing.get_type_hints(GRPOConfig)
    except Exception:  # noqa: BLE001 - a type this Python cannot read is left unchecked
        hints = {}
    return {field.name: hints.get(field.name) for field in dataclasses.fields(GRPOConfig)}


def _typed(key: str, value: Any, declared: Any) -> Any:
    """``value`` as GRPOConfig's field ``key`` declares it (``"1e308"`` -> 1e308), or a
    ConfigError naming the setting and the type."""
    if declared is None:
        return value
    try:
        adapter: TypeAdapter[Any] = TypeAdapter(
            declared, config=ConfigDict(arbitrary_types_allowed=True, allow_inf_nan=False)
        )
    except Exception:  # noqa: BLE001 - a type pydantic cannot express is left to TRL
        return value
    try:
        return adapter.validate_python(value)
    except ValidationError:
        shown = getattr(declared, "__name__", None) or str(declared).replace("typing.", "")
        raise ConfigError(
            f"trl.{key}={value!r}: GRPOConfig.{key} takes {shown}"
        ) from None


def _setting_problem(key: str, value: Any, fields: Mapping[str, Any]) -> str | None:
    """What is wrong with ``trl.KEY=VALUE`` on its own, as one line, else None."""
    found = _non_finite(value, f"trl.{key}")
    if found is not None:
        return f"{found}: not a finite number"
    if key in SET_FROM_THE_RUN:
        return f"trl.{key}: the TRL backend sets it {SET_FROM_THE_RUN[key]}"
    if key not in fields:
        allowed = sorted(set(fields) - set(SET_FROM_THE_RUN))
        close = difflib.get_close_matches(key, allowed, n=3, cutoff=0.6)
        hint = (
            f"did you mean {', '.join(close)}?" if close
            else "see GRPOConfig in TRL's documentation for its fields"
        )
        return f"trl.{key}: not a field of GRPOConfig in the installed TRL; {hint}"
    if key in NOT_FROM_TRL_SETTINGS and _is_on(value):
        return f"trl.{key}={value!r}: {NOT_FROM_TRL_SETTINGS[key]}"
    if key == "ds3_gather_for_generation" and not value:
        return (
            "trl.ds3_gather_for_generation=false: the processes play episodes of "
            "different lengths, so ZeRO-3 must gather the parameters for the rollout "
            "(each forward pass would otherwise wait for the other processes' "
            "passes); leave it unset"
        )
    try:
        _typed(key, value, fields[key])
    except ConfigError as error:
        return str(error)
    return None


def _machine_problems(settings: Mapping[str, Any]) -> list[str]:
    """The ``trl.*`` settings (declared and passed through) this machine cannot honour."""
    problems = []
    if settings.get("use_vllm") and importlib.util.find_spec("vllm") is None:
        problems.append(
            "trl.use_vllm=true: vLLM is not installed here (pip install vllm, on a machine "
            "with GPUs); leave trl.use_vllm unset"
        )
    if settings.get("use_liger_kernel") and importlib.util.find_spec("liger_kernel") is None:
        problems.append(
            "trl.use_liger_kernel=true: liger-kernel is not installed here (pip install "
            "liger-kernel); leave it unset"
        )
    if settings.get("push_to_hub") is True:
        unreachable = _hub_unreachable()
        if unreachable:
            problems.append(
                f"trl.push_to_hub=true: {unreachable}; drop it, and upload RUN/model "
                "yourself where the Hub is reachable"
            )
    report_to = settings.get("report_to")
    if report_to is not None:
        problems += _reporting_problems(report_to)
    return problems


def _hub_unreachable() -> str:
    """Why an upload to the Hugging Face Hub cannot happen from here, else ``""``."""
    from llamagym.models.sources import hub_offline

    if hub_offline():
        return "the Hugging Face Hub is switched off here (HF_HUB_OFFLINE)"
    from huggingface_hub import get_token

    if get_token() is None:
        return "no Hugging Face token is set here (hf auth login, or HF_TOKEN)"
    return ""


def _reporting_problems(report_to: Any) -> list[str]:
    from transformers.integrations import get_available_reporting_integrations

    names = [report_to] if isinstance(report_to, str) else list(report_to)
    available = set(get_available_reporting_integrations())
    missing = [name for name in names if name not in ("none", "all") and name not in available]
    if not missing:
        return []
    return [
        f"trl.report_to={report_to!r}: {', '.join(missing)} not installed here (installed: "
        f"{', '.join(sorted(available)) or 'none'}); the run logs through output.loggers "
        "(tensorboard, wandb) too"
    ]


# -- the whole run: GRPOConfig, the optimizer --------------------------------------------
def trl_problems(config: RunConfig, algorithm: Any, processes: int = 1) -> list[str]:
    """Every ``trl.*`` value checked before anything is written, one line per problem:
    each on its own (a field of the installed TRL's ``GRPOConfig``, not one the run sets,
    finite anywhere in it, of its field's type, not a setting the backend takes another
    way), what this machine can honour, then TRL's own validation of the whole run's
    ``GRPOConfig`` and the optimizer and schedule built from it."""
    require_trl()
    fields = _field_types()
    given = dict(config.trl.model_extra or {})
    problems = [
        problem for key, value in given.items()
        if (problem := _setting_problem(key, value, fields)) is not None
    ]
    problems += _machine_problems({**config.trl.model_dump(), **given})
    if problems or not hasattr(algorithm, "group_size") or batch_rule(algorithm, processes):
        return problems  # what check_supported refuses is left to it
    from llamagym.models.loading import resolve_device

    use_cpu = resolve_device(config.model.device).startswith("cpu")
    try:
        args = grpo_args(config, algorithm, Path(config.output.dir or "."), processes, use_cpu)
    except RunSettingsRefused:
        return []  # the run's sections, not trl.*: check_supported says which
    except ConfigError as error:
        return [str(error)]
    return _optimizer_problems(args, given, use_cpu)


def _optimizer_problems(args: Any, given: Mapping[str, Any], use_cpu: bool) -> list[str]:
    """TRL's optimizer and learning-rate schedule, built as transformers' Trainer builds
    them, over one parameter: a value they refuse is a line naming the settings."""
    import torch
    from transformers import Trainer, get_scheduler

    device = "cpu" if use_cpu or not torch.cuda.is_available() else "cuda"
    try:
        optimizer_class, keywords = Trainer.get_optimizer_cls_and_kwargs(args)
        optimizer = optimizer_class([torch.nn.Parameter(torch.zeros(1, device=device))], **keywords)
        get_scheduler(
            args.lr_scheduler_type,
            optimizer=optimizer,
            num_warmup_steps=args.get_warmup_steps(args.max_steps),
            num_training_steps=args.max_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )
    except Exception as error:  # noqa: BLE001 - whatever they raise, the run cannot start
        named = [f"trl.{k}={given[k]!r}" for k in OPTIMIZER_SETTINGS if k in given]
        which = "it" if len(named) == 1 else "them"
        return [
            f"{', '.join(named) or 'the optimizer settings'}: TRL's optimizer refused "
            f"{which}: {_first_line(error)}"
        ]
    return []


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def batch_rule(algorithm: Any, processes: int) -> str:
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


def steps_per_update(algorithm: Any, world_size: int) -> int:
    """Optimizer steps in one generation batch: episodes_per_update / (minibatch x ranks)."""
    problem = batch_rule(algorithm, world_size)
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


def _run_arguments(
    config: RunConfig, algorithm: Any, output_dir: Path, world_size: int, use_cpu: bool
) -> dict[str, Any]:
    """GRPOConfig's arguments that the run's own sections set (:data:`SET_FROM_THE_RUN`)."""
    settings = config.trl
    steps = steps_per_update(algorithm, world_size)
    updates = math.ceil(episode_budget(config) / algorithm.episodes_per_update)
    micro = algorithm.microbatch_size or algorithm.minibatch_size
    return dict(
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


def grpo_args(
    config: RunConfig, algorithm: Any, output_dir: Path, world_size: int, use_cpu: bool
) -> Any:
    """TRL's ``GRPOConfig`` from the run's settings: the algorithm section (GRPO's
    settings) maps onto its GRPO fields, ``trl.*`` onto the rest, each value as its
    field's type; ``max_steps`` comes from the episode budget. What GRPOConfig refuses
    is one ConfigError line naming the ``trl.*`` setting it refused."""
    from trl import GRPOConfig

    arguments = _run_arguments(config, algorithm, output_dir, world_size, use_cpu)
    fields = _field_types()
    # transformers 5 renamed gradient checkpointing (the old name warns).
    checkpointing = (
        "activation_checkpointing" if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    arguments[checkpointing] = config.trl.gradient_checkpointing
    if "trust_remote_code" in fields:  # TRL's own switch: only the command line's flag
        arguments["trust_remote_code"] = config.model.trust_remote_code
    extra = {
        key: _typed(key, value, fields.get(key))
        for key, value in (config.trl.model_extra or {}).items()
    }
    try:
        return GRPOConfig(**{**arguments, **extra})
    except (TypeError, ValueError) as error:
        raise _refused(GRPOConfig, arguments, extra, error) from None


def _refused(
    grpo_config: Any, arguments: dict[str, Any], extra: dict[str, Any], error: Exception
) -> ConfigError:
    """GRPOConfig's refusal as one line naming the ``trl.*`` setting that caused it: the
    first that GRPOConfig refuses on its own, else all of them; or, when it refuses the
    run's settings without any, a :class:`RunSettingsRefused`."""
    reason = _first_line(error)
    try:
        grpo_config(**arguments)
    except (TypeError, ValueError):
        return RunSettingsRefused(f"TRL's GRPOConfig refused the run's settings: {reason}")
    culprits = list(extra)
    for key, value in extra.items():
        try:
            grpo_config(**{**arguments, key: value})
        except (TypeError, ValueError):
            culprits = [key]
            break
    named = ", ".join(f"trl.{key}={extra[key]!r}" for key in culprits)
    return ConfigError(
        f"{named}: TRL's GRPOConfig refused {'it' if len(culprits) == 1 else 'them'}: {reason}"
    )
