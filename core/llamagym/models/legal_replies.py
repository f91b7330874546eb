"""Replies held to the legal actions (generate mode with ``rollout.legal_replies``): a
row's reply may only follow the tokens of one of its legal actions' replies, then end.

:class:`ReplyTree` holds one row's allowed token sequences as a map from the tokens
written so far to the tokens that may follow; :class:`LegalReplies` is the logits
processor that masks every other token, before temperature, top-k, top-p and the draw
(or the greedy pick). The log-probabilities a rollout records are the model's plain
softmax, read before any processor, as with top-k: the update scores the same tokens
the same way, so the constraint shapes what is sampled, not what is trained.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

#: Token sequences one row's tree holds at most (a turn's legal actions are bounded
#: below this by the env checks).
MAX_SEQUENCES = 65_536


class ReplyTree:
    """The next tokens allowed after each prefix of a set of token sequences."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        if len(sequences) > MAX_SEQUENCES:
            raise ValueError(f"{len(sequences):,} replies for one row; at most {MAX_SEQUENCES:,}")
        following: dict[tuple[int, ...], set[int]] = {}
        for sequence in sequences:
            for end in range(len(sequence)):
                following.setdefault(tuple(sequence[:end]), set()).add(int(sequence[end]))
        self.following = {made: sorted(tokens) for made, tokens in following.items()}

    def allowed(self, made: Sequence[int]) -> list[int] | None:
        """The tokens that may follow ``made``; None once ``made`` left the tree (a row
        that has ended: generate pads it) or completed a sequence."""
        return self.following.get(tuple(made))

    def __bool__(self) -> bool:
        return bool(self.following)


class LegalReplies:
    """A logits processor: each row with a tree (None: free) may take only the tokens its
    tree allows after what the row has written in this ``generate`` call. It counts its
    calls, so it needs no prompt width: call k has k tokens written."""

    def __init__(self, trees: Sequence[ReplyTree | None]):
        self.trees = list(trees)
        self.calls = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        written = self.calls
        self.calls += 1
        keep = torch.ones_like(scores, dtype=torch.bool)
        for row, tree in enumerate(self.trees):
            if tree is None:
                continue
            made = input_ids[row, input_ids.shape[1] - written :].tolist() if written else []
            allowed = tree.allowed(made)
            if allowed is None:
                continue
            keep[row] = False
            keep[row, allowed] = True
        # A new tensor: generate keeps the tensor it passed in as the step's raw logits.
        return scores.masked_fill(~keep, float("-inf"))


def legal_reply_text(prefix: str, action: str) -> str:
    """The reply, after ``prefix``, that writes ``action``: the rest of the action where
    the prefix begins it (``[`` then ``1 2 3 4]``), the action as a JSON string closed
    where the prefix opened one (``{"action": "`` then ``hit"}``), else the action."""
    opened = prefix.rfind("{")
    if opened >= 0 and prefix.find("}", opened) < 0:
        inside_string = prefix[opened:].count('"') % 2 == 1
        return json.dumps(action)[1:-1] + '"}' if inside_string else json.dumps(action) + "}"
    return action[len(prefix):] if prefix and action.startswith(prefix) else action
