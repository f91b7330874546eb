"""The trainable policy: a causal LM, its tokenizer and a value head, with the batched
forward passes the rollout engine and the algorithms share.

Both action modes come out as the same shape so every algorithm has one code path:
per turn, log-probabilities of its "action units" with a mask (one unit, the chosen
candidate, in score mode; the reply tokens in generate mode), a value and an entropy.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Evaluation:
    """Per-turn quantities a loss needs; ``logprobs``/``entropy``/``mask`` are [N, T]."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class Policy(nn.Module):
    def __init__(self, model: nn.Module, tokenizer, device: torch.device | str | None = None):
        super().__init__()
        # A TRL value-head wrapper (the original LlamaGym's model) holds the LM inside.
        model = getattr(model, "pretrained_model", model)
        self.model = model
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id
        self.device = torch.device(device) if device is not None else _model_device(model)
        hidden_size = _hidden_size(model)
        self.value_head = nn.Linear(hidden_size, 1).to(self.device)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        self._reference: nn.Module | None = None
        self.max_context = _max_context(model, tokenizer)

    # -- parameters ----------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    @property
    def uses_adapter(self) -> bool:
        return _is_peft(self.model)

    # -- forward passes --------------------------------------------------------------
    @contextlib.contextmanager
    def _reference_context(self, reference: bool) -> Iterator[nn.Module]:
        if not reference:
            yield self.model
        elif self.uses_adapter:
            # The reference policy is the same weights with the adapter switched off:
            # no second copy of the model in memory.
            with self.model.disable_adapter():
                yield self.model
        else:
            if self._reference is None:
                raise RuntimeError("call policy.freeze_reference() before training starts")
            yield self._reference

    def freeze_reference(self) -> None:
        """Fix the KL reference policy at the current weights.

        With a LoRA adapter this costs nothing (the adapter is switched off instead);
        for full fine-tuning it keeps a frozen copy, affordable for small models only.
        """
        if self.uses_adapter or self._reference is not None:
            return
        self._reference = copy.deepcopy(self.model).eval()
        for parameter in self._reference.parameters():
            parameter.requires_grad_(False)

    def _left_padded(
        self, prompts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts as one left-padded batch (all end in the last column): ids and mask."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = padded(prompts, width, self.pad_id, left=True)
        attention_mask = padded([[1] * len(prompt) for prompt in prompts], width, 0, left=True)
        return input_ids, attention_mask

    def _continuations(
        self,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        reference: bool = False,
        entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probabilities of continuation tokens, for (prompt index, tokens) pairs.

        Returns per-token logprobs [P, T], their mask [P, T], per-token entropy [P, T]
        (if asked) and the hidden state at each pair's last prompt token [P, H].

        Each distinct prompt runs through the model once (left-padded, so all end in the
        same column); the continuations after it reuse its key/value cache. Scoring A
        candidates costs one prompt row, not A, and a prompt met in many turns (a small
        state space such as Blackjack's repeats prompts all the time) is computed once.
        """
        slot_of: dict[tuple[int, ...], int] = {}
        for prompt_index, _ in pairs:
            slot_of.setdefault(tuple(prompts[prompt_index]), len(slot_of))
        distinct = list(slot_of)
        input_ids, attention_mask = self._left_padded(distinct)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        lengths = torch.tensor([len(tokens) for _, tokens in pairs])
        keep = int(lengths.max())
        pair_slots = torch.tensor([slot_of[tuple(prompts[index])] for index, _ in pairs])
        with self._reference_context(reference) as model:
            # 1. Every prompt once: each continuation's first-token distribution, the
            #    hidden state the value head reads, and the cache the continuations extend.
            output = model(
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                position_ids=position_ids.to(self.device),
                output_hidden_states=not reference,
                use_cache=keep > 1,
                logits_to_keep=1,
            )
            first = output.logits[:, -1].float().log_softmax(-1)[pair_slots.to(self.device)]
            log_dists = [first[:, None]]  # [P, 1, V]
            if keep > 1:
                # 2. The continuations' tokens but the last (which is only scored),
                #    right-padded, each row attending to its own prompt's cached keys.
                cache = output.past_key_values
                cache.batch_select_indices(pair_slots.to(self.device))
                tails = padded([tokens[:-1] for _, tokens in pairs], keep - 1, self.pad_id)
                prompt_lengths = attention_mask.sum(-1)[pair_slots]
                tail_positions = prompt_lengths[:, None] + torch.arange(keep - 1)[None, :]
                tail_ones = torch.ones(len(pairs), keep - 1, dtype=torch.long)
                tail_mask = torch.cat([attention_mask[pair_slots], tail_ones], dim=1)
                tail_output = model(
                    input_ids=tails.to(self.device),
                    attention_mask=tail_mask.to(self.device),
                    position_ids=tail_positions.to(self.device),
                    past_key_values=cache,
                    use_cache=True,
                )
                log_dists.append(tail_output.logits.float().log_softmax(-1))  # [P, keep-1, V]
        dist = torch.cat(log_dists, dim=1)  # [P, keep, V]: column t predicts token t
        mask = (torch.arange(keep)[None, :] < lengths[:, None]).float().to(self.device)
        targets = padded([tokens for _, tokens in pairs], keep, 0)
        token_logprobs = dist.gather(-1, targets.to(self.device)[..., None]).squeeze(-1) * mask
        token_entropy = -(dist.exp() * dist).sum(-1) * mask if entropy else None
        state_hidden = None
        if not reference:
            state_hidden = output.hidden_states[-1][pair_slots.to(self.device), -1]
        return token_logprobs, mask, token_entropy, state_hidden

    def _values(self, state_hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(state_hidden.float()).squeeze(-1)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each legal action string after its prompt.

        Returns ``scores`` [N, A] (mean log-likelihood per token, -inf where a prompt has
        fewer than A candidates) and ``values`` [N].
        """
        pairs = [(i, option) for i, options in enumerate(candidates) for option in options]
        owners = [(i, j) for i, options in enumerate(candidates) for j in range(len(options))]
        token_logprobs, mask, _, state_hidden = self._continuations(prompts, pairs, reference)
        option_scores = token_logprobs.sum(-1) / mask.sum(-1)
        num_actions = max(len(options) for options in candidates)
        scores = torch.full((len(prompts), num_actions), float("-inf"), device=self.device)
        owner_rows = torch.tensor([i for i, _ in owners], device=self.device)
        owner_cols = torch.tensor([j for _, j in owners], device=self.device)
        scores = scores.index_put((owner_rows, owner_cols), option_scores)
        if reference:
            return scores, torch.zeros(len(prompts), device=self.device)
        first_option = torch.tensor([k for k, (_, j) in enumerate(owners) if j == 0])
        return scores, self._values(state_hidden[first_option.to(self.device)])

    def evaluate_choices(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        chosen: Sequence[int],
        temperature: float = 1.0,
    ) -> Evaluation:
        """Score mode: log-probability of the chosen candidate among all of them."""
        scores, values = self.score(prompts, candidates)
        log_policy = (scores / temperature).log_softmax(-1)
        index = torch.tensor(chosen, device=self.device)[:, None]
        logprobs = log_policy.gather(-1, index)
        probs = log_policy.exp()
        entropy = -(probs * log_policy.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)
        mask = torch.ones_like(logprobs)
        return Evaluation(logprobs, entropy, mask, values)

    def evaluate_replies(
        self,
        prompts: Sequence[Sequence[int]],
        replies: Sequence[Sequence[int]],
        reference: bool = False,
    ) -> Evaluation:
        """Generate mode: per-token log-probabilities of each reply after its prompt."""
        pairs = [(i, reply) for i, reply in enumerate(replies)]
        logprobs, mask, entropy, state_hidden = self._continuations(
            prompts, pairs, reference, entropy=not reference
        )
        if reference:
            zeros = torch.zeros(len(replies), device=self.device)
            return Evaluation(logprobs, torch.zeros_like(logprobs), mask, zeros)
        return Evaluation(logprobs, entropy, mask, self._values(state_hidden))

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
    ) -> list[list[int]]:
        """Sample one reply per prompt in one batched ``generate`` (left padding).

        Sampling draws from ``generator`` (the caller's seeded state), so a run's replies
        repeat with its seed. The model's own sampling settings (a chat model's
        temperature or top-p) do not apply: the rollout settings are the one source.
        """
        from transformers import LogitsProcessorList

        input_ids, attention_mask = self._left_padded(prompts)
        width = input_ids.shape[1]
        processors = LogitsProcessorList()
        if not greedy:
            processors.extend(sampling_processors(temperature, top_p, top_k, generator))
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            max_new_tokens=max_new_tokens,
            # HF's greedy step picks the one token the sampling processor leaves standing;
            # with sampling off, HF adds no temperature/top-k/top-p warpers of its own.
            do_sample=False,
            logits_processor=processors,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        replies = []
        for row in output[:, width:].tolist():
            reply = []
            for token in row:
                reply.append(token)
                if token == self.eos_id:
                    break  # the end-of-turn token is part of the action: it learns to stop
            replies.append(reply)
        return replies


def sampling_processors(
    temperature: float, top_p: float, top_k: int, generator: torch.Generator | None
) -> list:
    """Temperature, top-k and top-p (transformers' own warpers), then a draw."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

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


def padded(
    rows: Sequence[Sequence[float]],
    width: int,
    fill: float = 0,
    left: bool = False,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """Rows of numbers as one [len(rows), width] tensor: each row cut to ``width`` and
    filled up with ``fill`` on the right (or on the left)."""
    table = []
    for row in rows:
        row = list(row[:width])
        filling = [fill] * (width - len(row))
        table.append(filling + row if left else row + filling)
    return torch.tensor(table, dtype=dtype).reshape(len(rows), width)


def _model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _hidden_size(model: nn.Module) -> int:
    config = model.config
    for attribute in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, attribute, None):
            return int(getattr(config, attribute))
    return int(model.get_input_embeddings().embedding_dim)


def _max_context(model: nn.Module, tokenizer) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:
        limit = min(limit, tokenizer_limit)
    return int(limit)
