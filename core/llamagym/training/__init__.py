"""Learning from episodes: the trainer loop, the algorithm base and its shared
loop, credit rules, the schedule, checkpoints, several processes, progress
display and the report."""

from llamagym import moved_name as _moved_name


def __getattr__(name: str) -> object:
    return _moved_name(__name__, name)
