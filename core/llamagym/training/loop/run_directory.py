"""The run directory: its default place, the files a run writes there, the checks made
before anything in it is touched (can it be written, does it hold a run, is each of its
files and folders its own: no symbolic link out of it, no FIFO or device), and the claim
a run makes on it (:class:`RunDirectory`: its lock taken, an older run replaced)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from llamagym import distributed
from llamagym.errors import LlamaGymError
from llamagym.paths import check_own_entry
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.records.report import CURVE, METRICS, REPORT
from llamagym.training.records.run_lock import LOCK, WRITER, RunDirectoryLock
from llamagym.training.records.transcripts import TRANSCRIPTS

RANK_RECORDS = ".ranks"
#: The plugins that answered per-step hooks (prompt, observation, parsing, reward).
PLUGINS = "plugins.json"
#: The demonstrations a baseline warm start recorded (``algorithm.warm_start.baseline``).
DEMONSTRATIONS = "demonstrations.jsonl"
RUN_FILES = (
    METRICS,
    PLUGINS,
    DEMONSTRATIONS,
    TRANSCRIPTS,
    REPORT,
    CURVE,
    "tensorboard",
    checkpoints.CHECKPOINTS,
    RANK_RECORDS,
)
#: What a run writes in its directory, as files and as folders: each must be its own.
OWN_FILES = (
    METRICS, PLUGINS, DEMONSTRATIONS, TRANSCRIPTS, REPORT, CURVE, "config.yaml", LOCK, WRITER
)
OWN_FOLDERS = ("tensorboard", checkpoints.CHECKPOINTS, RANK_RECORDS)
#: The name of the file a writability check writes and removes (:func:`check_writable`).
WRITE_PROBE = "llamagym-write-test"
#: The files whose hidden temporary copies (``.NAME.XXXXXXXX.tmp``) a killed writer may
#: leave in a run directory, removed by the next one (``RunDirectoryLock``).
OWN_TEMPORARIES = (*OWN_FILES, WRITE_PROBE)


def default_output_dir(agent_name: str) -> Path:
    """``runs/<agent>-<time>``. The agent's name is cut down to letters, digits, '_' and
    '-' (anything else becomes '-'), so it is always one plain folder in ``runs/``."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", agent_name).strip("-") or "agent"
    return Path("runs") / f"{safe}-{stamp}"


def check_writable(directory: Path, resuming: bool, create: bool = True) -> None:
    """Create ``directory`` if need be and write (then remove) a file in it: a directory
    that cannot be written is one line naming it, before anything in it is touched.
    With ``create`` off nothing is left behind: the probe goes into the directory, or
    into its nearest existing parent when it does not exist yet."""
    if directory.exists() and not directory.is_dir():
        raise LlamaGymError(
            f"run directory {str(directory)!r} is a file, not a directory; choose another "
            "--output"
        )
    check_own_entries(directory)
    fix = (
        "make it writable, or continue the run elsewhere with --output NEW_DIR"
        if resuming
        else "make it writable, or choose another --output"
    )
    where = directory
    if not create:
        while not os.path.lexists(where) and where != where.parent:
            where = where.parent
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        # Named as write_atomically names its temporary files: one a kill leaves behind
        # is removed by the directory's next writer.
        handle, probe = tempfile.mkstemp(prefix=f".{WRITE_PROBE}.", suffix=".tmp", dir=where)
        os.close(handle)
        os.unlink(probe)
    except OSError as error:
        raise LlamaGymError(
            f"run directory {str(directory)!r} cannot be written ({error.strerror or error}); "
            + fix
        ) from error


def check_own_entries(directory: Path) -> None:
    """Every file and folder a run writes in ``directory`` is missing or its own: a
    symbolic link (which a write would follow out of the directory), a FIFO (which it
    would wait on) or a device is refused in one line naming it, before anything is
    written (:func:`llamagym.paths.check_own_entry`)."""
    if not directory.is_dir():
        return
    for name in OWN_FILES:
        check_own_entry(directory / name)
    for name in OWN_FOLDERS:
        check_own_entry(directory / name, folder=True)
    checkpoints.list_checkpoints(directory)  # refuses a link among the checkpoints


def holds_a_run(directory: Path) -> bool:
    return (directory / METRICS).exists() or (directory / checkpoints.CHECKPOINTS).exists()


class RunDirectory:
    """The directory one run writes: ``path``, the files a new run there replaces
    (``run_files``), how a checkpoint names its run directory (``run_dir_of``) and whether
    an older run may be replaced (``overwrite``)."""

    def __init__(self, path: Path, run_files: tuple[str, ...],
                 run_dir_of: Callable[[Path], Path], overwrite: bool):
        self.path = path
        self.run_files = run_files
        self.run_dir_of = run_dir_of
        self.overwrite = overwrite
        #: held by rank 0 from the directory's first write to the run's end
        self.lock: RunDirectoryLock | None = None

    def replaces_a_run(self, resume_checkpoint: Path | None) -> bool:
        """Whether this run replaces another in the directory; without ``overwrite`` that
        is refused in one line naming the ways on."""
        resuming_in_place = resume_checkpoint is not None and (
            self.run_dir_of(resume_checkpoint) == self.path.resolve()
        )
        replacing = holds_a_run(self.path) and not resuming_in_place
        if replacing and not self.overwrite:
            raise LlamaGymError(
                f"output directory {str(self.path)!r} already holds a run; continue it "
                f"with --resume {self.path}, choose another --output, or set "
                "output.overwrite=true to replace it"
            )
        return replacing

    def claim(self, resume_checkpoint: Path | None) -> None:
        """Create the directory and take its lock (rank 0), removing an older run's files
        when this one replaces it: the first write of a run, after everything that can
        refuse it."""
        self.replaces_a_run(resume_checkpoint)
        # Every process has looked at the directory before rank 0 writes to it: a process
        # that looks later would take rank 0's first files for another run's.
        distributed.barrier()
        if not distributed.is_main():
            return
        # Created if need be, and known to be writable before anything in it is deleted.
        check_writable(self.path, resuming=resume_checkpoint is not None)
        self.lock = RunDirectoryLock(self.path, OWN_TEMPORARIES)
        self.lock.acquire()
        replacing = self.replaces_a_run(resume_checkpoint)  # again, now as its one writer
        for name in self.run_files if replacing else ():
            path = self.path / name
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
