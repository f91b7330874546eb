"""LlamaGym: fine-tune LLM agents with online reinforcement learning in Gymnasium envs.

``from llamagym import Agent`` is all the classic API needs. Heavy modules (torch,
transformers) load only when something that needs them is touched, so the CLI starts
fast.

Top level: the package's front door (``from llamagym import Agent``), with the
table of moved names and the import hooks that must be in place before any other module
loads.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import warnings
from typing import Any

__version__ = "0.5.1"


_LAZY = {
    "hookimpl": "llamagym.plugin_runtime.hookspecs",
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
    "RunContext": "llamagym.plugin_runtime.registry",
    "get_plugins": "llamagym.plugin_runtime.manager",
    "LlamaGymError": "llamagym.errors",
}

__all__ = ["__version__", *_LAZY]

#: Modules that moved, by the release that moved them: old name -> new name. What moved
#: in a release still imports under its old name through that release, with a
#: DeprecationWarning naming the new place, and goes in the next minor release: from then
#: on the old name fails with one line naming the new one (:func:`moved_module`). The
#: names of ``llamagym`` itself (``Agent``, ``Algorithm``, ``Episode``, ...) did not move.
#: CHANGELOG.md lists every entry and the release it goes in.
MOVED_MODULES: dict[str, dict[str, str]] = {
    # 0.3: out of 0.2's flat layout into subpackages, and to the layer that uses them.
    "0.3": {
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
        # Moved to the layer that uses them (docs/architecture.md, "Layers").
        "llamagym.training.schedule": "llamagym.schedule",
        "llamagym.rollout.transcripts": "llamagym.training.records.transcripts",
        "llamagym.models.export": "llamagym.training.records.export",
    },
    "0.4": {
        # The built-in plugins are a package of their own (plugins/llamagym_builtins), so
        # `llamagym.plugins.ppo` fails at its first step, naming where `ppo` is now.
        "llamagym.plugins": "llamagym_builtins",
        # What every algorithm builds on is a floor of its own, below training.
        **{f"llamagym.training.{name}": f"llamagym.algorithms.{name}" for name in (
            "algorithm", "algorithm_config", "batching", "credit", "kl_control", "losses",
            "turn_scoring",
        )},
        # Several processes serve the algorithms, the training loop and the TRL backend,
        # so they sit below all three.
        "llamagym.training.distributed": "llamagym.distributed",
        # Training's rooms (the loop, checkpoints, run records), and the TRL backend a
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
    },
    # 0.5: the plugin runtime, the config and the config's resolver are packages.
    "0.5": {
        "llamagym.hookspecs": "llamagym.plugin_runtime.hookspecs",
        "llamagym.specs": "llamagym.plugin_runtime.registry",
        "llamagym.plugin_manager": "llamagym.plugin_runtime.manager",
        "llamagym.plugin_isolation": "llamagym.plugin_runtime.isolation",
        "llamagym.plugin_answers": "llamagym.plugin_runtime.hook_values",
        "llamagym.agent_hooks": "llamagym.plugin_runtime.agent_plugin",
        "llamagym.config_files": "llamagym.config.files",
        "llamagym.config_layers": "llamagym.resolver.layers",
        "llamagym.trl_arguments": "llamagym.resolver.trl_arguments",
        # 0.5.1: the parsers are the task's, no longer plugins.
        "llamagym_builtins.parsers": "llamagym.task.reply_parsers",
    },
}

#: Names that a module offered in LlamaGym 0.3.0 but that another module defines now:
#: old module -> the module to import them from -> the names. A module holds only the
#: names it defines (its ``__all__`` lists just those), so importing one of these from
#: the old module fails with one line naming the new one (:func:`moved_name`); they moved
#: in 0.4, before the rule above, so they are gone already.
MOVED_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "llamagym.config": {
        "llamagym.resolver.layers": (
            "AlgorithmClass", "Layer", "ResolvedConfig", "agent_config_class",
            "config_descriptions", "format_validation_error", "leaf_keys",
            "model_descriptions", "render_config_yaml", "resolve_config",
        ),
    },
    "llamagym.agent": {"llamagym.task": ("Baseline",)},
    "llamagym.run": {
        "llamagym.resolver.layers": ("defaults_for_model", "run_layers"),
        "llamagym.agent": ("load_agent",),
        "llamagym.training.loop.run_state": ("make_engine",),
    },
    "llamagym.session": {"llamagym.algorithms.algorithm": ("Algorithm",)},
    "llamagym.plugin_runtime.manager": {
        "llamagym.plugin_runtime.isolation": ("DEFAULT_TIMEOUT_SECONDS", "TIMEOUT_VARIABLE"),
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


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def goes_in(release: str) -> str:
    """The release in which what moved in ``release`` goes: the next minor one."""
    major, minor = _minor(release)
    return f"{major}.{minor + 1}"


def gone(release: str) -> bool:
    """Whether what moved in ``release`` is gone from this one."""
    return _minor(__version__) >= _minor(goes_in(release))


def moved_module(old: str) -> tuple[str, str] | None:
    """``(new name, release it moved in)`` of a module that moved, or None."""
    return next(((moved[old], release) for release, moved in MOVED_MODULES.items()
                 if old in moved), None)


def moved_away(old: str) -> tuple[str, str] | None:
    """:func:`moved_module`, but None where a package took the old module's name
    (``llamagym.training``): importing that name imports the package, whose
    ``__getattr__`` answers for what the old module held."""
    moved = moved_module(old)
    return None if moved is None or moved[0].startswith(old + ".") else moved


def moved_name(module: str, name: str) -> Any:
    """``__getattr__`` of a module that lost names (:data:`MOVED_NAMES`), and of the
    packages that took an old module's name (``models``, ``training``): ``from
    llamagym.training.algorithm import seed_groups`` fails with one line naming the module
    that defines it now; any other missing name is an AttributeError."""
    new = next((new for new, names in MOVED_NAMES.get(module, {}).items() if name in names),
               None)
    moved = moved_module(module)
    if new is None and moved is not None and _in_moved_module(module, moved[0], name):
        new = moved[0]
    if new is not None:
        raise ImportError(f"{name} is not in {module}; import it from {new}", name=module)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def _in_moved_module(package: str, moved_to: str, name: str) -> bool:
    """Whether ``name`` is in the module that moved out of ``package``'s name."""
    return (
        not name.startswith("_")
        and importlib.util.find_spec(f"{package}.{name}") is None  # not a submodule
        and hasattr(importlib.import_module(moved_to), name)
    )


class _OldName(importlib.abc.Loader):
    """Imports a module that moved in this release under its old name too: the same
    module object, after a DeprecationWarning naming the new place."""

    def __init__(self, new: str, release: str) -> None:
        self.new, self.release = new, release

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        # stacklevel 2 is the import statement: warnings skips the import system's frames.
        warnings.warn(f"{spec.name} moved to {self.new} in LlamaGym {self.release} and the "
                      f"old name goes in {goes_in(self.release)}: import it from {self.new}",
                      DeprecationWarning, stacklevel=2)
        return importlib.import_module(self.new)

    def exec_module(self, module: Any) -> None:
        """The module ran under its new name."""


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        moved = moved_away(fullname)
        if moved is None:
            return None
        new, release = moved
        if gone(release):
            raise ImportError(f"{fullname} is now {new}: import it from there", name=fullname)
        return importlib.util.spec_from_loader(fullname, _OldName(new, release))


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
