"""Learning from episodes, in three rooms, highest first: the loop (``loop``: the
trainer, starting and resuming, budgets, the loop's state, progress, the final
evaluation), checkpoints (``checkpoint``) and what a run leaves to be read
(``records``: run files, report, transcripts, the lock, export). A room uses only the
rooms below it (docs/architecture.md, "Layers")."""

from typing import TYPE_CHECKING

from llamagym import moved_name as _moved_name

if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
