"""The batched passes of the policy: each a list of (prompt, continuation) pairs in one
decoder call, laid out so that every distinct prompt is one row and its distinct
continuations follow it side by side, each behind its own block of the attention mask.

:class:`BatchedPasses` lays a pass out, runs it (whole, after a shared prefix run once, or
the layers above a kept frozen trunk only) and reads log-probabilities through the LM
head at the positions that need them. The functions before it say how a batch is laid
out: padding, the shared prefix, the rows an episode's turns share, the mask.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from llamagym.models.decoder import (
    cache_keyword,
    cache_layers,
    new_cache,
    prefix_cache_class,
    uses_additive_mask,
)
from llamagym.models.trunk import PassLayout, TrunkStates, top_layers

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer

logger = logging.getLogger(__name__)


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


# Running a shared prefix is one more model call (about a millisecond for the tiny
# model on CPU): worth it once it spares the batch at least this many token positions.
MIN_SHARED_TOKENS = 64


def shared_prefix_length(prompts: Sequence[Sequence[int]], rows: int | None = None) -> int:
    """How many leading tokens all ``prompts`` have in common (leaving each at least
    one token of its own, the position that predicts the continuation), or 0 where
    computing them once would spare fewer than ``MIN_SHARED_TOKENS`` positions over the
    pass's ``rows`` (default: one per prompt)."""
    first = prompts[0]
    limit = min(len(prompt) for prompt in prompts) - 1
    length = 0
    while length < limit and all(prompt[length] == first[length] for prompt in prompts):
        length += 1
    rows = len(prompts) if rows is None else rows
    return length if length * (rows - 1) >= MIN_SHARED_TOKENS else 0


def length_groups(lengths: Sequence[int], overhead: int = MIN_SHARED_TOKENS) -> list[list[int]]:
    """Rows of a pass (their ``lengths``: the token positions each runs) in groups, one
    pass each, so that the padding paid for is least: every row of a group runs as many
    positions as its longest, and each pass beyond the first costs ``overhead``
    positions more. Each group holds rows of neighbouring lengths, shortest first; the
    split is the cheapest such one (a dynamic programme over the rows sorted by length).
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    if len(order) < 2:
        return [order] if order else []
    sorted_lengths = torch.tensor([lengths[i] for i in order], dtype=torch.float64)
    # best[j]: the least cost of the first j sorted rows; start[j]: where its last group
    # starts. A group of rows i..j-1 costs (j - i) * length[j - 1] + overhead.
    best = torch.zeros(len(order) + 1, dtype=torch.float64)
    start = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        firsts = torch.arange(end, dtype=torch.float64)
        costs = best[:end] + (end - firsts) * sorted_lengths[end - 1] + overhead
        at = int(torch.argmin(costs))
        best[end], start[end] = costs[at], at
    groups: list[list[int]] = []
    end = len(order)
    while end > 0:
        groups.append(order[start[end]:end])
        end = start[end]
    return groups[::-1]


def prefix_rows(prompts: Sequence[tuple[int, ...]]) -> tuple[list[int], list[tuple[int, ...]]]:
    """Rows for distinct ``prompts`` where a prompt that starts another one goes into
    that one's row (with its history, an episode's turns all fit in the row of its last
    turn's prompt): each prompt's row, and each row's prompt (the longest in it). In
    sorted order, a prompt that starts any later prompt starts the very next one."""
    order = sorted(range(len(prompts)), key=prompts.__getitem__)
    tip_of = list(range(len(prompts)))
    for before, after in zip(reversed(order[:-1]), reversed(order[1:]), strict=True):
        first, then = prompts[before], prompts[after]
        if len(first) < len(then) and then[: len(first)] == first:
            tip_of[before] = tip_of[after]
    row_of_tip: dict[int, int] = {}
    rows = [row_of_tip.setdefault(tip_of[i], len(row_of_tip)) for i in range(len(prompts))]
    return rows, [prompts[tip] for tip in row_of_tip]


def block_causal_mask(
    prompt_mask: torch.Tensor, segment: torch.Tensor, past: torch.Tensor, ends: torch.Tensor
) -> torch.Tensor:
    """Which key each query may attend to, [rows, 1, columns, past + columns].

    Columns are a row's (left-padded) prompt followed by its continuations' tokens;
    ``segment`` numbers the continuation each tail column belongs to (-1: padding), and
    ``ends`` gives, per continuation, the column where its own prompt ends (the row's
    last prompt column, or an earlier one for a prompt the row's prompt starts with).
    ``past`` [rows, P] says which keys before the columns (a shared prefix, or a row's
    turn cache, left-padded) are real for each row. A query sees those, the real prompt
    tokens up to itself (a tail: up to its prompt's end) and, in a tail, the earlier
    tokens of its own continuation. Every query also sees itself, so a padding query has
    somewhere to attend (an empty row would make NaNs).
    """
    rows, width = prompt_mask.shape
    columns = width + segment.shape[1]
    index = torch.arange(columns)
    real = torch.cat([prompt_mask, segment >= 0], dim=1)  # [rows, columns]
    group = torch.cat([torch.full((rows, width), -2), segment], dim=1)
    in_prompt = index < width
    # The last prompt column each query sees: itself in the prompt, its prompt's end in
    # a tail.
    tail_ends = ends[segment.clamp(min=0)] if len(ends) else segment
    sees = torch.cat([index[:width].expand(rows, width), tail_ends], dim=1)
    allowed = (
        real[:, None, :]
        & (
            (in_prompt[None, None, :] & (index[None, None, :] <= sees[:, :, None]))
            | (
                ~in_prompt[None, None, :]
                & (index[:, None] >= index[None, :])[None]
                & (group[:, :, None] == group[:, None, :])
            )
        )
    ) | torch.eye(columns, dtype=torch.bool)[None]
    prefix = past[:, None, :].expand(rows, columns, past.shape[1])
    return torch.cat([prefix, allowed], dim=2)[:, None]


def row_tails(
    rows: int, unique: Sequence[tuple[int, Sequence[int]]], owners: Sequence[Sequence[int]]
) -> tuple[list[list[int]], list[list[int]], list[list[int]], list[int]]:
    """What follows each of ``rows`` prompts in a pass: each distinct continuation's
    tokens but the last (which is only predicted), side by side after its row's prompt
    (``unique``: row, tokens; ``owners``: each one's prompt). Per row: the tokens, which
    continuation each column holds (its segment) and the columns' positions; and per
    continuation, where it starts in its row's tail."""
    tails: list[list[int]] = [[] for _ in range(rows)]
    segments: list[list[int]] = [[] for _ in range(rows)]
    positions: list[list[int]] = [[] for _ in range(rows)]
    starts = []
    for k, (row, tokens) in enumerate(unique):
        n = max(len(tokens) - 1, 0)
        starts.append(len(tails[row]))
        tails[row] += tokens[:n]
        segments[row] += [k] * n
        positions[row] += range(len(owners[k]), len(owners[k]) + n)
    return tails, segments, positions, starts


# Positions whose vocabulary-wide log-softmax is computed at once (see _head_logprobs).
HEAD_CHUNK = 256

# How far (relative to the largest hidden value) a pass from the kept trunk may be from
# a whole pass: float32 sums in another order differ by ~1e-6 of it.
TRUNK_TOLERANCE = 1e-4


@dataclass
class LaidOutPass:
    """One pass of :meth:`Policy._continuations`, laid out: where each token goes
    (``layout``), its inputs, and which row and distinct pair each asked pair reads."""

    layout: PassLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor
    pair_rows: list[int]
    pair_unique: list[int]


@dataclass
class PassCounts:
    """What the policy's passes ran, shared by its parts: LM-head positions (each a
    vocabulary-wide matmul) and decoder token positions (every row and column of its
    calls, padding included)."""

    head_positions: int = 0
    positions_run: int = 0


class BatchedPasses:
    """The policy's passes over (prompt, continuation) pairs: :meth:`lay_out` lays one
    out, :meth:`hidden` runs the decoder over it and :meth:`pair_logprobs` reads each
    pair's log-probabilities through the LM head.

    It holds what a pass needs: the causal LM (PEFT-wrapped or not), the device its
    inputs go to, the token that fills padding columns, the frozen trunk's kept states
    (:attr:`trunk`: None when every layer trains), the decoder layers checkpointed in
    passes that take gradients, and the counters it adds to. From the model it reads
    whether attention takes the mask as an additive bias (eager) or as booleans, and the
    final logit soft-capping (Gemma 2).
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        pad_id: int,
        trunk: TrunkStates | None,
        checkpointed_layers: list[GradientCheckpointingLayer],
        counts: PassCounts,
    ):
        self.model = model
        self.device = device
        self.pad_id = pad_id
        self.trunk = trunk
        self.checkpointed_layers = checkpointed_layers
        self.counts = counts
        self.additive_mask = uses_additive_mask(model)
        self.logit_softcap: float | None = getattr(model.config, "final_logit_softcapping", None)

    def left_padded(
        self, prompts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts as one left-padded batch (all end in the last column): ids and mask."""
        width = max(len(prompt) for prompt in prompts)
        input_ids = padded(prompts, width, self.pad_id, left=True)
        attention_mask = padded([[1] * len(prompt) for prompt in prompts], width, 0, left=True)
        return input_ids, attention_mask

    def lay_out(
        self,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        cached: dict[tuple[int, ...], int] | None = None,
    ) -> LaidOutPass:
        """The one pass that scores ``pairs`` (prompt index, continuation tokens): see
        ``Policy._continuations``. A prompt that starts another prompt of the pass shares
        that prompt's row (:func:`prefix_rows`). With ``cached`` (a distinct prompt ->
        how many of its first tokens a turn cache holds), each prompt is a row that runs
        its tokens after those, at their own positions, after its cache left-padded to
        the longest (see ``TurnCachePasses.hidden_from_turns``); else the prompts' shared
        prefix runs once."""
        prompt_of: dict[tuple[int, ...], int] = {}
        pair_prompts = [prompt_of.setdefault(tuple(prompts[i]), len(prompt_of)) for i, _ in pairs]
        distinct = list(prompt_of)
        if cached is None:
            row_of, tips = prefix_rows(distinct)
        else:
            row_of, tips = list(range(len(distinct))), distinct
        pair_rows = [row_of[prompt] for prompt in pair_prompts]
        unique_of: dict[tuple[int, tuple[int, ...]], int] = {}
        pair_unique = [
            unique_of.setdefault((prompt, tuple(tokens)), len(unique_of))
            for prompt, (_, tokens) in zip(pair_prompts, pairs, strict=True)
        ]
        owners = [distinct[prompt] for prompt, _ in unique_of]
        unique = [(row_of[prompt], tokens) for prompt, tokens in unique_of]
        shared = shared_prefix_length(distinct, rows=len(tips)) if cached is None else 0
        own = [cached[prompt] for prompt in tips] if cached is not None else None
        skipped = own if own is not None else [shared] * len(tips)
        prompt_ids, prompt_mask = self.left_padded(
            [prompt[start:] for prompt, start in zip(tips, skipped, strict=True)]
        )
        width = prompt_ids.shape[1]

        tails, segments, positions, starts = row_tails(len(tips), unique, owners)
        tail_width = max(len(tail) for tail in tails)
        starts_at = torch.tensor(skipped)[:, None]
        position_ids = torch.cat(
            [starts_at + (prompt_mask.cumsum(-1) - 1).clamp(min=0), padded(positions, tail_width)],
            dim=1,
        )
        layout = PassLayout(tips, unique, starts, shared, width, tail_width, own, owners)
        # The keys before the rows' own tokens (the shared prefix, or each row's cache
        # left-padded to the longest): which of them are real.
        longest = max(skipped)
        past = torch.arange(longest)[None, :] >= longest - starts_at
        ends = torch.tensor([layout.end_column(k) for k in range(len(unique))])
        allowed = block_causal_mask(
            prompt_mask.bool(), padded(segments, tail_width, -1), past, ends
        )
        return LaidOutPass(
            layout=layout,
            input_ids=torch.cat([prompt_ids, padded(tails, tail_width, self.pad_id)], dim=1),
            position_ids=position_ids.to(self.device),
            attention=self._attention_mask(allowed.to(self.device)),
            pair_rows=pair_rows,
            pair_unique=pair_unique,
        )

    def hidden(
        self, decoder: nn.Module, laid: LaidOutPass, reference: bool = False
    ) -> torch.Tensor:
        """The decoder's last hidden states over a pass: from the kept trunk where it
        holds every context of the pass (the layers above it only), else whole, and
        then, without gradients, kept for later passes."""
        layout, trunk = laid.layout, self.trunk
        kept = trunk.inputs(layout) if trunk is not None else None
        self.counts.positions_run += layout.shared + laid.input_ids.numel()
        if trunk is not None and kept is not None:
            with top_layers(decoder, trunk.start):
                return self._decoder_pass(decoder, *kept, laid.attention, laid.position_ids)
        shared = layout.shared
        prefix = torch.tensor([layout.prompts[0][:shared]]) if shared else None
        recording = trunk if trunk is not None and not torch.is_grad_enabled() else None
        seen: list[torch.Tensor] = []
        with recording.capturing(decoder, seen) if recording else contextlib.nullcontext():
            hidden = self._decoder_pass(
                decoder, prefix, laid.input_ids, laid.attention, laid.position_ids, reference
            )
        if recording is not None:
            recording.record(seen, layout)
            self._verify_trunk(decoder, laid, hidden)
        return hidden

    def pair_logprobs(
        self, head: nn.Module, laid: LaidOutPass, hidden: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Each asked pair's per-token log-probabilities [P, T] (in the order asked), their
        mask [P, T] and, with ``entropy``, each token's entropy [P, T], from the pass's
        ``hidden`` states. The LM head runs once per distinct pair's token, and only
        there: token t of pair k is predicted at its prompt's last column for t = 0, and
        at the column of its own previous token (width + start_k + t - 1) after that."""
        layout = laid.layout
        width, starts, unique = layout.width, layout.starts, layout.unique
        where = [
            (k, t, layout.end_column(k) if t == 0 else width + start + t - 1, token)
            for k, (start, (_, tokens)) in enumerate(zip(starts, unique, strict=True))
            for t, token in enumerate(tokens)
        ]
        unique_of_t, step_of, column_of, target_of = (
            torch.tensor(values, device=self.device) for values in zip(*where, strict=True)
        )
        unique_rows = torch.tensor([row for row, _ in unique], device=self.device)
        self.counts.head_positions += len(where)
        chosen, chosen_entropy = self._head_logprobs(
            head, hidden[unique_rows[unique_of_t], column_of], target_of, entropy
        )
        shape = (len(unique), max(len(tokens) for _, tokens in unique))
        at = (unique_of_t, step_of)
        mask = torch.zeros(shape, device=self.device).index_put(
            at, torch.ones((), device=self.device)
        )
        token_logprobs = torch.zeros(shape, device=self.device).index_put(at, chosen)
        # Back from the distinct pairs to the pairs as asked, in their order.
        order = torch.tensor(laid.pair_unique, device=self.device)
        if chosen_entropy is None:  # not asked for
            return token_logprobs[order], mask[order], None
        token_entropy = torch.zeros(shape, device=self.device).index_put(at, chosen_entropy)
        return token_logprobs[order], mask[order], token_entropy[order]

    def _decoder_pass(
        self,
        decoder: nn.Module,
        prefix: torch.Tensor | None,
        rows: torch.Tensor,
        attention: torch.Tensor,
        position_ids: torch.Tensor,
        reference: bool = False,
    ) -> torch.Tensor:
        """The decoder's last hidden states for a pass: the shared ``prefix`` (or None)
        run once as a cache, then the ``rows`` after it. Both are token ids, or hidden
        states (a kept trunk's output, which :func:`top_layers` feeds the top layers)."""
        key = "input_ids" if not rows.is_floating_point() else "inputs_embeds"
        cache = None
        if prefix is not None:
            prefix_cache = new_cache(decoder(**{key: prefix.to(self.device)}, use_cache=True))
            cache = prefix_cache_class()(cache_layers(prefix_cache))
        with self._checkpointing(torch.is_grad_enabled() and not reference):
            return decoder(
                **{key: rows.to(self.device)},
                attention_mask=attention,
                position_ids=position_ids,
                use_cache=False,
                **{cache_keyword(decoder): cache},
            ).last_hidden_state

    def _verify_trunk(self, decoder: nn.Module, laid: LaidOutPass, hidden: torch.Tensor) -> None:
        """Once, at the first pass recorded: run again from the kept states, it must give
        the whole pass's hidden states. A decoder that does more to its input than its
        layers do (OPT adds position embeddings) would not; then the trunk is not kept
        and every pass runs whole, as before."""
        trunk = self.trunk
        if trunk is None or trunk.verified or trunk.disabled:
            return
        kept = trunk.inputs(laid.layout)
        if kept is None:
            return
        with top_layers(decoder, trunk.start):
            again = self._decoder_pass(decoder, *kept, laid.attention, laid.position_ids)
        self.judge_trunk(again, hidden, laid.layout.real_columns().to(hidden.device))

    def judge_trunk(self, again: torch.Tensor, hidden: torch.Tensor, real: torch.Tensor) -> None:
        """Verify the trunk (or turn it off, with a warning) by how far a pass from its
        states (``again``) is from the whole pass (``hidden``) at the ``real`` columns."""
        trunk = self.trunk
        assert trunk is not None
        error = (again - hidden)[real].abs().max()
        scale = hidden[real].abs().max()
        if error <= TRUNK_TOLERANCE * scale:
            trunk.verified = True
            return
        trunk.disabled = True
        logger.warning(
            "this model's decoder does not run from its layers' inputs alone (a pass from "
            "the kept trunk differs by %.2g); every update pass runs all layers",
            float(error),
        )

    def _head_logprobs(
        self, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probability of each target token (and the entropy) from the hidden state
        that predicts it, ``HEAD_CHUNK`` positions at a time. A vocabulary-wide row costs
        4 bytes per entry several times over (logits, log-softmax, their gradients): in
        chunks, and recomputed in backward rather than stored, they never add up."""

        def chunk_logprobs(states: torch.Tensor, wanted: torch.Tensor):
            logits = head(states).float()
            if self.logit_softcap:
                logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
            dist = logits.log_softmax(-1)
            chosen = dist.gather(-1, wanted[:, None]).squeeze(-1)
            spread = -(dist.exp() * dist).sum(-1) if entropy else chosen.new_zeros(())
            return chosen, spread

        pieces = []
        for start in range(0, len(targets), HEAD_CHUNK):
            states, wanted = hidden[start : start + HEAD_CHUNK], targets[start : start + HEAD_CHUNK]
            if torch.is_grad_enabled():
                pieces.append(checkpoint(chunk_logprobs, states, wanted, use_reentrant=False))
            else:
                pieces.append(chunk_logprobs(states, wanted))
        chosen = torch.cat([piece[0] for piece in pieces])
        return chosen, torch.cat([piece[1] for piece in pieces]) if entropy else None

    def _attention_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean mask as the model's attention takes it: as is, or as an additive
        bias (0, or the dtype's minimum where a key is hidden) for eager attention."""
        if not self.additive_mask:
            return allowed
        # transformers' method: torch's stubs type module attributes Tensor | Module.
        dtype = self.model.get_input_embeddings().weight.dtype  # type: ignore[operator]
        dtype = dtype if dtype.is_floating_point else torch.float32
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return bias.masked_fill(~allowed, torch.finfo(dtype).min)

    @contextlib.contextmanager
    def _checkpointing(self, active: bool) -> Iterator[None]:
        """Gradient checkpointing for one pass: each decoder layer keeps only its input
        and recomputes the rest during backward. transformers checkpoints a layer whose
        own ``training`` flag is set, so the flag is set on the layers alone; attention
        and dropout inside them stay in eval mode. The prefix cache is read-only, so a
        layer may run twice."""
        layers = self.checkpointed_layers if active else []
        for layer in layers:
            layer.training, layer._can_checkpoint_with_cache = True, True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False
                del layer._can_checkpoint_with_cache
