"""Filesystem locations used by LlamaGym.

This module is imported by the CLI before anything heavy, so it must only use
the standard library.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
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


# A temporary build directory older than this was left by a process that died.
STALE_TMP_SECONDS = 3600


def remove_stale_temp_dirs(parent: Path, prefix: str) -> None:
    """Delete the ``prefix*`` directories in ``parent`` that a crashed writer left."""
    now = time.time()
    for candidate in parent.glob(f"{prefix}*"):
        # OSError: another process may be removing it at the same time.
        with contextlib.suppress(OSError):
            if now - candidate.stat().st_mtime > STALE_TMP_SECONDS:
                shutil.rmtree(candidate, ignore_errors=True)


def discard_directory(target: Path) -> None:
    """Delete the directory ``target``. It is renamed away first, so no reader ever finds
    it half deleted."""
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    # FileNotFoundError: someone else removed or replaced it meanwhile.
    with contextlib.suppress(FileNotFoundError):
        os.replace(target, trash / "old")
    shutil.rmtree(trash, ignore_errors=True)


def publish_directory(tmp: Path, target: Path, is_complete: Callable[[Path], bool]) -> bool:
    """Rename the finished directory ``tmp`` to ``target``, close to atomically.

    An incomplete ``target`` is moved aside first (renaming onto a non-empty directory
    fails). When another process renamed its own complete copy into place first, that
    copy stays and this returns False; any other failure raises.
    """
    if target.exists() and not is_complete(target):
        discard_directory(target)
    try:
        os.rename(tmp, target)
    except OSError:
        if not is_complete(target):
            raise
        return False
    return True
