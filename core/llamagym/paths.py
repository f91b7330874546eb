"""Filesystem locations used by LlamaGym.

This module is imported by the CLI before anything heavy, so it must only use
the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from llamagym.errors import WriteError

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


# -- writing files ---------------------------------------------------------------------
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def write_failure(error: BaseException) -> tuple[int | None, str] | None:
    """``(errno, reason)`` of a failure to write a file, else ``None``. safetensors
    reports its own write failures as a ``SafetensorError`` carrying the OS error."""
    if isinstance(error, OSError):
        return error.errno, error.strerror or str(error)
    text = (str(error).strip().splitlines() or [""])[0]
    if type(error).__name__ != "SafetensorError" or "I/O error" not in text:
        return None
    code = re.search(r"\(os error (\d+)\)", text)
    reason = text.split("I/O error:", 1)[1].split("(os error", 1)[0].strip(" :")
    return (int(code.group(1)) if code else None), reason or text


def write_failure_text(failure: tuple[int | None, str], directory: Path) -> str:
    """What went wrong and the fix, for a write into ``directory`` that failed:
    ``the disk is full (...); free space on that disk``."""
    code, reason = failure
    if code in _DISK_FULL:
        return f"the disk is full ({reason}); free space on that disk"
    if code in _NOT_WRITABLE:
        return f"{reason}; make {str(directory)!r} writable"
    return f"{reason}; fix that"


def _refuse_write(path: Path, error: OSError) -> WriteError:
    failure = write_failure(error)
    assert failure is not None
    return WriteError(f"could not write {str(path)!r}: {write_failure_text(failure, path.parent)}")


def write_atomically(path: Path, content: str | bytes) -> None:
    """Replace ``path`` with ``content`` (text is written as UTF-8) in one rename from a
    hidden sibling. A failure (a full disk, a read-only directory) raises
    :class:`WriteError` saying so and leaves ``path`` as it was and no temporary file."""
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise _refuse_write(path, error) from error
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; run files are ordinary files
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(error, OSError):
            raise _refuse_write(path, error) from error
        raise


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (ending in a newline) to ``path`` in one write that reaches the
    file whole or not at all: a failed write is cut off again and raises
    :class:`WriteError`, so the next line never joins a torn one."""
    path = Path(path)
    data = memoryview(line.encode("utf-8"))
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as error:
        raise _refuse_write(path, error) from error
    try:
        start = os.lseek(descriptor, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(descriptor, data):]
        except OSError as error:
            with contextlib.suppress(OSError):
                os.ftruncate(descriptor, start)
            raise _refuse_write(path, error) from error
    finally:
        os.close(descriptor)
