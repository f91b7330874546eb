"""Exploration over the legal actions: ``rollout.explore=least-tried`` offers, at each
place an episode comes back to, only the legal actions it has taken least often there.

A policy that keeps choosing the same way at the same place (a greedy one, or a sampled
one that has collapsed onto one action) then tries every other action before it repeats
one: an episode cannot loop on one command, and a sparse reward at the end of a long
task is reached far more often than by repeating the favourite. A place is what the
agent's :meth:`~llamagym.task.Task.exploration_place` says (by default the observation's
text) together with the legal actions offered there. Each episode counts afresh.

The offer is the policy's choice set: the log-probabilities a turn records are over the
offered actions, and the update recomputes them over the same ones. The env is stepped
with the action's place among *all* the legal actions (:func:`full_index`), so an agent
whose env takes an index (``action_names``) is stepped with the action it chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llamagym.rollout.slots import Slot
    from llamagym.rollout.trajectory import Turn
    from llamagym.task import Task

#: Where an episode stands, as a choice sees it: the agent's place and the legal actions.
Place = tuple[Hashable, tuple[str, ...]]


def place_of(agent: Task, observation: Any, info: dict, legal: Sequence[str]) -> Place:
    """The place of a decision at ``observation`` among ``legal``."""
    where = agent.exploration_place(observation, info)
    if where is None:
        where = agent.observation_text(observation, info)
    return where, tuple(legal)


def offer(agent: Task, slot: Slot, legal: list[str], explore: str) -> list[str]:
    """The legal actions offered at the slot's place (all of ``legal`` unless
    ``explore`` is ``least-tried``); the slot remembers the place and which of
    ``legal`` it offered, for :func:`full_index` and :func:`count_choice`."""
    slot.place, slot.offered = None, None
    if explore != "least-tried" or not legal:
        return legal
    place = slot.place = place_of(agent, slot.observation, slot.info, legal)
    tried = slot.tried.get(place)
    if not tried:
        return legal
    fewest = min(tried[name] for name in legal)
    offered = [index for index, name in enumerate(legal) if tried[name] == fewest]
    if len(offered) == len(legal):
        return legal
    slot.offered = offered
    return [legal[index] for index in offered]


def full_index(slot: Slot, index: int) -> int:
    """Where the ``index``-th offered action stands among all the legal actions."""
    return index if slot.offered is None else slot.offered[index]


def all_legal(slot: Slot, turn: Turn) -> list[str]:
    """Every legal action of the slot's decision (the place's), of which ``turn`` chose
    among those offered."""
    return list(slot.place[1]) if slot.place is not None else turn.legal_actions


def count_choice(slot: Slot, action_name: str) -> None:
    """The slot's episode took ``action_name`` at its current place."""
    if slot.place is not None:
        slot.tried.setdefault(slot.place, Counter())[action_name] += 1
    slot.place, slot.offered = None, None
