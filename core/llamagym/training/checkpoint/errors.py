"""What goes wrong with a checkpoint, as errors that name it."""

from __future__ import annotations

from pathlib import Path

from llamagym.errors import LlamaGymError


class CheckpointError(LlamaGymError):
    """A checkpoint that cannot be used as asked."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, unreadable, truncated or inconsistent."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not fit the model or optimizer they would load into."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only directory)."""


class UntrustedModelError(CheckpointError):
    """A checkpoint names a model that would run code of its own, and nobody allowed it."""


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def damaged(directory: Path, problem: str) -> DamagedCheckpointError:
    """The error for the checkpoint ``directory`` damaged as ``problem`` says."""
    return DamagedCheckpointError(f"checkpoint {str(directory)!r} is damaged: {problem}")
