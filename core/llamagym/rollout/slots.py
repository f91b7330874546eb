"""Episodes in progress: a :class:`Slot` for one environment's episode, and a
:class:`Lockstep`, one collection's environments and the slot each of them plays."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamagym.rollout.trajectory import Episode

#: Each slot's key, naming its episode to the policy's turn cache.
_slot_keys = itertools.count()


@dataclass
class Slot:
    """One environment's episode in progress. ``key`` names it to the policy, which
    keeps the slot's last turn's key/value cache under it (``Policy.turn_cache``) until
    the engine drops it (:meth:`RolloutEngine.end_slot`)."""

    observation: Any
    info: dict
    episode: Episode
    history: list[dict[str, str]] = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_slot_keys))

    @property
    def system_prompt(self) -> str:
        """The system prompt the episode is played with (its episode's)."""
        return self.episode.system_prompt


@dataclass
class Lockstep:
    """One collection (:meth:`RolloutEngine.collect`): ``envs`` play in lockstep, env
    ``p`` the episode in ``slots[p]`` (None once no episode is left to start), until
    ``num_episodes`` episodes, seeded by ``seeds``, have been started."""

    envs: list[Any]
    seeds: Sequence[int]
    num_episodes: int
    group_size: int
    on_episode: Callable[[Episode], None] | None
    slots: list[Slot | None]
    #: the turns an episode of each env may last (read again when an env is replaced)
    turn_caps: list[int]
    #: the episodes finished so far, in the order they ended
    finished: list[Episode] = field(default_factory=list)
    #: the index of the next episode to start
    next_episode: int = 0

    def active(self) -> list[tuple[int, Slot]]:
        """The envs with an episode in progress, and their slots."""
        return [(position, slot) for position, slot in enumerate(self.slots) if slot is not None]
