"""How an update groups and cuts its batch: episodes by the seed group they started
from, turns by the history they share, minibatches of an epoch, and the pieces of a
minibatch that go through one forward pass."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from llamagym.rollout.trajectory import Episode, Turn


def seed_groups(episodes: Sequence[Episode]) -> list[list[Episode]]:
    """Episodes grouped by the seed group the engine gave them, in batch order.

    Episodes without a group (the LlamaGym ``act``/``terminate_episode`` loop, which
    does not seed resets) form one group together: a batch-level baseline is the best
    that can be done for them.
    """
    groups: dict[int | None, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(episode.group, []).append(episode)
    return list(groups.values())


def history_groups(turns: Sequence[Turn]) -> list[list[int]]:
    """The turns that minibatches keep together, as positions in ``turns``: a turn whose
    prompt starts with another's (the turns of one episode with its history) joins that
    one's group, so a pass runs their shared tokens once (:func:`prefix_rows`); every
    other turn is a group of its own. Groups come in the order of their first turn
    (without history, ``[[0], [1], ...]``: shuffling them is shuffling the turns)."""
    ordered = sorted(range(len(turns)), key=lambda i: turns[i].prompt_tokens)
    group_of = list(range(len(turns)))
    for before, after in zip(ordered, ordered[1:], strict=False):
        first, then = turns[before].prompt_tokens, turns[after].prompt_tokens
        if len(first) < len(then) and then[: len(first)] == first:
            group_of[after] = group_of[before]
    groups: dict[int, list[int]] = {}
    for index in range(len(turns)):
        groups.setdefault(group_of[index], []).append(index)
    return sorted(groups.values(), key=lambda group: group[0])


def prompt_pieces(turns: Sequence[Turn], index: Iterable[int], size: int) -> list[list[int]]:
    """``index`` (positions in ``turns``) cut into forward passes of at most ``size``
    turns, in the order of their prompts, so turns that share a prompt go through the
    same pass: the policy computes a prompt, and a reply repeated after it, once per
    pass (a seed group's episodes all start from one prompt, and a small action space
    repeats replies)."""
    ordered = sorted(index, key=lambda i: turns[i].prompt_tokens)
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


def minibatches(order: Sequence[int], size: int, count: int) -> list[list[int]]:
    """The first ``count`` minibatches of ``size`` indices of ``order`` (the last may be
    shorter); ``count`` comes from :meth:`Algorithm.sync_minibatch_count`."""
    return [list(order[k * size : (k + 1) * size]) for k in range(count)]
