"""The run directory: its default place, the files a run writes there, and the checks
made before anything in it is touched (can it be written, does it hold a run, is each of
its files and folders its own: no symbolic link out of it, no FIFO or device)."""

from __future__ import annotations

import os
import re
import tempfile
from datetime import datetime
from pathlib import Path

from llamagym.errors import LlamaGymError
from llamagym.paths import check_own_entry
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.records.report import CURVE, METRICS, REPORT
from llamagym.training.records.run_lock import LOCK, WRITER
from llamagym.training.records.transcripts import TRANSCRIPTS

RANK_RECORDS = ".ranks"
#: The plugins that answered per-step hooks (prompt, observation, parsing, reward).
PLUGINS = "plugins.json"
RUN_FILES = (
    METRICS,
    PLUGINS,
    TRANSCRIPTS,
    REPORT,
    CURVE,
    "tensorboard",
    checkpoints.CHECKPOINTS,
    RANK_RECORDS,
)
#: What a run writes in its directory, as files and as folders: each must be its own.
OWN_FILES = (METRICS, PLUGINS, TRANSCRIPTS, REPORT, CURVE, "config.yaml", LOCK, WRITER)
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
