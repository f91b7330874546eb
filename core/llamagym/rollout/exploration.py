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
with the action's place among *all* the legal actions (:meth:`Tried.full_index`), so an agent
whose env takes an index (``action_names``) is stepped with the action it chose.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llamagym.task import Task

#: Where an episode stands, as a choice sees it: the agent's place and the legal actions.
Place = tuple[Hashable, tuple[str, ...]]


def place_of(agent: Task, observation: Any, info: dict, legal: Sequence[str]) -> Place:
    """The place of a decision at ``observation`` among ``legal``."""
    where = agent.exploration_place(observation, info)
    if where is None:
        where = agent.observation_text(observation, info)
    return where, tuple(legal)


@dataclass
class Tried:
    """One episode's record: how often it took each action at each place (``counts``),
    the place of the decision in progress and which of its legal actions were offered
    (``offered``, their indices; None: all of them)."""

    counts: dict[Place, Counter[str]] = field(default_factory=dict)
    place: Place | None = None
    offered: list[int] | None = None

    def offer(
        self, agent: Task, observation: Any, info: dict, legal: list[str], explore: str
    ) -> list[str]:
        """The legal actions offered at ``observation``: all of ``legal`` unless
        ``explore`` is ``least-tried``, then those taken least often at its place."""
        self.place, self.offered = None, None
        if explore != "least-tried" or not legal:
            return legal
        place = self.place = place_of(agent, observation, info, legal)
        tried = self.counts.get(place)
        if not tried:
            return legal
        fewest = min(tried[name] for name in legal)
        offered = [index for index, name in enumerate(legal) if tried[name] == fewest]
        if len(offered) == len(legal):
            return legal
        self.offered = offered
        return [legal[index] for index in offered]

    def full_index(self, index: int) -> int:
        """Where the ``index``-th offered action stands among all the legal actions."""
        return index if self.offered is None else self.offered[index]

    def all_legal(self, offered: list[str]) -> list[str]:
        """Every legal action of the decision in progress, of which ``offered`` were
        offered."""
        return list(self.place[1]) if self.place is not None else offered

    def count(self, action_name: str) -> None:
        """The episode took ``action_name`` at the decision's place."""
        if self.place is not None:
            self.counts.setdefault(self.place, Counter())[action_name] += 1
        self.place, self.offered = None, None
