"""What a rollout pass's attention takes, estimated before the pass runs, and a batch's
rows split into passes that each stay within a bound.

A pass over ``rows`` rows, each running ``queries`` new tokens against ``keys`` keys
(its turn cache or shared prefix, then its own tokens and, in score mode, its
candidates' blocks), holds ``rows x queries x keys`` attention entries at once: a score
per head (:data:`ATTENTION_BYTES` each) and the block mask, which is built with a few
temporaries (:data:`MASK_BYTES`). The turn cache's kept states are bounded apart
(:data:`~llamagym.models.turn_cache.MAX_TURN_CACHE_BYTES`); this bounds the rest: a
pass may take :func:`pass_budget` bytes. Rows that together would take more run in
several passes, each within it; one row that alone would is refused, in one line,
before anything is allocated. Measured on this CPU (PyTorch's SDPA with a mask): ~54
bytes per entry for SmolLM2-135M's 9 heads, ~10 for the tiny model's 4.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamagym.config import machine_memory
from llamagym.errors import LlamaGymError

#: Bytes per attention entry and head: the score and its softmax, float32 at the most.
ATTENTION_BYTES = 4
#: Bytes per attention entry for the mask and the temporaries that build it.
MASK_BYTES = 24
#: The least a pass may take, whatever the machine's memory.
MIN_PASS_BYTES = 2**30


class PassTooLargeError(LlamaGymError):
    """One row of a rollout pass would take more memory than a pass may."""


def pass_budget() -> int:
    """Bytes one rollout pass may take: a quarter of this machine's memory, at least
    :data:`MIN_PASS_BYTES`."""
    return max(MIN_PASS_BYTES, machine_memory() // 4)


def attention_heads(model: Any) -> int:
    """The attention heads of ``model``'s layers, as its config names them (one where
    it names none)."""
    config = getattr(model, "config", None)
    for attribute in ("num_attention_heads", "n_head", "num_heads"):
        heads = getattr(config, attribute, None)
        if isinstance(heads, int) and heads > 0:
            return heads
    return 1


def entry_bytes(heads: int) -> int:
    """Bytes one attention entry (a query against a key) takes with ``heads`` heads."""
    return heads * ATTENTION_BYTES + MASK_BYTES


def pass_groups(
    shapes: Sequence[tuple[int, int]], heads: int, budget: int, what: str
) -> list[list[int]]:
    """The rows (``shapes``: each row's queries and keys) as consecutive groups whose
    pass each takes at most ``budget`` bytes (the widest row's queries and keys in every
    row of a group, as padding makes them); ``what`` names the pass in the error when
    one row alone takes more."""
    per_entry = entry_bytes(heads)
    groups: list[list[int]] = []
    queries = keys = 0
    for row, (row_queries, row_keys) in enumerate(shapes):
        alone = row_queries * row_keys * per_entry
        if alone > budget:
            raise PassTooLargeError(
                f"{what}: one prompt would run {row_queries:,} tokens against "
                f"{row_keys:,} in one pass, {alone / 2**30:,.1f} GiB of attention with "
                f"the model's {heads} heads, more than the {budget / 2**30:,.1f} GiB a "
                "pass may take on this machine; lower rollout.max_prompt_chars or "
                "rollout.history_turns (shorter prompts), or rollout.max_action_chars "
                "and the legal actions (score mode runs them all after the prompt)"
            )
        wider_queries, wider_keys = max(queries, row_queries), max(keys, row_keys)
        if groups and (len(groups[-1]) + 1) * wider_queries * wider_keys * per_entry <= budget:
            groups[-1].append(row)
            queries, keys = wider_queries, wider_keys
        else:
            groups.append([row])
            queries, keys = row_queries, row_keys
    return groups
