"""Learning from episodes: the trainer loop, the algorithm base and its shared
loop, credit rules, the schedule, checkpoints, several processes, progress
display and the report."""


def __getattr__(name: str) -> object:
    from llamagym import moved_name

    return moved_name(__name__, name)
