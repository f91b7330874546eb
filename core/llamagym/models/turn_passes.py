"""The passes that start from each rollout env's turn cache (models/turn_cache.py): a
score pass runs each prompt's tokens after what its env kept from its last turn, and
``generate`` starts each row from it; both keep what they ran for the env's next turn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache

from llamagym.models.decoder import (
    cache_keyword,
    cache_layers,
    decoder_and_head,
    new_cache,
    prefix_cache_class,
)
from llamagym.models.pass_memory import pass_budget, pass_groups
from llamagym.models.passes import (
    BatchedPasses,
    LaidOutPass,
    length_groups,
    padded,
    shared_prefix_length,
)
from llamagym.models.trunk import PassLayout, TrunkStates, decoder_layers, top_layers
from llamagym.models.turn_cache import Kept, TurnCache, stacked_past

#: Per row of a pass: the kept states it starts from (None: nothing kept) and how many of
#: its prompt's first tokens they hold.
Start = tuple[Kept | None, int]


class TurnCachePasses:
    """The passes that start from each env's turn cache: which kept states each row
    starts from, the score pass that runs after them (:meth:`hidden_from_turns`),
    ``generate``'s inputs from them (:meth:`turn_inputs`) and what is kept for the next
    turn.

    It holds the turn cache (:attr:`cache`: a :class:`TurnCache`, or None for a model
    that keeps no plain key/value cache, found out by :meth:`turns` on first use), the
    model's attention heads (what a pass's attention memory grows with) and the
    batched passes (``passes``) whose model, layout and frozen trunk it runs with.
    """

    def __init__(self, passes: BatchedPasses, attention_heads: int, cache: TurnCache | None):
        self.passes = passes
        self.attention_heads = attention_heads
        self.cache = cache
        self._checked = False

    def turns(self) -> TurnCache | None:
        """The turn cache, emptied if the weights changed since it was kept; None where
        the model keeps no plain key/value cache (found out once, from one token: a
        model whose cache is not one full ``DynamicLayer`` per layer, a sliding window
        or a recurrent state, runs every prompt whole)."""
        cache = self.cache
        if cache is None:
            return None
        if not self._checked:
            self._checked = True
            passes = self.passes
            decoder = decoder_and_head(passes.model)[0]
            with torch.no_grad():
                probe = new_cache(
                    decoder(input_ids=torch.tensor([[passes.pad_id]], device=passes.device),
                            use_cache=True)
                )
            plain = probe is not None and all(
                type(layer).__name__ == "DynamicLayer" for layer in getattr(probe, "layers", [])
            )
            if not plain or decoder_layers(decoder) is None:
                self.cache = None
                return None
        cache.check_weights(p for p in self.passes.model.parameters() if p.requires_grad)
        return cache

    def row_groups(
        self,
        prompts: Sequence[Sequence[int]],
        tails: Sequence[int],
        new_tokens: int,
        keys: Sequence[Hashable] | None,
        what: str,
    ) -> list[list[int]]:
        """The rows of a pass over ``prompts`` in groups that each fit a pass's memory
        (models/pass_memory.py): each row runs its tokens after what its env's turn cache
        holds (``keys``; the whole prompt without) and its ``tails`` (score mode's
        candidates), against those and ``new_tokens`` more (a generation's). A rollout's
        score pass (turn caches, no new tokens) is first split by the rows' lengths, so
        that little padding is run (:func:`length_groups`); the groups then hold rows in
        another order than ``prompts``."""
        turns = self.turns() if keys is not None and not torch.is_grad_enabled() else None
        kept = (
            [turns.match(key, prompt)[1] for key, prompt in zip(keys, prompts, strict=True)]
            if turns is not None and keys is not None
            else [0] * len(prompts)
        )
        shapes = [
            (len(prompt) - held + tail, len(prompt) + tail + new_tokens)
            for prompt, held, tail in zip(prompts, kept, tails, strict=True)
        ]
        by_length = (
            length_groups([queries for queries, _ in shapes])
            if turns is not None and new_tokens == 0
            else [list(range(len(shapes)))]
        )
        return [
            [rows[i] for i in group]
            for rows in by_length
            for group in pass_groups(
                [shapes[row] for row in rows], self.attention_heads, pass_budget(), what
            )
        ]

    def drop(self, key: Hashable) -> None:
        """Forget what the turn cache keeps for ``key`` (its env's episode ended)."""
        if self.cache is not None:
            self.cache.drop(key)

    def _run_prefix(
        self, decoder: nn.Module, tokens: Sequence[int], trunk: TrunkStates | None
    ) -> Kept:
        """Run ``tokens`` (the prefix a batch's prompts share) once: their keys and values
        (and trunk states), as a turn cache would keep them."""
        states: list[torch.Tensor] = []
        with trunk.capturing(decoder, states) if trunk else contextlib.nullcontext():
            output = decoder(input_ids=torch.tensor([list(tokens)], device=self.passes.device),
                             use_cache=True)
        self.passes.counts.positions_run += len(tokens)
        layers = [(keys[0], values[0]) for keys, values in cache_layers(new_cache(output))]
        return Kept(tuple(tokens), layers, states[0][0] if states else None)

    def _cached_rows(
        self,
        decoder: nn.Module,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable],
        turns: TurnCache,
        trunk: TrunkStates | None,
    ) -> list[Start]:
        """Per prompt, the kept states it starts from and how many of its tokens they
        hold: its key's, or the prefix all the prompts share (run once here) where that
        is longer (a first turn; a window that shifted an old turn out)."""
        rows = [turns.match(key, prompt) for key, prompt in zip(keys, prompts, strict=True)]
        shared = shared_prefix_length(prompts)
        if any(length < shared for _, length in rows):
            prefix = self._run_prefix(decoder, prompts[0][:shared], trunk)
            rows = [(prefix, shared) if row[1] < shared else row for row in rows]
        return rows

    def hidden_from_turns(
        self,
        decoder: nn.Module,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        keys: Sequence[Hashable],
        turns: TurnCache,
    ) -> tuple[LaidOutPass, torch.Tensor]:
        """A rollout pass (no gradients) that runs each prompt's tokens after what its
        env's turn cache holds, then keeps each env's prompt for its next turn.

        Each distinct prompt is a row that starts from the longest kept prefix among the
        envs that have it. The rows' kept keys and values are left-padded to the longest
        (padding masked out) before the rows' own tokens, which run at their own positions
        (explicit position ids); the candidates' blocks follow as in ``BatchedPasses.lay_out``.
        The candidates are not kept: the next prompt renders the chosen action through
        the chat template, and the common prefix of tokens decides what is reused. A
        window (``rollout.history_turns: N``) shifts the oldest turn out every turn, so
        the common prefix is the system prompt (and template) alone: the numbers are the
        same, the pass only no cheaper than without a cache. With a frozen trunk, its
        output for each whole prompt (the kept part's, kept with the cache, then the
        pass's) is recorded as a whole pass would, so the update finds it.
        """
        trunk = self.passes.trunk
        trunk = trunk if trunk is not None and not trunk.disabled else None
        rows = self._cached_rows(decoder, prompts, keys, turns, trunk)
        best: dict[tuple[int, ...], Start] = {}
        for prompt, (kept, length) in zip(prompts, rows, strict=True):
            held = best.get(tuple(prompt))
            if held is None or length > held[1]:
                best[tuple(prompt)] = (kept, length)
        cached = {p: length for p, (_, length) in best.items()}
        laid = self.passes.lay_out(prompts, pairs, cached=cached)
        layout = laid.layout
        row_starts = [best[prompt] for prompt in layout.prompts]
        past, longest = stacked_starts(decoder, row_starts)
        recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        seen: list[torch.Tensor] = []
        cache = prefix_cache_class()(past, recorded)
        with trunk.capturing(decoder, seen) if trunk else contextlib.nullcontext():
            hidden = decoder(
                input_ids=laid.input_ids.to(self.passes.device),
                attention_mask=laid.attention,
                position_ids=laid.position_ids,
                use_cache=False,
                **{cache_keyword(decoder): cache},
            ).last_hidden_state
        self.passes.counts.positions_run += laid.input_ids.numel()
        # The trunk's output for what each row's cache held (None: its cache kept none).
        before: list[torch.Tensor | None] = []
        for kept, length in row_starts if seen else []:
            if not length:
                before.append(seen[-1].new_zeros((0, seen[-1].shape[-1])))
            else:
                assert kept is not None
                before.append(kept.trunk[:length] if kept.trunk is not None else None)
        if trunk is not None:
            trunk.record(seen, layout, before)
            self._verify_trunk(decoder, laid, hidden, seen[-1], past)
        layers = [recorded[layer] for layer in range(len(decoder_layers(decoder) or []))]
        made = kept_prompts(layout, row_starts, layers, (past, longest), before,
                            seen[-1] if seen else None)
        turns.keep({key: made[tuple(prompt)] for key, prompt in zip(keys, prompts, strict=True)})
        turns.runs.append([len(p) - length for p, (_, length) in zip(layout.prompts, row_starts,
                                                                      strict=True)])
        return laid, hidden

    def _verify_trunk(
        self,
        decoder: nn.Module,
        laid: LaidOutPass,
        hidden: torch.Tensor,
        states: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        """``BatchedPasses._verify_trunk`` for a pass from turn caches: the top layers, run again
        from the trunk's output the pass captured (and the same caches), must give the
        pass's hidden states."""
        trunk = self.passes.trunk
        if trunk is None or trunk.verified or trunk.disabled:
            return
        cache = prefix_cache_class()(past)
        with top_layers(decoder, trunk.start):
            again = decoder(
                inputs_embeds=states,
                attention_mask=laid.attention,
                position_ids=laid.position_ids,
                use_cache=False,
                **{cache_keyword(decoder): cache},
            ).last_hidden_state
        self.passes.judge_trunk(again, hidden, laid.layout.real_columns().to(hidden.device))

    def turn_inputs(
        self, prompts: Sequence[Sequence[int]], keys: Sequence[Hashable], turns: TurnCache
    ) -> tuple[torch.Tensor, torch.Tensor, Any, list[Start]]:
        """``generate``'s inputs from turn caches: each row's kept keys and values
        left-padded to the longest (as the cache generate starts from), then the row's
        own tokens after its padding; the attention mask covers both, so generate's
        positions (counted from the mask) continue each row's cache. Returns the ids,
        the mask, the cache and each row's (kept states, tokens they hold)."""
        decoder = decoder_and_head(self.passes.model)[0]
        rows = self._cached_rows(decoder, prompts, keys, turns, None)
        past, longest = stacked_starts(decoder, rows)
        cache = DynamicCache(past) if past is not None else DynamicCache()
        own_ids, own_mask = self.passes.left_padded(
            [prompt[length:] for prompt, (_, length) in zip(prompts, rows, strict=True)]
        )
        held = [list(prompt[:length]) for prompt, (_, length) in zip(prompts, rows, strict=True)]
        past_ids = padded(held, longest, self.passes.pad_id, left=True)
        past_mask = padded([[1] * len(tokens) for tokens in held], longest, 0, left=True)
        input_ids = torch.cat([past_ids, own_ids], dim=1)
        attention_mask = torch.cat([past_mask.to(own_mask.dtype), own_mask], dim=1)
        turns.runs.append([len(prompt) - length for prompt, (_, length) in
                           zip(prompts, rows, strict=True)])
        return input_ids, attention_mask, cache, rows

    def keep_turns(
        self,
        turns: TurnCache,
        keys: Sequence[Hashable],
        prompts: Sequence[Sequence[int]],
        replies: Sequence[Sequence[int]],
        rows: Sequence[Start],
        cache: Any,
        width: int,
        steps: int,
    ) -> None:
        """Keep what ``generate`` ran for each row: its prompt and the reply tokens fed
        back (all but the last step's token, which only was sampled)."""
        longest = width - max(len(prompt) - length for prompt, (_, length) in
                              zip(prompts, rows, strict=True))
        layers = cache_layers(cache)
        new = {}
        for row, (key, prompt, reply, (_, length)) in enumerate(
            zip(keys, prompts, replies, rows, strict=True)
        ):
            fed = min(len(reply), steps - 1)
            own = len(prompt) - length
            kept_layers = []
            for keys_t, values_t in layers:
                before = slice(longest - length, longest)
                after = slice(width - own, width + fed)
                kept_layers.append((
                    torch.cat([keys_t[row, :, before], keys_t[row, :, after]], dim=1),
                    torch.cat([values_t[row, :, before], values_t[row, :, after]], dim=1),
                ))
            new[key] = Kept((*prompt, *reply[:fed]), kept_layers)
        turns.keep(new)


def stacked_starts(
    decoder: nn.Module, rows: Sequence[Start]
) -> tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int]:
    """The rows' kept keys and values per layer as one batch, left-padded to the longest
    (:func:`stacked_past`), and that length; None and 0 where no row starts from any."""
    like = next((kept for kept, length in rows if kept is not None and length), None)
    if like is None:
        return None, 0
    return stacked_past(rows, len(decoder_layers(decoder) or []), like)


def kept_prompts(
    layout: PassLayout,
    row_starts: Sequence[Start],
    recorded: Sequence[tuple[torch.Tensor, torch.Tensor]],
    stacked: tuple[list[tuple[torch.Tensor, torch.Tensor]] | None, int],
    before: Sequence[torch.Tensor | None],
    trunk_output: torch.Tensor | None,
) -> dict[tuple[int, ...], Kept]:
    """What a score pass from turn caches keeps for each of its rows' prompts: per layer,
    the keys and values the row started from (``stacked``: the rows' caches left-padded,
    and their length) then those the pass ``recorded`` at the row's prompt columns; and,
    with a trunk, its output for the kept part (``before``) then for the pass's."""
    past, longest = stacked
    made: dict[tuple[int, ...], Kept] = {}
    for row, prompt in enumerate(layout.prompts):
        columns, length = layout.prompt_columns(row), row_starts[row][1]
        layers = []
        for layer, (new_keys, new_values) in enumerate(recorded):
            if past is not None:
                old_keys, old_values = past[layer]
                start = longest - length
                layers.append((
                    torch.cat([old_keys[row, :, start:], new_keys[row, :, columns]], dim=1),
                    torch.cat([old_values[row, :, start:], new_values[row, :, columns]], dim=1),
                ))
            else:
                layers.append(
                    (new_keys[row, :, columns].clone(), new_values[row, :, columns].clone())
                )
        first = before[row] if before else None
        states = None
        if first is not None and trunk_output is not None:
            states = torch.cat([first, trunk_output[row, columns]])
        made[prompt] = Kept(prompt, layers, states)
    return made
