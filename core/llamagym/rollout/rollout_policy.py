"""What the rollout engine asks of a policy: a tokenizer, the context length, and the
batched passes that score candidate actions and that generate replies."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol

import torch

from llamagym.models.legal_replies import ReplyTree
from llamagym.models.policy import Replies


class RolloutPolicy(Protocol):
    """What the engine asks of a policy: a tokenizer, the context length, and the
    batched passes that score candidates and that generate (and score) replies.
    :class:`~llamagym.models.policy.Policy` is one; a stand-in such as
    :class:`~llamagym.devtools.fake_model.FakePolicy` plays without a model. ``keys``
    name each row's episode in progress (its slot's key), so a policy may keep what a
    row's pass computed for the episode's next turn (Policy's turn cache); a policy
    with a ``drop_turn_cache(key)`` method is told when that episode is over.
    ``reply_trees`` (one per row, None: free) hold each row's reply to the tokens its
    tree allows (``rollout.legal_replies``)."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        reply_prefix: str | Sequence[str] = "",
        should_stop: Callable[[], bool] | None = None,
        keys: Sequence[Hashable] | None = None,
        reply_trees: Sequence[ReplyTree | None] | None = None,
    ) -> Replies: ...
