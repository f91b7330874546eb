"""What generate mode adds to transformers' ``generate``: where a reply ends (the
end-of-turn token, or the close of the JSON object it opened), a stop asked for between
tokens, the rollout's own sampling (temperature, top-k, top-p, then one draw from the
caller's generator), and the replies and log-probabilities read back from its output.
:class:`Generation` runs one ``generate`` pass with them, for
:meth:`Policy.generate <llamagym.models.policy.Policy.generate>`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from transformers import (
    LogitsProcessorList,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from llamagym.models.decoder import cache_keyword, decoder_and_head, new_cache
from llamagym.models.passes import BatchedPasses, shared_prefix_length
from llamagym.models.turn_cache import TurnCache
from llamagym.models.turn_passes import Start, TurnCachePasses


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


class Generation:
    """Generate mode's pass: transformers' ``generate`` over a batch of prompts, each row
    started from its env's turn cache (``turn_passes``) or after the prompts' shared
    prefix, run once. It holds the tokenizer and its end-of-turn token, and the batched
    passes (``passes``: the model, its device, the padding token, the counters)."""

    def __init__(
        self, passes: BatchedPasses, turn_passes: TurnCachePasses, tokenizer: Any, eos_id: int
    ):
        self.passes = passes
        self.turn_passes = turn_passes
        self.tokenizer = tokenizer
        self.eos_id = eos_id

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        prefixes: list[str],
        keys: Sequence[Hashable] | None,
        max_new_tokens: int,
        processors: list[Any],
        should_stop: Callable[[], bool] | None,
    ) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
        """One pass over ``prompts``, sampled through ``processors``: each row's reply,
        its tokens' log-probabilities, and the prompts' last hidden states (what each
        value is read from)."""
        passes = self.passes
        input_ids, attention_mask, cache, turns, rows = self._inputs(prompts, keys)
        width = input_ids.shape[1]
        decoder, _ = decoder_and_head(passes.model)
        with first_output(decoder) as states:  # the prompts' last states, for the values
            # transformers' method: torch's stubs type module attributes Tensor | Module.
            output = passes.model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(passes.device),
                attention_mask=attention_mask.to(passes.device),
                max_new_tokens=max_new_tokens,
                **{cache_keyword(decoder): cache},
                # HF's greedy step picks the one token the sampling processor leaves
                # standing; with sampling off, HF adds no temperature/top-k/top-p warpers.
                do_sample=False,
                logits_processor=LogitsProcessorList(processors),
                pad_token_id=passes.pad_id,
                eos_token_id=self.eos_id,
                stopping_criteria=StoppingCriteriaList(
                    stopping_criteria(self.tokenizer, width, prefixes, should_stop)
                ),
                return_dict_in_generate=True,
                output_logits=True,  # before any processor: the policy's own
                # Each process generates on its own: a sharded model's parameters are
                # gathered for the whole rollout first (trl_backend/sharded.py), where
                # transformers would otherwise step every process together.
                synced_gpus=False,
            )
        new_tokens = output.sequences[:, width:]
        # A row's last position, per step.
        passes.counts.head_positions += new_tokens.shape[0] * len(output.logits)
        passes.counts.positions_run += new_tokens.shape[0] * (new_tokens.shape[1] - 1)
        token_logprobs = chosen_logprobs(output.logits, new_tokens)
        replies = cut_replies(self.tokenizer, self.eos_id, new_tokens.tolist(), prefixes)
        if turns is not None:
            assert keys is not None and cache is not None
            self.turn_passes.keep_turns(turns, keys, prompts, replies, rows, cache, width,
                                        new_tokens.shape[1])
        logprobs = [row[: len(r)] for row, r in zip(token_logprobs, replies, strict=True)]
        return replies, logprobs, states[0]

    def _inputs(
        self, prompts: Sequence[Sequence[int]], keys: Sequence[Hashable] | None
    ) -> tuple[torch.Tensor, torch.Tensor, Any, TurnCache | None, list[Start]]:
        """``generate``'s input ids, attention mask and cache: from the rows' turn caches
        where ``keys`` names their envs and the model keeps a plain cache
        (``TurnCachePasses.turn_inputs``), else after the prompts' shared prefix
        (:meth:`_shared_prefix_inputs`). Also the turn cache read (None: none) and each
        row's start in it. Counts the positions generate's first call will run: every
        row's columns after the cache it starts from."""
        turns = self.turn_passes.turns() if keys is not None else None
        rows: list[Start] = []
        if turns is not None:
            assert keys is not None
            input_ids, attention_mask, cache, rows = self.turn_passes.turn_inputs(
                prompts, keys, turns
            )
        else:
            input_ids, attention_mask, cache = self._shared_prefix_inputs(prompts)
        past_length = cache.get_seq_length() if cache is not None else 0
        self.passes.counts.positions_run += len(prompts) * (input_ids.shape[1] - past_length)
        return input_ids, attention_mask, cache, turns, rows

    def _shared_prefix_inputs(
        self, prompts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``generate``'s inputs without turn caches: the tokens all prompts share run
        once (their cache copied to every row), then each row's own tokens after its
        padding. The cache is None where the prompts share too little, or the model
        keeps none (then the whole prompts run as rows)."""
        passes = self.passes
        shared, cache = shared_prefix_length(prompts), None
        if shared:
            prefix = torch.tensor([prompts[0][:shared]])
            cache = new_cache(passes.model(input_ids=prefix.to(passes.device), use_cache=True))
            passes.counts.positions_run += shared
        input_ids, attention_mask = passes.left_padded(
            [prompt[shared if cache is not None else 0 :] for prompt in prompts]
        )
        if cache is not None:
            cache.batch_repeat_interleave(len(prompts))
            input_ids = torch.cat([prefix.expand(len(prompts), -1), input_ids], dim=1)
            attention_mask = torch.cat(
                [torch.ones(len(prompts), shared, dtype=attention_mask.dtype), attention_mask],
                dim=1,
            )
        return input_ids, attention_mask, cache
