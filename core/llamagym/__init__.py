"""LlamaGym: fine-tune LLM agents with online reinforcement learning in Gymnasium envs.

``from llamagym import Agent`` is all the classic API needs. Heavy modules (torch,
transformers) load only when something that needs them is touched, so the CLI starts
fast.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import Any

from llamagym.hookspecs import hookimpl

__version__ = "0.3.0"


def _without_cpu_kernel_notice(record: logging.LogRecord) -> bool:
    """peft imports bitsandbytes whenever it is installed, and bitsandbytes then warns, on
    a machine without the optional ``kernels`` package, that its fast 4-bit CPU matmul is
    missing: on every run, although only a quantized model uses it (the loader says so
    then)."""
    return "kernels" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_without_cpu_kernel_notice)

_LAZY = {
    "Agent": "llamagym.agent",
    "Algorithm": "llamagym.training.algorithm",
    "AlgorithmConfig": "llamagym.training.algorithm",
    "RunConfig": "llamagym.config",
    "Episode": "llamagym.rollout.trajectory",
    "Turn": "llamagym.rollout.trajectory",
    "Policy": "llamagym.models.policy",
    "load_model_and_tokenizer": "llamagym.models.loading",
    "load_agent": "llamagym.run",
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
    "llamagym.training": "llamagym.training.trainer",
    "llamagym.algorithm": "llamagym.training.algorithm",
    "llamagym.checkpoint": "llamagym.training.checkpoint",
    "llamagym.distributed": "llamagym.training.distributed",
    "llamagym.credit": "llamagym.training.credit",
    "llamagym.progress": "llamagym.training.progress",
    "llamagym.report": "llamagym.training.report",
    "llamagym.scaffold": "llamagym.devtools.scaffold",
    "llamagym.conformance": "llamagym.devtools.conformance",
    # 0.3: moved to the layer that uses them (docs/architecture.md, "Layers").
    "llamagym.training.schedule": "llamagym.schedule",
    "llamagym.rollout.transcripts": "llamagym.training.transcripts",
    "llamagym.models.export": "llamagym.training.export",
}


def moved_name(package: str, name: str) -> Any:
    """``__getattr__`` of the packages that took an old module's name (``models``,
    ``training``): ``from llamagym.models import load_model_and_tokenizer`` fails with one
    line naming the module it is in now; any other missing name is an AttributeError."""
    new = MOVED_MODULES[package]
    if (
        not name.startswith("_")
        and importlib.util.find_spec(f"{package}.{name}") is None  # not a submodule
        and hasattr(importlib.import_module(new), name)
    ):
        raise ImportError(f"{name} is not in {package}; import it from {new}", name=package)
    raise AttributeError(f"module {package!r} has no attribute {name!r}")


class _MovedModuleFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        new = MOVED_MODULES.get(fullname)
        if new is not None and not new.startswith(fullname + "."):
            raise ImportError(f"{fullname} is now {new}: import it from there", name=fullname)
        return None


sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llamagym' has no attribute {name!r}")
