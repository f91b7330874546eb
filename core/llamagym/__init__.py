"""LlamaGym: fine-tune LLM agents with online reinforcement learning in Gymnasium envs.

``from llamagym import Agent`` is all the classic API needs. Heavy modules (torch,
transformers) load only when something that needs them is touched, so the CLI starts
fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
from typing import Any

from llamagym.hookspecs import hookimpl

__version__ = "0.4.0"


_LAZY = {
    "Agent": "llamagym.agent",
    "Algorithm": "llamagym.algorithms.algorithm",
    "AlgorithmConfig": "llamagym.algorithms.algorithm_config",
    "RunConfig": "llamagym.config",
    "Episode": "llamagym.rollout.trajectory",
    "Turn": "llamagym.rollout.trajectory",
    "Policy": "llamagym.models.policy",
    "load_model_and_tokenizer": "llamagym.models.loading",
    "load_agent": "llamagym.agent",
    "build_run": "llamagym.run",
    "RunContext": "llamagym.specs",
    "get_plugins": "llamagym.plugin_manager",
    "LlamaGymError": "llamagym.errors",
}

__all__ = ["hookimpl", "__version__", *_LAZY]

#: Modules that moved since LlamaGym 0.2's flat layout. Importing one by its old name
#: fails with one line naming the new one; the names of ``llamagym`` itself (``Agent``,
#: ``Algorithm``, ``Episode``, ...) did not move.
MOVED_MODULES = {
    "llamagym.models": "llamagym.models.loading",
    "llamagym.model_registry": "llamagym.models.registry",
    "llamagym.model_sources": "llamagym.models.sources",
    "llamagym.tiny_model": "llamagym.models.tiny",
    "llamagym.policy": "llamagym.models.policy",
    "llamagym.engine": "llamagym.rollout.engine",
    "llamagym.evaluation": "llamagym.rollout.evaluation",
    "llamagym.demonstrations": "llamagym.rollout.demonstrations",
    "llamagym.trajectory": "llamagym.rollout.trajectory",
    "llamagym.training": "llamagym.training.loop.trainer",
    "llamagym.algorithm": "llamagym.algorithms.algorithm",
    "llamagym.checkpoint": "llamagym.training.checkpoint.store",
    "llamagym.credit": "llamagym.algorithms.credit",
    "llamagym.progress": "llamagym.training.loop.progress",
    "llamagym.report": "llamagym.training.records.report",
    "llamagym.scaffold": "llamagym.devtools.scaffold",
    "llamagym.conformance": "llamagym.devtools.conformance",
    # 0.3: moved to the layer that uses them (docs/architecture.md, "Layers").
    "llamagym.training.schedule": "llamagym.schedule",
    "llamagym.rollout.transcripts": "llamagym.training.records.transcripts",
    "llamagym.models.export": "llamagym.training.records.export",
    # 0.4: the built-in plugins are a package of their own (plugins/llamagym_builtins), so
    # `llamagym.plugins.ppo` fails at its first step, naming where `ppo` is now.
    "llamagym.plugins": "llamagym_builtins",
    # 0.4: what every algorithm builds on is a floor of its own, below training.
    **{f"llamagym.training.{name}": f"llamagym.algorithms.{name}" for name in (
        "algorithm", "algorithm_config", "batching", "credit", "kl_control", "losses",
        "turn_scoring",
    )},
    # 0.4: several processes serve the algorithms, the training loop and the TRL backend,
    # so they sit below all three.
    "llamagym.training.distributed": "llamagym.distributed",
    # 0.4: training's rooms (the loop, checkpoints, run records), and the TRL backend a
    # floor of its own above training.
    **{f"llamagym.training.{name}": f"llamagym.training.loop.{name}" for name in (
        "trainer", "budget", "progress", "final_evaluation", "run_start", "run_state",
        "run_directory", "update_metrics",
    )},
    **{f"llamagym.training.{name}": f"llamagym.training.records.{name}" for name in (
        "report", "transcripts", "run_files", "run_lock", "export",
    )},
    "llamagym.training.checkpoint": "llamagym.training.checkpoint.store",
    **{f"llamagym.training.checkpoint_{name}": f"llamagym.training.checkpoint.{name}"
       for name in ("errors", "state", "tensors", "trust")},
    "llamagym.training.trl_backend": "llamagym.trl_backend.trainer",
    "llamagym.training.trl_rollout": "llamagym.trl_backend.rollout",
    "llamagym.training.trl_settings": "llamagym.trl_backend.settings",
    "llamagym.training.sharded": "llamagym.trl_backend.sharded",
}


#: Names that a module offered in LlamaGym 0.3.0 but that another module defines now:
#: old module -> the module to import them from -> the names. A module holds only the
#: names it defines (its ``__all__`` lists just those), so importing one of these from
#: the old module fails with one line naming the new one (:func:`moved_name`).
MOVED_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "llamagym.config": {
        "llamagym.config_layers": (
            "AlgorithmClass", "Layer", "ResolvedConfig", "agent_config_class",
            "config_descriptions", "format_validation_error", "leaf_keys",
            "model_descriptions", "render_config_yaml", "resolve_config",
        ),
    },
    "llamagym.agent": {"llamagym.task": ("Baseline",)},
    "llamagym.run": {
        "llamagym.config_layers": ("defaults_for_model", "run_layers"),
        "llamagym.agent": ("load_agent",),
        "llamagym.training.loop.run_state": ("make_engine",),
    },
    "llamagym.session": {"llamagym.algorithms.algorithm": ("Algorithm",)},
    "llamagym.plugin_manager": {
        "llamagym.plugin_isolation": ("DEFAULT_TIMEOUT_SECONDS", "TIMEOUT_VARIABLE"),
    },
    "llamagym.testing": {
        "llamagym.devtools.fake_model": (
            "FakePolicy", "ScriptExhaustedError", "TurnBudgetExceededError",
        ),
    },
    "llamagym.devtools.conformance": {"llamagym.testing": ("assert_agent_conforms",)},
    "llamagym.models.loading": {
        "llamagym.models.lora_choice": ("LORA_AUTO_THRESHOLD", "trains_through_lora"),
    },
    "llamagym.models.policy": {
        "llamagym.models.passes": ("MIN_SHARED_TOKENS", "padded", "prefix_rows"),
        "llamagym.models.generation": ("JsonClosed", "closes_json", "json_closed_at"),
    },
    "llamagym.models.sources": {
        "llamagym.models.gguf_conversion": (
            "CHECK_SAMPLE", "GGUF_SUFFIX", "conversion_damage", "dtype_keyword",
            "gguf_digest", "prepare_gguf", "save_model_files", "single_gguf_in",
        ),
    },
    "llamagym.rollout.engine": {
        "llamagym.rollout.prompts": ("PROMPT_CACHE_TOKENS", "fill_reply_prefix", "reply_closing"),
    },
    # What 0.3's llamagym.training.algorithm offered, asked of the module's new place.
    "llamagym.algorithms.algorithm": {
        "llamagym.algorithms.algorithm_config": (
            "check_adaptive_kl", "check_group_divides_batch", "microbatch_size_field",
            "nest_warm_start_keys", "warmup_steps_field",
        ),
        "llamagym.algorithms.batching": ("seed_groups",),
    },
    "llamagym.training.checkpoint": {
        "llamagym.training.checkpoint.errors": ("CheckpointMismatchError", "UntrustedModelError"),
        "llamagym.training.checkpoint.trust": ("check_model_source", "untrusted_config"),
    },
    # What 0.3's llamagym.training.trainer offered, asked of the module's new place.
    "llamagym.training.loop.trainer": {
        "llamagym.training.loop.final_evaluation": ("evaluate_with_baselines",),
        "llamagym.training.loop.update_metrics": ("SANE_UPDATE_KL",),
    },
}


def moved_name(module: str, name: str) -> Any:
    """``__getattr__`` of a module that lost names (:data:`MOVED_NAMES`), and of the
    packages that took an old module's name (``models``, ``training``): ``from
    llamagym.training.algorithm import seed_groups`` fails with one line naming the module
    that defines it now; any other missing name is an AttributeError."""
    new = next((new for new, names in MOVED_NAMES.get(module, {}).items() if name in names),
               None)
    if new is None and module in MOVED_MODULES and _in_moved_module(module, name):
        new = MOVED_MODULES[module]
    if new is not None:
        raise ImportError(f"{name} is not in {module}; import it from {new}", name=module)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def _in_moved_module(package: str, name: str) -> bool:
    """Whether ``name`` is in the module that moved out of ``package``'s name."""
    return (
        not name.startswith("_")
        and importlib.util.find_spec(f"{package}.{name}") is None  # not a submodule
        and hasattr(importlib.import_module(MOVED_MODULES[package]), name)
    )


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        new = MOVED_MODULES.get(fullname)
        if new is not None and not new.startswith(fullname + "."):
            raise ImportError(f"{fullname} is now {new}: import it from there", name=fullname)
        return None


sys.meta_path.append(_MovedModuleFinder())


# No code from the Hub at import. On a CPU with avx512_bf16, bitsandbytes's CPU backend asks
# the optional `kernels` package (a dependency of transformers since 5.25) for a compiled
# 4-bit matmul from the Hub as it is imported, which peft does whenever bitsandbytes is
# installed: a network call on every run, a warning on stderr when the Hub is offline,
# and a binary fetched and loaded unasked. That one module is imported with `kernels` out
# of reach, so bitsandbytes keeps its own CPU code, as where `kernels` is not installed,
# and the notice it then logs is dropped (the loader speaks of a quantized model's speed).
_NO_MODULE = object()


class _WithoutKernels(importlib.abc.Loader):
    """A module's own loader, run while ``import kernels`` fails."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... (tracebacks)
        return getattr(self._loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        saved = sys.modules.get("kernels", _NO_MODULE)
        sys.modules["kernels"] = None  # type: ignore[assignment]  # `import kernels` raises
        try:
            self._loader.exec_module(module)
        finally:
            if saved is _NO_MODULE:
                del sys.modules["kernels"]
            else:
                sys.modules["kernels"] = saved  # type: ignore[assignment]


class NoHubKernels(importlib.abc.MetaPathFinder):
    """Imports :attr:`guarded` through :class:`_WithoutKernels`."""

    guarded = "bitsandbytes.backends.cpu.ops"

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.guarded:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _WithoutKernels(spec.loader)
        return spec


def _without_cpu_kernel_notice(record: logging.LogRecord) -> bool:
    return "kernels" not in record.getMessage()


logging.getLogger(NoHubKernels.guarded).addFilter(_without_cpu_kernel_notice)
sys.meta_path.insert(0, NoHubKernels())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llamagym' has no attribute {name!r}")
