"""Filesystem locations used by LlamaGym, and how it uses paths: files replaced in one
rename or appended in one write, a run's own files never written through a symbolic link
or into a FIFO or a device, and a path that cannot be used (too long, a link loop, no
permission, a full disk, ``~user`` of no user) said in one line.

This module is imported by the CLI before anything heavy, so it must only use
the standard library.

Top level: a utility below every floor (the standard library only); the CLI, the
models' cache and the run directories all use it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO

from llamagym.errors import LlamaGymError, UnsafeFileError, WriteError

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


def expand_user(path: str | os.PathLike[str]) -> Path:
    """``path`` with a leading ``~`` or ``~user`` expanded. A user this machine does not
    know is a :class:`LlamaGymError` in one line (``Path.expanduser`` raises a bare
    ``RuntimeError`` there)."""
    text = os.fspath(path)
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):
        user = expanded[1:].split("/", 1)[0].split(os.sep, 1)[0]
        raise LlamaGymError(
            f"{text!r}: there is no user {user!r} on this machine to expand '~{user}' for; "
            "write the path out in full"
        )
    return Path(expanded)


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


# -- paths that cannot be used ----------------------------------------------------------
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
#: errno -> the fix, for a path that a command was given (or derived) and cannot use.
_PATH_FIXES = {
    errno.ENAMETOOLONG: "a name in a path is at most 255 bytes and a path at most 4,096: "
    "shorten it",
    errno.ELOOP: "a symbolic link in it leads back to itself (or through too many links): "
    "fix or remove the link",
    errno.ENOTDIR: "a part of it that should be a folder is a file: correct the path",
    errno.EEXIST: "something that is not a folder (a file, a link to nothing or to itself) "
    "stands where a folder is needed: move it, or choose another path",
    errno.EACCES: "make it accessible to this user, or choose another path",
    errno.EPERM: "make it accessible to this user, or choose another path",
    errno.EROFS: "it is on a read-only file system: choose a path on a writable one",
    **dict.fromkeys(_DISK_FULL, "the disk is full: free space on that disk"),
}


def path_problem(error: OSError, name: bool = True) -> str | None:
    """What is wrong with the path an ``OSError`` names and how to fix it, in one line
    (``'/x/...': File name too long; a name in a path is at most 255 bytes...``; without
    ``name``, from the reason on); None for an error that names no path or is not one of
    a path that cannot be used."""
    fix = _PATH_FIXES.get(error.errno) if error.errno is not None else None
    if error.filename is None or fix is None:
        return None
    reason = f"{error.strerror or error}; {fix}"
    if not name:
        return reason
    filename = error.filename
    if isinstance(filename, (str, bytes, os.PathLike)):
        filename = os.fsdecode(filename)
    return f"{str(filename)!r}: {reason}"


# -- a run's own files: never through a link, never a pipe or a device --------------------
_FILE_TYPES = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
    stat.S_IFREG: "a file",
}


def kind_of_file(mode: int) -> str:
    """What a ``stat`` mode says the entry is, in words: ``a FIFO (named pipe)``."""
    return _FILE_TYPES.get(stat.S_IFMT(mode), "not a regular file")


def check_own_entry(path: Path, *, folder: bool = False) -> None:
    """``path`` does not exist, or is a file of its own (with ``folder``: a folder of its
    own). Anything else (a symbolic link, a FIFO, a device, a socket) is refused with
    :class:`UnsafeFileError` in one line naming it and the fix: what a program writes
    into a directory it was given must stay in that directory, and never wait on a pipe.
    Only ``lstat`` is used: nothing is opened or followed."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if (stat.S_ISDIR if folder else stat.S_ISREG)(mode):
        return
    what = kind_of_file(mode)
    if stat.S_ISLNK(mode):
        with contextlib.suppress(OSError):
            what += f" (to {os.readlink(path)!r})"
    wanted = "a folder" if folder else "a file"
    raise UnsafeFileError(
        f"{str(path)!r} is {what} where {wanted} of its own belongs; LlamaGym writes nothing "
        f"through a link or into a pipe or device: remove it or put a real {wanted[2:]} "
        "there, or use another directory"
    )


def open_own_file(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open(path, flags, mode)`` for a file of its own (:func:`check_own_entry`):
    never through a symbolic link (``O_NOFOLLOW``) and never blocking on a FIFO
    (``O_NONBLOCK``), even when one appears after the check; the descriptor is checked
    to be a regular file before it is returned."""
    check_own_entry(path)  # before opening: opening a device can itself do something
    safe = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags | safe, mode)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENXIO):  # replaced by a link or a FIFO meanwhile
            check_own_entry(path)
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        check_own_entry(path)
        raise UnsafeFileError(f"{str(path)!r} is not a regular file; remove it")
    return descriptor


def remove_temporaries(directory: Path, names: Sequence[str]) -> list[str]:
    """Delete the temporary files :func:`write_atomically` left in ``directory`` for the
    files ``names`` when its process was killed mid-write (``.NAME.XXXXXXXX.tmp``, as
    mkstemp names them); returns their names. Only for a directory's one writer (a
    run's lock holder): no write of another process can be in flight there."""
    if not names:
        return []
    pattern = re.compile(
        r"\.(?:" + "|".join(re.escape(name) for name in names) + r")\.[a-z0-9_]{8}\.tmp"
    )
    removed = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if pattern.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


# -- writing files ---------------------------------------------------------------------


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
    if code in _PATH_FIXES:
        return f"{reason}; {_PATH_FIXES[code]}"
    return f"{reason}; fix that"


def _refuse_write(path: Path, error: OSError) -> WriteError:
    failure = write_failure(error)
    assert failure is not None
    return WriteError(f"could not write {str(path)!r}: {write_failure_text(failure, path.parent)}")


def write_atomically(path: Path, content: str | bytes) -> None:
    """Replace ``path`` with ``content`` (text is written as UTF-8) in one rename from a
    hidden sibling. A failure (a full disk, a read-only directory) raises
    :class:`WriteError` saying so and leaves ``path`` as it was and no temporary file."""
    data = content.encode("utf-8") if isinstance(content, str) else content
    _replace_atomically(Path(path), lambda out: out.write(data))


def copy_atomically(source: Path, path: Path) -> None:
    """Replace ``path`` with a copy of the regular file ``source``, as
    :func:`write_atomically` does, read and written in chunks (never whole in memory)."""
    with Path(source).open("rb") as read:
        _replace_atomically(Path(path), lambda out: shutil.copyfileobj(read, out))


def _replace_atomically(path: Path, write: Callable[[BinaryIO], object]) -> None:
    try:
        handle, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:
        raise _refuse_write(path, error) from error
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
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
        descriptor = open_own_file(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
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
