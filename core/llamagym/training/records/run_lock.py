"""One writer per run directory.

``llamagym run`` and ``run --resume`` hold ``<run>/.llamagym.lock`` (an operating-system
file lock, through the ``filelock`` library) while they write the directory; a second
writer is refused in one line naming the process that holds it. The lock goes with its
process: a run killed without a chance to clean up (SIGKILL, a power cut) leaves the
lock file, but no lock, so the next writer takes it over, saying whose it was, and removes
the temporary files that writer's interrupted writes left. Beside the lock,
``<run>/.llamagym.writer`` names the holder (pid, start time) for that message; it is read
as untrusted data, like every file of a run directory, and neither file is opened through
a symbolic link or when it is a FIFO or a device.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from llamagym.errors import LlamaGymError
from llamagym.paths import check_own_entry, open_own_file, remove_temporaries

logger = logging.getLogger(__name__)

LOCK = ".llamagym.lock"
WRITER = ".llamagym.writer"
#: The most of a writer record read back (it is a few dozen bytes).
MAX_WRITER_BYTES = 4096


class RunDirectoryBusyError(LlamaGymError):
    """Another process is writing the run directory."""


def _holder(directory: Path) -> dict[str, Any]:
    """The writer record's pid and start time, when it holds sensible ones; else ``{}``."""
    try:
        with os.fdopen(open_own_file(directory / WRITER, os.O_RDONLY), "rb") as stream:
            data = json.loads(stream.read(MAX_WRITER_BYTES))
    except (OSError, ValueError, LlamaGymError):
        return {}
    if not isinstance(data, dict):
        return {}
    pid, started = data.get("pid"), data.get("started")
    holder: dict[str, Any] = {}
    if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0:
        holder["pid"] = pid
    if isinstance(started, str):
        holder["started"] = started[:40]
    return holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # someone else's process, or not a pid we can ask about
    return True


class RunDirectoryLock:
    """The lock of one run directory (which must exist). :meth:`acquire` refuses at once
    when another process holds it; :meth:`release` lets it go and removes the record."""

    def __init__(self, directory: Path, own_files: Sequence[str] = ()):
        self.directory = Path(directory)
        #: the files whose temporaries an earlier writer left are removed on acquiring
        self.own_files = tuple(own_files)
        self._lock = FileLock(str(self.directory / LOCK), timeout=0)

    def acquire(self) -> None:
        check_own_entry(self.directory / LOCK)
        check_own_entry(self.directory / WRITER)
        try:
            self._lock.acquire(timeout=0)
        except Timeout:
            holder = _holder(self.directory)
            who = f"process {holder['pid']}" if "pid" in holder else "another process"
            since = f", since {holder['started']!r}" if "started" in holder else ""
            raise RunDirectoryBusyError(
                f"run directory {str(self.directory)!r} is being written by {who}{since}; "
                "wait for that run to end (or stop it), or choose another --output"
            ) from None
        except OSError as error:
            raise LlamaGymError(
                f"run directory {str(self.directory)!r}: cannot create its lock file "
                f"({error.strerror or error}); make it writable, or choose another --output"
            ) from error
        previous = _holder(self.directory)
        if previous.get("pid") not in (None, os.getpid()):
            state = "is no longer running" if not _alive(previous["pid"]) else "holds no lock"
            logger.warning(
                "run directory %s was last written by process %d, which %s (killed?); "
                "taking it over",
                self.directory,
                previous["pid"],
                state,
            )
        record = {"pid": os.getpid(), "started": datetime.now().isoformat(timespec="seconds")}
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            with os.fdopen(open_own_file(self.directory / WRITER, flags), "w") as stream:
                stream.write(json.dumps(record) + "\n")
            remove_temporaries(self.directory, self.own_files)  # a killed writer's
        except OSError as error:
            self._lock.release()
            raise LlamaGymError(
                f"run directory {str(self.directory)!r} cannot be written "
                f"({error.strerror or error}); make it writable, or choose another --output"
            ) from error
        except BaseException:
            self._lock.release()
            raise

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        with contextlib.suppress(OSError):
            (self.directory / WRITER).unlink()
        self._lock.release()
