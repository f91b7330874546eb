"""Episodes in progress: a :class:`Slot` for one environment's episode, and a
:class:`Lockstep`, a collection's environments and the slot each of them plays."""

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
    #: each env step so far: the legal action's index and name, or (None, the value
    #: given to ``env.step``) for an agent that names no actions; and the env's reward
    #: for it. A saved episode in progress is replayed from them (``rollout.carried``).
    steps: list[tuple[int | None, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)

    @property
    def system_prompt(self) -> str:
        """The system prompt the episode is played with (its episode's)."""
        return self.episode.system_prompt


@dataclass
class Lockstep:
    """A collection's envs (:meth:`RolloutEngine.collect`): env ``p`` plays the episode
    in ``slots[p]`` (None once no episode is left to start).

    With ``num_episodes`` set, the collection starts that many episodes, seeded by
    ``seeds``, and ends when they have finished. An open lockstep (``num_episodes``
    None) never runs out: an env whose episode ends starts the next at once, with a seed
    drawn as it starts, and the lockstep outlives the collection that opened it
    (:meth:`RolloutEngine.play` with ``carry``)."""

    envs: list[Any]
    seeds: Sequence[int] | None
    num_episodes: int | None
    group_size: int
    on_episode: Callable[[Episode], None] | None
    slots: list[Slot | None]
    #: the turns an episode of each env may last (read again when an env is replaced)
    turn_caps: list[int]
    #: the episodes finished so far, in the order they ended
    finished: list[Episode] = field(default_factory=list)
    #: the index of the next episode to start
    next_episode: int = 0
    #: stamped on every turn played (:attr:`Turn.policy_version`): the number of
    #: updates the weights that played it had seen
    policy_version: int = 0
    #: the episodes the current collection returns (None: all); ``on_episode`` hears of
    #: those, and of the others when the next collection hands them out
    wanted: int | None = None

    def active(self) -> list[tuple[int, Slot]]:
        """The envs with an episode in progress, and their slots."""
        return [(position, slot) for position, slot in enumerate(self.slots) if slot is not None]

    def returns_latest(self) -> bool:
        """Whether the episode that finished last is one the current collection returns
        (its ``on_episode`` hears of it now)."""
        return self.wanted is None or len(self.finished) <= self.wanted

    def has_more(self) -> bool:
        """Whether an episode is still due to start."""
        return self.num_episodes is None or self.next_episode < self.num_episodes
