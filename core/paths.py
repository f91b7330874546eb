"""Filesystem locations used by LlamaGym.

This module is imported by the CLI before anything heavy, so it must only use
the standard library.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV_VAR = "LLAMAGYM_CACHE"


def cache_dir() -> Path:
    """Root of LlamaGym's on-disk cache.

    ``$LLAMAGYM_CACHE`` wins when set (tests point it at a temporary directory
    so they never write to the user's home); otherwise ``~/.cache/llamagym``.
    The directory is not created here: callers create what they write into.
    """
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "llamagym"


def models_cache_dir() -> Path:
    """Where locally built models (such as ``tiny``) are stored."""
    return cache_dir() / "models"
