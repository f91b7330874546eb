"""Each rollout env's key/value cache from its last turn, so the next turn runs only its
new tokens.

With history (``rollout.history_turns``: ``null`` for the whole episode, or a window),
turn t's prompt is turn t-1's prompt, then the reply or action chosen, then the new
observation: everything before the new observation already ran through the model last
turn, for the same env. :class:`TurnCache` keeps, per key the engine gives (one per
episode in progress), the tokens a turn's pass ran and their keys and values in every
layer (and, with a frozen trunk, the trunk's output for them). The next turn under the
same key runs only the tokens after the longest common token prefix of the kept tokens
and the new prompt. The common prefix is computed on tokens, never assumed: the chat
template's rendering of the assistant turn, or a window that shifts old turns out (then
the common part falls back to the system prompt), decides how much is reused, and a
result is the same whichever it is.

Kept states are only valid for the weights that made them: any in-place change of a
trainable parameter (an optimizer step, a loaded checkpoint) empties the cache
(:meth:`TurnCache.check_weights`). Memory is bounded by :data:`MAX_TURN_CACHE_BYTES`;
past it, each env keeps a shorter prefix (the same length for all, the longest cut
first), and what is not kept is re-encoded next turn.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import torch

#: What the kept keys and values (and trunk states) may take at once: SmolLM2-135M costs
#: about 46 KB per token in float32 (30 layers x keys and values x 3 heads x 64 x 4 B),
#: so 1 GiB holds ~23,000 tokens: 8 envs' conversations of ~2,900 tokens each.
MAX_TURN_CACHE_BYTES = 2**30


@dataclass
class Kept:
    """What one env's last pass ran: its ``tokens``, each layer's keys and values for
    them ([heads, len, dim] each) and the frozen trunk's output [len, hidden] (None
    without a trunk, or where a pass did not give it)."""

    tokens: tuple[int, ...]
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    trunk: torch.Tensor | None = None

    @property
    def bytes(self) -> int:
        tensors = [t for pair in self.layers for t in pair]
        if self.trunk is not None:
            tensors.append(self.trunk)
        return sum(t.numel() * t.element_size() for t in tensors)

    def cut(self, length: int) -> Kept:
        """The first ``length`` tokens' states, copied (a slice of a pass's batch
        tensors would keep the whole batch alive)."""
        return Kept(
            self.tokens[:length],
            [(k[:, :length].clone(), v[:, :length].clone()) for k, v in self.layers],
            None if self.trunk is None else self.trunk[:length].clone(),
        )


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading tokens ``first`` and ``second`` share."""
    length = min(len(first), len(second))
    for index in range(length):
        if first[index] != second[index]:
            return index
    return length


class TurnCache:
    """Per key (an env's episode in progress) the :class:`Kept` states of its last turn.

    ``runs`` lists, per pass that read it, how many tokens each distinct prompt ran
    (its own, after what was reused): what a test or a benchmark counts."""

    def __init__(self, limit_bytes: int = MAX_TURN_CACHE_BYTES):
        self.limit_bytes = limit_bytes
        self.entries: dict[Hashable, Kept] = {}
        self.weights: tuple[int, ...] | None = None
        self.runs: list[list[int]] = []

    @property
    def bytes(self) -> int:
        """The memory the kept states take (an entry kept under several keys, as rows of
        one prompt share, counts once)."""
        return sum(kept.bytes for kept in {id(k): k for k in self.entries.values()}.values())

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s states (its episode ended)."""
        self.entries.pop(key, None)

    def clear(self) -> None:
        self.entries.clear()

    def check_weights(self, parameters: Iterable[torch.Tensor]) -> None:
        """Empty the cache if any of the trainable ``parameters`` changed in place since
        the states were kept (torch counts every in-place change in ``_version``)."""
        versions = tuple(p._version for p in parameters)
        if versions != self.weights:
            self.entries.clear()
            self.weights = versions

    def match(self, key: Hashable, prompt: Sequence[int]) -> tuple[Kept | None, int]:
        """``key``'s kept states and how many of ``prompt``'s tokens they hold (at most
        all but the last, whose position predicts what follows)."""
        kept = self.entries.get(key)
        if kept is None:
            return None, 0
        return kept, min(common_prefix(kept.tokens, prompt), len(prompt) - 1)

    def keep(self, new: dict[Hashable, Kept]) -> None:
        """Keep ``new`` (key -> states; keys may share one :class:`Kept`) in place of
        those keys' states, within :attr:`limit_bytes`. Where all do not fit, every new
        entry is cut to the same longest length that fits (the longest ones lose
        tokens first; the others' states stay whole): each env then re-encodes only
        its tokens past that length, and no env loses its whole cache to another's
        long conversation. Nothing fits: those keys keep nothing."""
        for key in new:
            self.entries.pop(key, None)
        budget = self.limit_bytes - self.bytes
        distinct = list({id(k): k for k in new.values()}.values())
        per_token = {id(k): k.bytes / max(len(k.tokens), 1) for k in distinct}
        longest = max((len(k.tokens) for k in distinct), default=0)

        def cost(cap: int) -> float:
            return sum(min(len(k.tokens), cap) * per_token[id(k)] for k in distinct)

        low, high = 0, longest  # the largest cap whose cost fits the budget
        while low < high:
            middle = (low + high + 1) // 2
            if cost(middle) <= budget:
                low = middle
            else:
                high = middle - 1
        if low == 0:
            return
        cut = {id(k): k.cut(min(len(k.tokens), low)) for k in distinct}
        for key, kept in new.items():
            self.entries[key] = cut[id(kept)]


def stacked_past(
    rows: Sequence[tuple[Kept | None, int]], layers: int, like: Kept
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """The rows' kept keys and values as one batch: each row's first ``length`` tokens,
    left-padded (zeros) to the longest, per layer [rows, heads, longest, dim]; and that
    longest length. ``like`` gives the shapes and dtype."""
    longest = max(length for _, length in rows)
    past = []
    for layer in range(layers):
        keys, values = like.layers[layer]
        shape = (len(rows), keys.shape[0], longest, keys.shape[-1])
        stacked_keys = keys.new_zeros(shape)
        stacked_values = values.new_zeros((*shape[:3], values.shape[-1]))
        for row, (kept, length) in enumerate(rows):
            if kept is not None and length:
                stacked_keys[row, :, longest - length :] = kept.layers[layer][0][:, :length]
                stacked_values[row, :, longest - length :] = kept.layers[layer][1][:, :length]
        past.append((stacked_keys, stacked_values))
    return past, longest
