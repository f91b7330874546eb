"""A run: what one training run is made of, built in one place (the composition root).

A :class:`~llamagym.task.Task` describes a task (env, prompts, legal actions, parsing,
defaults, baselines, its options). A run adds the machinery: the policy (model, tokenizer,
value head), the rollout engine, the algorithm and the schedule they read. Everything
here is built by :func:`build_run` from a resolved config, each part getting what it needs
as constructor arguments; nothing is assigned into a part after it is built.

    resolved = resolve_agent_config(AgentClass, [("--set", {...})])   # resolver/layers.py
    agent = AgentClass(config=resolved)
    run = build_run(agent, load_policy(resolved.config), control)      # what Trainer does
    trained = read_trained("runs/blackjack-.../")                      # what load_agent reads

The classic ``act`` / ``assign_reward`` / ``terminate_episode`` API (an agent's session),
the CLI and ``load_agent`` all build through these functions: one code path. What runs
below (the trainer, the evaluation, the export) is handed the parts it needs.

Top level: the composition root is a floor of its own, above every part it builds
and below the session and the CLI that ask for a run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors.torch import load_file

from llamagym import distributed
from llamagym import moved_name as _moved_name
from llamagym.algorithms.algorithm import AlgorithmContext
from llamagym.algorithms.algorithm_config import with_demonstrations
from llamagym.config import RunConfig, check_generation_memory, deep_merge
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.models.loading import add_lora_adapter, load_model_and_tokenizer
from llamagym.models.lora_choice import LORA_AUTO_THRESHOLD, trains_through_lora
from llamagym.models.policy import Policy
from llamagym.models.trunk_precision import lower_trunk_precision
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.resolver.layers import ResolvedConfig, resolve_agent_config
from llamagym.schedule import Control, Schedule
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.checkpoint.trust import check_model_source, untrusted_config
from llamagym.training.loop import run_state  # a run's parts: their types are the loop's
from llamagym.training.records.export import RUN_EXPORT, VALUE_HEAD, read_export_meta

if TYPE_CHECKING:
    from llamagym.algorithms.algorithm import Algorithm
    from llamagym.algorithms.algorithm_config import AlgorithmConfig
    from llamagym.plugin_runtime.manager import Plugins
    from llamagym.task import Task

logger = logging.getLogger(__name__)


def load_policy(
    config: RunConfig, model: Any = None, tokenizer: Any = None, device: Any = None
) -> Policy:
    """The policy of a run: ``model`` (an object, or a name/directory) or the configured
    model, loaded with its tokenizer; LoRA by the loader's rule. Sets torch's CPU
    threads (``training.threads``; one for a small model on the CPU)."""
    settings = config.model
    if model is None or isinstance(model, str):
        where, device = device, None  # the loader places the model; the policy follows it
        model, tokenizer = load_model_and_tokenizer(
            model or settings.name,
            device=str(where) if where else settings.device,
            dtype=None if settings.dtype == "auto" else settings.dtype,
            quantize=settings.quantize,
            lora=settings.lora,
            lora_rank=settings.lora_rank,
            lora_layers=settings.lora_layers,
            trust_remote_code=settings.trust_remote_code,
            seed=config.training.seed,
        )
    elif tokenizer is None:
        raise ConfigError("a model object was given without its tokenizer")
    else:
        # A value-head wrapper (the original LlamaGym's) gives its LM: the policy has its
        # own head. A model object follows the loader's LoRA rule (``model.lora``), so a
        # pretrained model is not fully fine-tuned by accident; one carrying an adapter
        # already is used as it is.
        model = getattr(model, "pretrained_model", model)
        if not hasattr(model, "peft_config") and trains_through_lora(model, settings.lora):
            logger.info("adding a LoRA adapter to the given model (model.lora=false: train "
                        "it whole)")
            model = add_lora_adapter(
                model, type(model).__name__, None, settings.lora_rank,
                config.training.seed, layers=settings.lora_layers,
            )
    checkpointing = settings.gradient_checkpointing
    if checkpointing is None:
        # Replies make long rows whose activations dominate an update's memory;
        # score-mode rows are short, so recomputing them would only cost time.
        checkpointing = config.rollout.mode == "generate" and hasattr(model, "peft_config")
    if config.rollout.mode == "generate":  # generate keeps every step's logits
        vocabulary = getattr(model.config, "vocab_size", None) or len(tokenizer)
        check_generation_memory(
            config.rollout.num_envs, config.rollout.max_new_tokens, int(vocabulary)
        )
    policy = Policy(model, tokenizer, device, gradient_checkpointing=checkpointing)
    lower_trunk_precision(policy.model, settings.trunk_dtype, policy.device)
    _choose_threads(policy, config.training.threads)
    return policy


def _choose_threads(policy: Policy, threads: int | None) -> None:
    """One thread for a model below the LoRA threshold on the CPU: its matrices are too
    small to split (two threads were slower than one here)."""
    if threads is not None:
        torch.set_num_threads(threads)
    elif policy.device.type == "cpu" and (
        sum(p.numel() for p in policy.model.parameters()) < LORA_AUTO_THRESHOLD
    ):
        torch.set_num_threads(1)


def build_run(
    agent: Task,
    policy: Policy,
    control: Control | None = None,
    demonstrations: Path | None = None,
) -> run_state.Run:
    """Policy -> schedule -> engine -> algorithm, from ``agent.resolved``. ``control``
    carries the trainer's stop request and epoch display into the algorithm; without it
    (the classic API) an update never stops early. ``demonstrations`` is the file a
    training run recorded from the baseline its config names
    (``algorithm.warm_start.baseline``): the algorithm is built with it as its
    ``algorithm.warm_start.demonstrations``.

    Then the two phases before the first update: the algorithm's warm start
    (demonstrations, if configured) and freezing its KL reference on the final starting
    weights. A resumed run goes through them too, before its checkpoint is loaded over
    them, so its KL reference is the one the unbroken run had."""
    resolved, config = agent.resolved, agent.config
    if resolved.algorithm_class is None or resolved.algorithm is None:
        raise LlamaGymError(f"agent {agent.name!r}: the config names no algorithm")
    schedule = Schedule(config.rollout)
    engine = run_state.make_engine(agent, policy, config, schedule)
    # The registry holds Algorithm subclasses, and their Config validated the section
    # (the resolver, a layer below, reads only the Config).
    algorithm_class = cast("type[Algorithm]", resolved.algorithm_class)
    settings = cast("AlgorithmConfig", resolved.algorithm)
    if demonstrations is not None:
        settings = with_demonstrations(settings, demonstrations)
    algorithm = algorithm_class(AlgorithmContext(
        policy,
        settings,
        config.rollout,
        schedule,
        distributed.process_group(),
        control if control is not None else Control(),
    ))
    warm_start = algorithm.warm_start()
    if warm_start:
        logger.info("warm start: %s", ", ".join(f"{k} {v:.4g}" for k, v in warm_start.items()))
    algorithm.freeze_reference()
    return run_state.Run(agent, config, policy, engine, algorithm, schedule)


@dataclass(frozen=True)
class Trained:
    """A trained agent's checkpoint or export, read and checked: what
    :func:`llamagym.agent.load_agent` builds the agent from."""

    #: the agent class from the registry (a plugin's :class:`~llamagym.Agent` subclass)
    agent_class: Any
    resolved: ResolvedConfig
    directory: Path
    meta: dict[str, Any]
    #: an export's ``weights`` ("adapter", ...); None: a checkpoint
    exported: str | None


def read_trained(
    path: Path | str,
    *,
    overrides: Mapping[str, Any] | None = None,
    agent: str | None = None,
    plugins: Plugins | None = None,
    trust_remote_code: bool = False,
) -> Trained:
    """The checkpoint or export at ``path`` (a run directory: its newest intact
    checkpoint), its agent class and its config with ``overrides`` over it; ``agent``
    checks the checkpoint's agent name. The checkpoint's ``model.trust_remote_code`` is
    never used: only ``trust_remote_code=True`` (or an override) turns it on."""
    plugins = plugins or get_plugins()
    path = Path(path)
    if read_export_meta(path) is None and read_export_meta(path / RUN_EXPORT) is not None:
        path = path / RUN_EXPORT  # a TRL-backend run: its trained model
    exported = read_export_meta(path) if path.is_dir() else None
    if exported is not None:
        # An exported directory (`llamagym export`): its config, and its model files.
        directory, meta = Path(path), {"agent": exported["agent"], "config": exported["config"]}
    else:
        directory = checkpoints.find_checkpoint(Path(path))
        meta = checkpoints.read_meta(directory)
    trained = meta.get("agent")
    if agent is not None and trained != agent:
        raise LlamaGymError(
            f"checkpoint {str(directory)!r} was trained with agent.name = {trained!r}, "
            f"not {agent!r}"
        )
    if checkpoints.is_newer_format(meta):
        logger.warning(
            "checkpoint %s was written in checkpoint format %s (llamagym %s); this llamagym "
            "reads format %d: only its config and weights are used",
            directory,
            meta["format"],
            meta.get("llamagym_version", "?"),
            checkpoints.FORMAT_VERSION,
        )
    agent_class = plugins.registry.get("agent", str(trained)).load()
    layer: dict[str, Any] = {"output": {"dir": None}}
    if exported is not None and exported["weights"] != "adapter":
        # The whole model is in the directory: load it as it is, without a new adapter.
        layer["model"] = {"name": str(directory), "lora": False}
    layer = deep_merge(layer, dict(overrides or {}))
    if trust_remote_code:
        layer = deep_merge(layer, {"model": {"trust_remote_code": True}})
    base = untrusted_config(meta)
    resolved = resolve_agent_config(
        agent_class, [("overrides", layer)], base=base, plugins=plugins
    )
    model = resolved.config.model
    check_model_source(meta, model.name, model.trust_remote_code, directory)
    return Trained(
        agent_class, resolved, directory, meta,
        None if exported is None else str(exported["weights"]),
    )


def load_trained_weights(policy: Policy, trained: Trained) -> None:
    """The trained weights of ``trained`` into ``policy`` (loaded from its config)."""
    if trained.exported is not None:
        _load_exported_weights(policy, trained.directory, trained.exported)
    else:
        checkpoints.load_checkpoint(policy, trained.directory)


def _load_exported_weights(policy: Policy, directory: Path, weights: str) -> None:
    """The value head of an export, and its LoRA adapter when the export holds one (the
    whole model was already loaded from the directory otherwise)."""
    if weights == "adapter":
        # peft takes seconds to import; a run that trains every weight never needs it.
        from peft import set_peft_model_state_dict

        adapter = load_file(str(directory / "adapter_model.safetensors"))
        result = set_peft_model_state_dict(policy.model, adapter)
        unexpected = list(getattr(result, "unexpected_keys", []) or [])
        if unexpected:
            raise LlamaGymError(
                f"the adapter in {str(directory)!r} does not fit this model (e.g. "
                f"{unexpected[0]!r}); it was exported from another model or LoRA setting"
            )
    policy.value_head.load_state_dict(load_file(str(directory / VALUE_HEAD)))


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
