"""The run directory: its default place, the files a run writes there, and the checks
made before anything in it is touched (can it be written, does it hold a run)."""

from __future__ import annotations

import os
import re
from datetime import datetime
from pathlib import Path

from llamagym.errors import LlamaGymError
from llamagym.training import checkpoint as checkpoints
from llamagym.training.report import METRICS
from llamagym.training.transcripts import TRANSCRIPTS

RANK_RECORDS = ".ranks"
#: The plugins that answered per-step hooks (prompt, observation, parsing, reward).
PLUGINS = "plugins.json"
RUN_FILES = (
    METRICS,
    PLUGINS,
    TRANSCRIPTS,
    "report.md",
    "learning_curve.png",
    "tensorboard",
    checkpoints.CHECKPOINTS,
    RANK_RECORDS,
)


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
    fix = (
        "make it writable, or continue the run elsewhere with --output NEW_DIR"
        if resuming
        else "make it writable, or choose another --output"
    )
    where = directory
    if not create:
        while not where.exists() and where != where.parent:
            where = where.parent
    try:
        if create:
            directory.mkdir(parents=True, exist_ok=True)
        probe = where / f".llamagym-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        raise LlamaGymError(
            f"run directory {str(directory)!r} cannot be written ({error.strerror or error}); "
            + fix
        ) from error


def holds_a_run(directory: Path) -> bool:
    return (directory / METRICS).exists() or (directory / checkpoints.CHECKPOINTS).exists()
