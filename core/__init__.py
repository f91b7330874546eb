"""LlamaGym: fine-tune LLM agents with online reinforcement learning in Gymnasium envs.

``from llamagym import Agent`` is all the classic API needs. Heavy modules (torch,
transformers) load only when something that needs them is touched, so the CLI starts
fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from llamagym.hookspecs import hookimpl

__version__ = "0.2.0"

_LAZY = {
    "Agent": "llamagym.agent",
    "Algorithm": "llamagym.algorithm",
    "AlgorithmConfig": "llamagym.algorithm",
    "RunConfig": "llamagym.config",
    "Episode": "llamagym.trajectory",
    "Turn": "llamagym.trajectory",
    "Policy": "llamagym.policy",
    "load_model_and_tokenizer": "llamagym.models",
    "load_agent": "llamagym.run",
    "build_run": "llamagym.run",
    "RunContext": "llamagym.specs",
    "get_plugins": "llamagym.plugin_manager",
    "LlamaGymError": "llamagym.errors",
}

__all__ = ["hookimpl", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'llamagym' has no attribute {name!r}")
