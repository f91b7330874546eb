"""What generate mode adds to transformers' ``generate``: where a reply ends (the
end-of-turn token, or the close of the JSON object it opened), a stop asked for between
tokens, the rollout's own sampling (temperature, top-k, top-p, then one draw from the
caller's generator), and the replies and log-probabilities read back from its output.
:meth:`Policy.generate <llamagym.models.policy.Policy.generate>` puts them together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper


def closes_json(text: str) -> bool:
    """Whether ``text`` opened a JSON object and closed it (an action reply is flat)."""
    opened = text.find("{")
    return opened >= 0 and text.find("}", opened) >= 0


def reply_prefixes(reply_prefix: str | Sequence[str], rows: int) -> list[str]:
    """One reply prefix per row, from one for all rows or one per row."""
    if isinstance(reply_prefix, str):
        return [reply_prefix] * rows
    if len(reply_prefix) != rows:
        raise ValueError(f"{len(reply_prefix)} reply prefixes for {rows} prompts")
    return list(reply_prefix)


def json_closed_at(tokenizer, reply: list[int], prefix: str) -> list[int]:
    """``reply`` cut after the token that closes its JSON object, if one does."""
    if not closes_json(prefix + tokenizer.decode(reply, skip_special_tokens=True)):
        return reply
    for end in range(1, len(reply) + 1):
        if closes_json(prefix + tokenizer.decode(reply[:end], skip_special_tokens=True)):
            return reply[:end]
    return reply


class JsonClosed:
    """A stopping criterion: a row is done once its reply has closed its JSON object."""

    def __init__(self, tokenizer, width: int, prefixes: Sequence[str]):
        self.tokenizer, self.width, self.prefixes = tokenizer, width, prefixes

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        texts = self.tokenizer.batch_decode(input_ids[:, self.width :], skip_special_tokens=True)
        pairs = zip(self.prefixes, texts, strict=True)
        done = [closes_json(prefix + text) for prefix, text in pairs]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class StopRequested:
    """A stopping criterion: every row is done once ``should_stop()`` returns True."""

    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        stop = bool(self.should_stop())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def sampling_processors(
    temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> list:
    """Temperature, top-k and top-p (transformers' own warpers), then a draw."""
    processors: list = []
    if temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if top_k > 0:
        processors.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    processors.append(InverseCdfSample(generator))
    return processors


class InverseCdfSample:
    """A logits processor that draws the next token from ``softmax(scores)`` and leaves
    only that token standing (0, the rest -inf), so a greedy step takes the sample.

    One uniform number per row against the cumulative distribution: ``torch.multinomial``
    draws one per vocabulary entry on CPU, about 30x slower for 32 rows of 1,024 tokens.
    """

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        cdf = scores.float().softmax(-1).cumsum(-1)
        uniform = torch.rand(len(scores), 1, generator=self.generator).to(scores.device)
        # right=True: the first entry whose cumulative mass exceeds the draw, so a token
        # of probability 0 (masked by top-k/top-p) is never the one chosen.
        tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True)
        tokens = tokens.clamp(max=scores.shape[-1] - 1)
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens, 0.0)


def stopping_criteria(
    tokenizer, width: int, prefixes: Sequence[str], should_stop: Callable[[], bool] | None
) -> list:
    """generate's stopping criteria: a row is done once its reply (after column ``width``)
    closes its JSON object; every row once ``should_stop()`` says so (if given)."""
    criteria: list = [JsonClosed(tokenizer, width, prefixes)]
    if should_stop is not None:
        criteria.append(StopRequested(should_stop))
    return criteria


@contextlib.contextmanager
def first_output(module: nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that gets the last column of ``module``'s first output while the context
    is open: generate's first decoder call runs the prompts (later ones, a token each),
    so it holds the state each prompt's value is read from."""
    states: list[torch.Tensor] = []

    def keep(_module: nn.Module, _args: Any, output: Any) -> None:
        if not states:
            states.append(output[0][:, -1])

    hook = module.register_forward_hook(keep)
    try:
        yield states
    finally:
        hook.remove()


def chosen_logprobs(logits: Sequence[torch.Tensor], tokens: torch.Tensor) -> list[list[float]]:
    """Each generated token's log-probability under the model's plain softmax: ``logits``
    has one [rows, vocabulary] tensor per step (before any processor), ``tokens`` is
    [rows, steps]."""
    return torch.stack(
        [
            step.float().log_softmax(-1).gather(-1, tokens[:, t, None]).squeeze(-1)
            for t, step in enumerate(logits)
        ],
        dim=1,
    ).tolist()


def cut_replies(
    tokenizer, eos_id: int, tokens: Sequence[Sequence[int]], prefixes: Sequence[str]
) -> list[list[int]]:
    """Each row's reply as the rollout keeps it: up to and with the end-of-turn token (it
    is part of the action: the policy learns to stop), or the token that closes the JSON
    object it or its prefix opened, whichever comes first."""
    replies = []
    for row, opened in zip(tokens, prefixes, strict=True):
        reply = []
        for token in row:
            reply.append(token)
            if token == eos_id:
                break
        replies.append(json_closed_at(tokenizer, reply, opened))
    return replies
