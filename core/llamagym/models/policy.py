"""The trainable policy: a causal LM, its tokenizer and a value head, with the batched
forward passes the rollout engine and the algorithms share.

Both action modes come out as the same shape so every algorithm has one code path:
per turn, log-probabilities of its "action units" with a mask (one unit, the chosen
candidate, in score mode; the reply tokens in generate mode), a value and an entropy.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from llamagym.errors import ModelLoadError
from llamagym.models.trunk import (
    PassLayout,
    TrunkStates,
    decoder_layers,
    first_trained_layer,
    top_layers,
)
from llamagym.models.turn_cache import Kept, TurnCache, stacked_past

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer


@dataclass
class Evaluation:
    """Per-turn quantities a loss needs; ``logprobs``/``entropy``/``mask`` are [N, T]."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor


@dataclass
class Replies:
    """Generate mode's replies to a batch of prompts, as the rollout keeps them: each
    reply's tokens, each token's log-probability under the policy (the model's plain
    softmax, before any temperature, top-k or top-p) and the value of each prompt."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    values: list[float]

    @classmethod
    def unscored(cls, tokens: Sequence[Sequence[int]]) -> Replies:
        """Replies from a sampler that computes no log-probabilities (each 0)."""
        return cls([list(t) for t in tokens], [[0.0] * len(t) for t in tokens], [0.0] * len(tokens))


def name_tokens(tokenizer: Any, eos_id: int, names: Sequence[str]) -> list[list[int]]:
    """The tokens of each action name as the model would say it (an empty name is the
    end-of-turn token, so it still gets a score)."""
    if not names:
        return []
    encoded = tokenizer(list(names), add_special_tokens=False)["input_ids"]
    return [list(tokens) or [eos_id] for tokens in encoded]


def _owners(candidates: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, int]]:
    """(row, option) of each candidate, in the order a pass lists them."""
    return [(i, j) for i, options in enumerate(candidates) for j in range(len(options))]


def _choice_pairs(candidates: Sequence[Sequence[Sequence[int]]]) -> list[tuple[int, Any]]:
    """Score mode's (prompt index, candidate) pairs, in :func:`_owners` order."""
    return [(i, option) for i, options in enumerate(candidates) for option in options]


def _named_options(actions: Sequence[Sequence[Sequence[int]]] | None) -> list[list[Any]]:
    """Each generate-mode row's action names as tokens; empty where no row names any."""
    options = [list(row) for row in actions or []]
    return options if any(options) else []


def _reply_pairs(
    replies: Sequence[Sequence[int]], options: Sequence[Sequence[Sequence[int]]]
) -> list[tuple[int, Any]]:
    """Generate mode's pairs: each reply after its prompt, then each row's action names."""
    pairs: list[tuple[int, Any]] = [(i, reply) for i, reply in enumerate(replies)]
    return pairs + [(i, option) for i, row in enumerate(options) for option in row]


@dataclass
class _Pass:
    """One pass of :meth:`Policy._continuations`, laid out: where each token goes
    (``layout``), its inputs, and which row and distinct pair each asked pair reads."""

    layout: PassLayout
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor
    pair_rows: list[int]
    pair_unique: list[int]


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class Policy(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        device: torch.device | str | None = None,
        gradient_checkpointing: bool = False,
    ):
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
        self.additive_mask = _uses_additive_mask(model)
        self.logit_softcap = getattr(model.config, "final_logit_softcapping", None)
        #: Positions the LM head has been applied at (each costs a vocabulary-wide matmul).
        self.head_positions = 0
        #: Token positions the decoder has run (every row and column of its calls,
        #: padding included), in the passes of this class.
        self.positions_run = 0
        #: Each rollout env's key/value cache from its last turn (models/turn_cache.py),
        #: read by :meth:`score` and :meth:`generate` when the engine names the rows'
        #: envs (``keys``); None where the model keeps no plain cache (every prompt then
        #: runs whole, its shared prefix once, as without keys).
        self.turn_cache: TurnCache | None = TurnCache()
        self._turn_cache_checked = False
        #: What the frozen trunk (the decoder layers below the lowest trained one, with
        #: ``model.lora_layers``) computed for the token contexts seen so far in passes
        #: without gradients; None when every layer trains. See core/llamagym/models/trunk.py.
        start = first_trained_layer(_decoder_and_head(model)[0])
        self.trunk: TrunkStates | None = TrunkStates(start) if start else None
        # The LM stays in eval mode for good (see train()); gradient checkpointing is
        # switched on per pass, on the decoder layers alone, where gradients are taken.
        self.checkpointed_layers = (
            _checkpointable_layers(model) if gradient_checkpointing else []
        )
        if self.checkpointed_layers:
            # transformers 5 renamed gradient_checkpointing_enable (the old name warns).
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                # transformers' method: torch's stubs type module attributes Tensor | Module.
                model.gradient_checkpointing_enable(  # type: ignore[operator]
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.model.eval()

    def train(self, mode: bool = True) -> Policy:
        """Only the value head follows ``mode``: the LM always runs as in eval mode.

        Rollouts score in eval mode and the update recomputes the same log-probabilities,
        so dropout anywhere in the LM would make the two differ before any step (PPO's
        ratio would not start at 1). Gradient checkpointing is not tied to train mode
        either: :meth:`_checkpointing` turns it on for the passes that take gradients.
        """
        self.training = mode
        self.value_head.train(mode)
        return self

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
            # PEFT's method: torch's stubs type module attributes Tensor | Module.
            with self.model.disable_adapter():  # type: ignore[operator]
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

    def _lay_out(
        self,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        cached: dict[tuple[int, ...], int] | None = None,
    ) -> _Pass:
        """The one pass that scores ``pairs`` (prompt index, continuation tokens): see
        :meth:`_continuations`. A prompt that starts another prompt of the pass shares
        that prompt's row (:func:`prefix_rows`). With ``cached`` (a distinct prompt ->
        how many of its first tokens a turn cache holds), each prompt is a row that runs
        its tokens after those, at their own positions, after its cache left-padded to
        the longest (see :meth:`_hidden_from_turns`); else the prompts' shared prefix
        runs once."""
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
        prompt_ids, prompt_mask = self._left_padded(
            [prompt[start:] for prompt, start in zip(tips, skipped, strict=True)]
        )
        width = prompt_ids.shape[1]

        # Each continuation's tokens but the last (which is only predicted) go after
        # its prompt's row: `segment` says which pair a column holds (-1: none).
        tails: list[list[int]] = [[] for _ in tips]
        segments: list[list[int]] = [[] for _ in tips]
        positions: list[list[int]] = [[] for _ in tips]
        starts = []
        for k, (row, tokens) in enumerate(unique):
            n = max(len(tokens) - 1, 0)
            starts.append(len(tails[row]))
            tails[row] += tokens[:n]
            segments[row] += [k] * n
            positions[row] += range(len(owners[k]), len(owners[k]) + n)
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
        allowed = _block_causal_mask(
            prompt_mask.bool(), padded(segments, tail_width, -1), past, ends
        )
        return _Pass(
            layout=layout,
            input_ids=torch.cat([prompt_ids, padded(tails, tail_width, self.pad_id)], dim=1),
            position_ids=position_ids.to(self.device),
            attention=self._attention_mask(allowed.to(self.device)),
            pair_rows=pair_rows,
            pair_unique=pair_unique,
        )

    def _hidden(self, decoder: nn.Module, laid: _Pass, reference: bool = False) -> torch.Tensor:
        """The decoder's last hidden states over a pass: from the kept trunk where it
        holds every context of the pass (the layers above it only), else whole, and
        then, without gradients, kept for later passes."""
        layout, trunk = laid.layout, self.trunk
        kept = trunk.inputs(layout) if trunk is not None else None
        self.positions_run += layout.shared + laid.input_ids.numel()
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

    # -- the turn cache --------------------------------------------------------------
    def _turns(self) -> TurnCache | None:
        """The turn cache, emptied if the weights changed since it was kept; None where
        the model keeps no plain key/value cache (found out once, from one token: a
        model whose cache is not one full ``DynamicLayer`` per layer, a sliding window
        or a recurrent state, runs every prompt whole)."""
        cache = self.turn_cache
        if cache is None:
            return None
        if not self._turn_cache_checked:
            self._turn_cache_checked = True
            decoder = _decoder_and_head(self.model)[0]
            with torch.no_grad():
                probe = _new_cache(
                    decoder(input_ids=torch.tensor([[self.pad_id]], device=self.device),
                            use_cache=True)
                )
            plain = probe is not None and all(
                type(layer).__name__ == "DynamicLayer" for layer in getattr(probe, "layers", [])
            )
            if not plain or decoder_layers(decoder) is None:
                self.turn_cache = None
                return None
        cache.check_weights(p for p in self.model.parameters() if p.requires_grad)
        return cache

    def drop_turn_cache(self, key: Hashable) -> None:
        """Forget what the turn cache keeps for ``key`` (its env's episode ended)."""
        if self.turn_cache is not None:
            self.turn_cache.drop(key)

    def _run_prefix(
        self, decoder: nn.Module, tokens: Sequence[int], trunk: TrunkStates | None
    ) -> Kept:
        """Run ``tokens`` (the prefix a batch's prompts share) once: their keys and values
        (and trunk states), as a turn cache would keep them."""
        states: list[torch.Tensor] = []
        with trunk.capturing(decoder, states) if trunk else contextlib.nullcontext():
            output = decoder(input_ids=torch.tensor([list(tokens)], device=self.device),
                             use_cache=True)
        self.positions_run += len(tokens)
        layers = [(keys[0], values[0]) for keys, values in _cache_layers(_new_cache(output))]
        return Kept(tuple(tokens), layers, states[0][0] if states else None)

    def _cached_rows(
        self,
        decoder: nn.Module,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[Hashable],
        turns: TurnCache,
        trunk: TrunkStates | None,
    ) -> list[tuple[Kept | None, int]]:
        """Per prompt, the kept states it starts from and how many of its tokens they
        hold: its key's, or the prefix all the prompts share (run once here) where that
        is longer (a first turn; a window that shifted an old turn out)."""
        rows = [turns.match(key, prompt) for key, prompt in zip(keys, prompts, strict=True)]
        shared = shared_prefix_length(prompts)
        if any(length < shared for _, length in rows):
            prefix = self._run_prefix(decoder, prompts[0][:shared], trunk)
            rows = [(prefix, shared) if row[1] < shared else row for row in rows]
        return rows

    def _hidden_from_turns(
        self,
        decoder: nn.Module,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        keys: Sequence[Hashable],
        turns: TurnCache,
    ) -> tuple[_Pass, torch.Tensor]:
        """A rollout pass (no gradients) that runs each prompt's tokens after what its
        env's turn cache holds, then keeps each env's prompt for its next turn.

        Each distinct prompt is a row that starts from the longest kept prefix among the
        envs that have it. The rows' kept keys and values are left-padded to the longest
        (padding masked out) before the rows' own tokens, which run at their own positions
        (explicit position ids); the candidates' blocks follow as in :meth:`_lay_out`.
        The candidates are not kept: the next prompt renders the chosen action through
        the chat template, and the common prefix of tokens decides what is reused. A
        window (``rollout.history_turns: N``) shifts the oldest turn out every turn, so
        the common prefix is the system prompt (and template) alone: the numbers are the
        same, the pass only no cheaper than without a cache. With a frozen trunk, its
        output for each whole prompt (the kept part's, kept with the cache, then the
        pass's) is recorded as a whole pass would, so the update finds it.
        """
        trunk = self.trunk if self.trunk is not None and not self.trunk.disabled else None
        rows = self._cached_rows(decoder, prompts, keys, turns, trunk)
        best: dict[tuple[int, ...], tuple[Kept | None, int]] = {}
        for prompt, (kept, length) in zip(prompts, rows, strict=True):
            held = best.get(tuple(prompt))
            if held is None or length > held[1]:
                best[tuple(prompt)] = (kept, length)
        laid = self._lay_out(prompts, pairs, cached={p: length for p, (_, length) in best.items()})
        layout = laid.layout
        row_states = [best[prompt] for prompt in layout.prompts]
        layer_count = len(decoder_layers(decoder) or [])
        like = next((kept for kept, length in row_states if kept is not None and length), None)
        if like is not None:
            past, longest = stacked_past(row_states, layer_count, like)
        else:
            past, longest = None, 0
        recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        seen: list[torch.Tensor] = []
        cache = _prefix_cache_class()(past, recorded)
        with trunk.capturing(decoder, seen) if trunk else contextlib.nullcontext():
            hidden = decoder(
                input_ids=laid.input_ids.to(self.device),
                attention_mask=laid.attention,
                position_ids=laid.position_ids,
                use_cache=False,
                **{_cache_keyword(decoder): cache},
            ).last_hidden_state
        self.positions_run += laid.input_ids.numel()
        # The trunk's output for what each row's cache held (None: its cache kept none).
        before: list[torch.Tensor | None] = []
        for kept, length in row_states if seen else []:
            if not length:
                before.append(seen[-1].new_zeros((0, seen[-1].shape[-1])))
            else:
                assert kept is not None
                before.append(kept.trunk[:length] if kept.trunk is not None else None)
        if trunk is not None:
            trunk.record(seen, layout, before)
            self._verify_trunk_from_turns(decoder, laid, hidden, seen[-1], past)
        made: dict[tuple[int, ...], Kept] = {}
        for row, prompt in enumerate(layout.prompts):
            columns, length = layout.prompt_columns(row), row_states[row][1]
            layers = []
            for layer in range(layer_count):
                new_keys, new_values = recorded[layer]
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
            states = torch.cat([first, seen[-1][row, columns]]) if first is not None else None
            made[prompt] = Kept(prompt, layers, states)
        turns.keep({key: made[tuple(prompt)] for key, prompt in zip(keys, prompts, strict=True)})
        turns.runs.append([len(p) - length for p, (_, length) in zip(layout.prompts, row_states,
                                                                      strict=True)])
        return laid, hidden

    def _verify_trunk_from_turns(
        self,
        decoder: nn.Module,
        laid: _Pass,
        hidden: torch.Tensor,
        states: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
    ) -> None:
        """:meth:`_verify_trunk` for a pass from turn caches: the top layers, run again
        from the trunk's output the pass captured (and the same caches), must give the
        pass's hidden states."""
        trunk = self.trunk
        if trunk is None or trunk.verified or trunk.disabled:
            return
        cache = _prefix_cache_class()(past)
        with top_layers(decoder, trunk.start):
            again = decoder(
                inputs_embeds=states,
                attention_mask=laid.attention,
                position_ids=laid.position_ids,
                use_cache=False,
                **{_cache_keyword(decoder): cache},
            ).last_hidden_state
        self._judge_trunk(again, hidden, laid.layout.real_columns().to(hidden.device))

    @torch.no_grad()
    def keep_trunk(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]] | None = None,
        replies: Sequence[Sequence[int]] | None = None,
        actions: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> None:
        """Have :attr:`trunk` hold the contexts that :meth:`evaluate_choices`
        (``candidates``) or :meth:`evaluate_replies` (``replies``, ``actions``) would
        pass through: one pass without gradients (no LM head) where any is new."""
        if self.trunk is None or self.trunk.disabled:
            return
        if candidates is not None:
            pairs = _choice_pairs(candidates)
        else:
            pairs = _reply_pairs(replies or [], _named_options(actions))
        laid = self._lay_out(prompts, pairs)
        if not self.trunk.holds(laid.layout):
            self._hidden(_decoder_and_head(self.model)[0], laid)

    def _continuations(
        self,
        prompts: Sequence[Sequence[int]],
        pairs: Sequence[tuple[int, Sequence[int]]],
        reference: bool = False,
        entropy: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Log-probabilities of continuation tokens, for (prompt index, tokens) pairs.

        Returns per-token logprobs [P, T], their mask [P, T], per-token entropy [P, T]
        (if asked) and the hidden state at each pair's last prompt token [P, H].

        One forward pass does it all. Each distinct prompt is one row, left-padded so
        all prompts end in the same column, and the distinct continuations of that
        prompt follow it side by side, each attending to its prompt and its own earlier
        tokens only (a block of the attention mask). Scoring A candidates costs one row,
        not A, and a prompt met in many turns (a small state space such as Blackjack's
        repeats prompts all the time; a seed group's episodes all start from one) is
        computed once, as is a continuation met after it more than once (the same reply,
        the same candidate): the pairs that repeat it share its numbers, and gradients.
        The tokens every prompt starts with (system prompt, chat template...) run once
        for the whole batch, as a cache. Where the model has a frozen trunk that holds
        the pass's contexts, only the layers above it run (:meth:`_hidden`). A rollout
        pass that names each prompt's env (``keys``) runs only what the env's turn cache
        does not hold (:meth:`_hidden_from_turns`), unless the trunk holds it all.
        """
        turns = None
        if keys is not None and not reference and not torch.is_grad_enabled():
            turns = self._turns()
        # The plain layout, unless the turn caches will lay the pass out (where the
        # trunk holds every context, its top layers alone cost less).
        laid = None
        if turns is None or self.trunk is not None:
            laid = self._lay_out(prompts, pairs)
            if self.trunk is not None and self.trunk.holds(laid.layout):
                turns = None
        with self._reference_context(reference) as model:
            decoder, head = _decoder_and_head(model)
            if turns is not None:
                assert keys is not None
                laid, hidden = self._hidden_from_turns(decoder, prompts, pairs, keys, turns)
            else:
                assert laid is not None
                hidden = self._hidden(decoder, laid, reference)
            layout = laid.layout
            width, starts, unique = layout.width, layout.starts, layout.unique
            ends = [layout.end_column(k) for k in range(len(unique))]
            # The LM head runs only where a log-probability is needed: token t of pair k
            # is predicted at its prompt's last column for t = 0, and at the column of
            # its own previous token (width + start_k + t - 1) after that.
            where = [
                (k, t, ends[k] if t == 0 else width + start + t - 1, token)
                for k, (start, (_, tokens)) in enumerate(zip(starts, unique, strict=True))
                for t, token in enumerate(tokens)
            ]
            unique_of_t, step_of, column_of, target_of = (
                torch.tensor(values, device=self.device) for values in zip(*where, strict=True)
            )
            unique_rows = torch.tensor([row for row, _ in unique], device=self.device)
            self.head_positions += len(where)
            chosen, chosen_entropy = self._head_logprobs(
                head, hidden[unique_rows[unique_of_t], column_of], target_of, entropy
            )
        keep = max(len(tokens) for _, tokens in pairs)
        shape = (len(unique), keep)
        at = (unique_of_t, step_of)
        mask = torch.zeros(shape, device=self.device).index_put(
            at, torch.ones((), device=self.device)
        )
        token_logprobs = torch.zeros(shape, device=self.device).index_put(at, chosen)
        token_entropy = None
        if chosen_entropy is not None:  # asked for (entropy)
            token_entropy = torch.zeros(shape, device=self.device).index_put(at, chosen_entropy)
        # Back from the distinct pairs to the pairs as asked, in their order.
        order = torch.tensor(laid.pair_unique, device=self.device)
        token_logprobs, mask = token_logprobs[order], mask[order]
        if token_entropy is not None:
            token_entropy = token_entropy[order]
        rows_t = torch.tensor(laid.pair_rows, device=self.device)
        ends_t = torch.tensor([ends[k] for k in laid.pair_unique], device=self.device)
        state_hidden = None if reference else hidden[rows_t, ends_t]
        return token_logprobs, mask, token_entropy, state_hidden

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
            prefix_cache = _new_cache(decoder(**{key: prefix.to(self.device)}, use_cache=True))
            cache = _prefix_cache_class()(_cache_layers(prefix_cache))
        with self._checkpointing(torch.is_grad_enabled() and not reference):
            return decoder(
                **{key: rows.to(self.device)},
                attention_mask=attention,
                position_ids=position_ids,
                use_cache=False,
                **{_cache_keyword(decoder): cache},
            ).last_hidden_state

    def _verify_trunk(self, decoder: nn.Module, laid: _Pass, hidden: torch.Tensor) -> None:
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
        self._judge_trunk(again, hidden, laid.layout.real_columns().to(hidden.device))

    def _judge_trunk(self, again: torch.Tensor, hidden: torch.Tensor, real: torch.Tensor) -> None:
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

        from torch.utils.checkpoint import checkpoint

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

    def _values(self, state_hidden: torch.Tensor) -> torch.Tensor:
        return self.value_head(state_hidden.float()).squeeze(-1)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Score each legal action string after its prompt.

        Returns ``scores`` [N, A] (mean log-likelihood per token, -inf where a prompt has
        fewer than A candidates) and ``values`` [N]. ``keys`` (the rollout's: one per
        prompt, naming its env's episode) lets each prompt start from its env's turn
        cache (:attr:`turn_cache`) and keeps the prompt there for the next turn.
        """
        token_logprobs, mask, _, state_hidden = self._continuations(
            prompts, _choice_pairs(candidates), reference, keys=keys
        )
        scores = self._option_scores(token_logprobs, mask, candidates)
        if reference:
            return scores, torch.zeros(len(prompts), device=self.device)
        first_option = torch.tensor(
            [k for k, (_, option) in enumerate(_owners(candidates)) if option == 0]
        )
        assert state_hidden is not None, "_continuations gives hidden states off reference"
        return scores, self._values(state_hidden[first_option.to(self.device)])

    def _option_scores(
        self,
        token_logprobs: torch.Tensor,
        mask: torch.Tensor,
        candidates: Sequence[Sequence[Sequence[int]]],
    ) -> torch.Tensor:
        """Each candidate's mean log-likelihood per token, from the rows of
        ``token_logprobs`` that hold the candidates in order, as [N, A] (-inf pads)."""
        owners = _owners(candidates)
        option_scores = token_logprobs.sum(-1) / mask.sum(-1)
        num_actions = max(len(options) for options in candidates)
        scores = torch.full((len(candidates), num_actions), float("-inf"), device=self.device)
        owner_rows = torch.tensor([i for i, _ in owners], device=self.device)
        owner_cols = torch.tensor([j for _, j in owners], device=self.device)
        return scores.index_put((owner_rows, owner_cols), option_scores)

    @staticmethod
    def action_log_probs(
        scores: torch.Tensor, temperature: float | torch.Tensor = 1.0
    ) -> torch.Tensor:
        """Score mode's policy over the legal actions: the log-softmax of the candidates'
        ``scores`` [N, A] (from :meth:`score`) divided by ``temperature``, a number or
        one per row ([N, 1]). A padding column (score -inf) gets -inf."""
        return (scores / temperature).log_softmax(-1)

    @staticmethod
    def policy_entropy(log_policy: torch.Tensor) -> torch.Tensor:
        """The entropy [N, 1] of each row of a policy over actions given as log-probs
        [N, A], where -inf marks a padding column."""
        return -(log_policy.exp() * log_policy.nan_to_num(neginf=0.0)).sum(-1, keepdim=True)

    def evaluate_choices(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        chosen: Sequence[int],
        temperature: float | torch.Tensor = 1.0,
        reference: bool = False,
    ) -> Evaluation:
        """Score mode: log-probability of the chosen candidate among all of them, under
        the current policy or (``reference``) the KL reference, whose values are 0."""
        scores, values = self.score(prompts, candidates, reference=reference)
        log_policy = self.action_log_probs(scores, temperature)
        index = torch.tensor(chosen, device=self.device)[:, None]
        logprobs = log_policy.gather(-1, index)
        entropy = self.policy_entropy(log_policy)
        mask = torch.ones_like(logprobs)
        return Evaluation(logprobs, entropy, mask, values)

    def evaluate_replies(
        self,
        prompts: Sequence[Sequence[int]],
        replies: Sequence[Sequence[int]],
        reference: bool = False,
        actions: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> Evaluation:
        """Generate mode: per-token log-probabilities of each reply after its prompt.

        The entropy is the policy's over the legal actions where ``actions`` gives a
        row's action names as tokens: the spread of score mode's policy (a softmax over
        each name's mean log-likelihood) at the reply's start, the same at every token
        of the reply. A bonus on it keeps the choice between actions open without
        pushing probability to tokens that name no action (which an entropy over the
        whole vocabulary rewards). A row without names (empty, or no ``actions``) gets
        the entropy of each token's next-token distribution.
        """
        options = _named_options(actions) if not reference else []
        named = [bool(row) for row in options] or [False] * len(replies)
        logprobs, mask, entropy, state_hidden = self._continuations(
            prompts,
            _reply_pairs(replies, options),
            reference,
            entropy=not reference and not all(named),
        )
        count = len(replies)
        width = max(1, max(len(reply) for reply in replies))
        reply_logprobs, reply_mask = logprobs[:count, :width], mask[:count, :width]
        if reference:
            zeros = torch.zeros(count, device=self.device)
            return Evaluation(reply_logprobs, torch.zeros_like(reply_logprobs), reply_mask, zeros)
        assert state_hidden is not None, "_continuations gives hidden states off reference"
        spread = entropy[:count, :width] if entropy is not None else torch.zeros_like(reply_mask)
        if options:
            has_names = torch.tensor(named, device=self.device)[:, None]
            scores = self._option_scores(logprobs[count:], mask[count:], options)
            # A row without names gets a stand-in (uniform) policy, dropped below.
            log_policy = self.action_log_probs(torch.where(has_names, scores, 0.0))
            over_actions = self.policy_entropy(log_policy)
            spread = torch.where(has_names, over_actions * reply_mask, spread)
        return Evaluation(reply_logprobs, spread, reply_mask, self._values(state_hidden[:count]))

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
        reply_prefix: str | Sequence[str] = "",
        should_stop: Callable[[], bool] | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> Replies:
        """Sample one reply per prompt in one batched ``generate`` (left padding), with
        the log-probabilities and values the rollout keeps, from the same passes.

        Sampling draws from ``generator`` (the caller's seeded state), so a run's replies
        repeat with its seed. The model's own sampling settings (a chat model's
        temperature or top-p) do not apply: the rollout settings are the one source.
        A reply ends at the end-of-turn token, or where it closes the JSON object that
        it (or ``reply_prefix``, which the prompts already end with: one for all, or one
        per prompt) opened. Every reply ends, cut short, once ``should_stop()`` (asked
        between tokens) says so: a stop requested or a time budget used up.

        The tokens all prompts start with (system prompt, chat template) run once, as a
        cache copied to every row; each row's own tokens follow after its padding, so
        the padding sits between the shared prefix and the rest. Each step's logits
        (kept for the whole batch: rows x new tokens x vocabulary) give the replies'
        log-probabilities, and the decoder's first call, over the prompts, the state
        each value is read from, so no pass over the prompts runs twice.

        With ``keys`` (the rollout's: one per prompt, naming its env's episode), each
        row starts from its env's turn cache instead (:meth:`_turn_inputs`), and what
        the row ran, its prompt and reply, is kept there for the next turn.
        """
        from transformers import LogitsProcessorList, StoppingCriteriaList

        prefixes = reply_prefixes(reply_prefix, len(prompts))
        turns = self._turns() if keys is not None else None
        if turns is not None:
            assert keys is not None
            input_ids, attention_mask, cache, rows = self._turn_inputs(prompts, keys, turns)
        else:
            input_ids, attention_mask, cache = self._shared_prefix_inputs(prompts)
        width = input_ids.shape[1]
        # The first call runs every row's columns after the cache it starts from.
        past_length = cache.get_seq_length() if cache is not None else 0
        self.positions_run += len(prompts) * (width - past_length)
        processors = LogitsProcessorList()
        if not greedy:
            processors.extend(sampling_processors(temperature, top_p, top_k, generator))
        states: list[torch.Tensor] = []

        def keep_prompt_state(_module: nn.Module, _args: Any, output: Any) -> None:
            if not states:  # the first call runs the prompts; later ones one token each
                states.append(output[0][:, -1])

        decoder, _ = _decoder_and_head(self.model)
        hook = decoder.register_forward_hook(keep_prompt_state)
        try:
            # transformers' method: torch's stubs type module attributes Tensor | Module.
            output = self.model.generate(  # type: ignore[operator]
                input_ids=input_ids.to(self.device),
                attention_mask=attention_mask.to(self.device),
                max_new_tokens=max_new_tokens,
                **{_cache_keyword(decoder): cache},
                # HF's greedy step picks the one token the sampling processor leaves
                # standing; with sampling off, HF adds no temperature/top-k/top-p warpers.
                do_sample=False,
                logits_processor=processors,
                pad_token_id=self.pad_id,
                eos_token_id=self.eos_id,
                stopping_criteria=StoppingCriteriaList(
                    [JsonClosed(self.tokenizer, width, prefixes)]
                    + ([StopRequested(should_stop)] if should_stop is not None else [])
                ),
                return_dict_in_generate=True,
                output_logits=True,  # before any processor: the policy's own
                # Each process generates on its own: a sharded model's parameters are
                # gathered for the whole rollout first (training/sharded.py), where
                # transformers would otherwise step every process together.
                synced_gpus=False,
            )
        finally:
            hook.remove()
        new_tokens = output.sequences[:, width:]
        self.head_positions += new_tokens.shape[0] * len(output.logits)  # a row's last, per step
        self.positions_run += new_tokens.shape[0] * (new_tokens.shape[1] - 1)
        token_logprobs = torch.stack(
            [
                step.float().log_softmax(-1).gather(-1, new_tokens[:, t, None]).squeeze(-1)
                for t, step in enumerate(output.logits)
            ],
            dim=1,
        ).tolist()
        replies = []
        for row, opened in zip(new_tokens.tolist(), prefixes, strict=True):
            reply = []
            for token in row:
                reply.append(token)
                if token == self.eos_id:
                    break  # the end-of-turn token is part of the action: it learns to stop
            replies.append(json_closed_at(self.tokenizer, reply, opened))
        if turns is not None:
            assert keys is not None and cache is not None
            self._keep_turns(turns, keys, prompts, replies, rows, cache, width,
                             new_tokens.shape[1])
        return Replies(
            tokens=replies,
            logprobs=[row[: len(r)] for row, r in zip(token_logprobs, replies, strict=True)],
            values=self._values(states[0]).tolist(),
        )


    def _shared_prefix_inputs(
        self, prompts: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """``generate``'s inputs without turn caches: the tokens all prompts share run
        once (their cache copied to every row), then each row's own tokens after its
        padding. The cache is None where the prompts share too little, or the model
        keeps none (then the whole prompts run as rows)."""
        shared, cache = shared_prefix_length(prompts), None
        if shared:
            prefix = torch.tensor([prompts[0][:shared]])
            cache = _new_cache(self.model(input_ids=prefix.to(self.device), use_cache=True))
            self.positions_run += shared
        input_ids, attention_mask = self._left_padded(
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

    def _turn_inputs(
        self, prompts: Sequence[Sequence[int]], keys: Sequence[Hashable], turns: TurnCache
    ) -> tuple[torch.Tensor, torch.Tensor, Any, list[tuple[Kept | None, int]]]:
        """``generate``'s inputs from turn caches: each row's kept keys and values
        left-padded to the longest (as the cache generate starts from), then the row's
        own tokens after its padding; the attention mask covers both, so generate's
        positions (counted from the mask) continue each row's cache. Returns the ids,
        the mask, the cache and each row's (kept states, tokens they hold)."""
        from transformers import DynamicCache

        decoder = _decoder_and_head(self.model)[0]
        rows = self._cached_rows(decoder, prompts, keys, turns, None)
        like = next((kept for kept, length in rows if kept is not None and length), None)
        layer_count = len(decoder_layers(decoder) or [])
        if like is not None:
            past, longest = stacked_past(rows, layer_count, like)
            cache = DynamicCache(past)
        else:
            longest, cache = 0, DynamicCache()
        own_ids, own_mask = self._left_padded(
            [prompt[length:] for prompt, (_, length) in zip(prompts, rows, strict=True)]
        )
        held = [list(prompt[:length]) for prompt, (_, length) in zip(prompts, rows, strict=True)]
        past_ids = padded(held, longest, self.pad_id, left=True)
        past_mask = padded([[1] * len(tokens) for tokens in held], longest, 0, left=True)
        input_ids = torch.cat([past_ids, own_ids], dim=1)
        attention_mask = torch.cat([past_mask.to(own_mask.dtype), own_mask], dim=1)
        turns.runs.append([len(prompt) - length for prompt, (_, length) in
                           zip(prompts, rows, strict=True)])
        return input_ids, attention_mask, cache, rows

    def _keep_turns(
        self,
        turns: TurnCache,
        keys: Sequence[Hashable],
        prompts: Sequence[Sequence[int]],
        replies: Sequence[Sequence[int]],
        rows: Sequence[tuple[Kept | None, int]],
        cache: Any,
        width: int,
        steps: int,
    ) -> None:
        """Keep what ``generate`` ran for each row: its prompt and the reply tokens fed
        back (all but the last step's token, which only was sampled)."""
        longest = width - max(len(prompt) - length for prompt, (_, length) in
                              zip(prompts, rows, strict=True))
        layers = _cache_layers(cache)
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


def _block_causal_mask(
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


def _decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The causal LM's decoder stack (hidden states out) and its LM head, so the head
    runs only where log-probabilities are needed. A LoRA model's adapters live inside
    these modules, so calling them directly keeps (or, disabled, skips) the adapter."""
    # PEFT's and transformers' methods: torch's stubs type module attributes Tensor | Module.
    base = model.get_base_model() if _is_peft(model) else model  # type: ignore[operator]
    return base.get_decoder(), base.get_output_embeddings()  # type: ignore[operator]


def _checkpointable_layers(model: nn.Module) -> list[GradientCheckpointingLayer]:
    """The decoder layers transformers can checkpoint (none for other models)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52
        return []
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def _cache_keyword(decoder: nn.Module) -> str:
    """The name a decoder's forward (and so generate) takes a key/value cache by:
    ``cache`` since transformers 5.24, ``past_key_values`` before (the old name warns)."""
    return "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else (
        "past_key_values"
    )


def _new_cache(output: Any) -> Any:
    """The cache a forward with ``use_cache=True`` returned (None if the model keeps none)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers 4.56+
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


@functools.cache
def _prefix_cache_class() -> type:
    from transformers import DynamicCache

    class PrefixCache(DynamicCache):
        """The shared prefix's keys and values, read by every row of a pass and never
        extended: each layer gets the prefix followed by its own new keys. Nothing is
        copied per row (the prefix broadcasts), and a checkpointed layer that runs again
        in backward sees the same cache. The prefix may also be one per row (the rows'
        turn caches, left-padded to one length); with ``recorded``, each layer's new
        keys and values are kept there (by layer index), to be kept for the next turn."""

        def __init__(self, prefix, recorded: dict | None = None):
            super().__init__()
            self.prefix = prefix  # None: no keys before the pass's own
            # The last layer always ran (the layers below a kept trunk did not).
            self.length = self.prefix[-1][0].shape[-2] if prefix is not None else 0
            self.recorded = recorded

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if self.recorded is not None:
                self.recorded[layer_idx] = (key_states, value_states)
            if self.prefix is None:
                return key_states, value_states
            keys, values = self.prefix[layer_idx]
            rows = key_states.shape[0]
            return (
                torch.cat([keys.expand(rows, -1, -1, -1), key_states], dim=-2),
                torch.cat([values.expand(rows, -1, -1, -1), value_states], dim=-2),
            )

        def get_seq_length(self, layer_idx: int | None = 0) -> int:
            return self.length

    return PrefixCache


def _uses_additive_mask(model: nn.Module) -> bool:
    """Whether the model's attention takes a custom mask as an additive bias (eager)
    rather than as booleans (SDPA, flex); other kernels take no custom mask at all."""
    implementation = getattr(model.config, "_attn_implementation", None) or "eager"
    if implementation not in ("sdpa", "flex_attention", "eager"):
        raise ModelLoadError(
            f"the model uses the attention implementation {implementation!r}, which takes "
            "no custom attention mask; load it with attn_implementation='sdpa' (the "
            "default) or 'eager'"
        )
    return implementation == "eager"


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


# Positions whose vocabulary-wide log-softmax is computed at once (see _head_logprobs).
HEAD_CHUNK = 256

# How far (relative to the largest hidden value) a pass from the kept trunk may be from
# a whole pass: float32 sums in another order differ by ~1e-6 of it.
TRUNK_TOLERANCE = 1e-4

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
    # transformers' method: torch's stubs type module attributes Tensor | Module.
    return int(model.get_input_embeddings().embedding_dim)  # type: ignore[operator]


def _max_context(model: nn.Module, tokenizer) -> int:
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:
        limit = min(limit, tokenizer_limit)
    return int(limit)
