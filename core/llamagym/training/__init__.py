"""Learning from episodes: the trainer loop, the algorithm base and its shared
loop, credit rules, the schedule, checkpoints, several processes, progress
display and the report."""

from typing import TYPE_CHECKING

from llamagym import moved_name as _moved_name

if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
