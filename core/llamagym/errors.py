"""Errors a user can act on. The CLI prints their message as one line, no traceback.

Top level: the lowest floor; every module raises these.
"""

from __future__ import annotations


class LlamaGymError(Exception):
    """Base class: the message says what was wrong, the value given and how to fix it."""


class ConfigError(LlamaGymError):
    """A run configuration is invalid (unknown key, wrong type, out of range)."""


class UnknownNameError(LlamaGymError):
    """An agent, algorithm or model name that no installed plugin registered."""

    def __init__(self, kind: str, name: str, known: list[str]):
        self.kind, self.name, self.known = kind, name, known
        listing = ", ".join(sorted(known)) or "none installed"
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {listing}")


class PluginError(LlamaGymError):
    """A plugin failed to import, to register, or registered a clashing name."""


class ModelLoadError(LlamaGymError):
    """A model or tokenizer could not be loaded."""


class MissingDependencyError(LlamaGymError):
    """An optional dependency is needed for what was asked."""

    def __init__(self, package: str, purpose: str, install: str | None = None):
        super().__init__(
            f"{purpose} needs the optional package {package!r}: pip install {install or package}"
        )


class WriteError(LlamaGymError):
    """A file could not be written (a full disk, a read-only directory); what was there
    before is unchanged."""


class UnsafeFileError(LlamaGymError):
    """Where a program's own file or folder belongs (in a run directory, say) there is a
    symbolic link, a FIFO or a device, which a write would follow or block on."""


class EnvFailureError(LlamaGymError):
    """An environment kept raising; the run stopped after too many failures in a row."""


class TrainingDivergedError(LlamaGymError):
    """Too many updates in a row had a non-finite loss or gradient."""


class RunFileError(LlamaGymError):
    """A file of a run directory (metrics, transcripts, plugins record, run config) is
    malformed, too large or unreadable."""
