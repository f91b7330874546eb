"""The frozen trunk of a model trained through LoRA on its top layers only.

With ``model.lora_layers: N`` the decoder layers below the last N hold no trainable
weight, so what they compute for a token depends on the token's context alone: it is
the same in the rollout, in every epoch of every update, and with the adapter on or off
(the KL reference). :class:`TrunkStates` keeps the hidden state each token has where the
first trained layer takes it (the trunk's output), recorded in passes without gradients
(a score-mode rollout's, or the one an update runs before its epochs); a later pass over
the same prompts and continuations runs the top layers only, from those states. The
states are stored per token context (a prompt's tokens; a continuation's tokens after its
prompt), not per batch, so a pass of any layout (minibatches are shuffled each epoch)
finds them. Their memory is bounded (:data:`MAX_TRUNK_BYTES`): once full, nothing more is
kept until the next update starts over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

#: What the trunk may keep at once (float32 hidden states); past it, nothing more is kept
#: until the next update starts over, and passes over contexts not kept run whole.
MAX_TRUNK_BYTES = 512 * 2**20


def decoder_layers(decoder: nn.Module) -> nn.ModuleList | None:
    """The decoder's stack of layers, where it keeps them as ``layers`` (Llama, Mistral,
    Qwen, Phi, Gemma...), else None (no trunk is kept for such a model)."""
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def first_trained_layer(decoder: nn.Module) -> int:
    """The index of the lowest decoder layer holding a trainable weight: the layers below
    it are the frozen trunk. 0 (no trunk) when the layers are not found, when every one
    trains, or when the embedding trains too."""
    layers = decoder_layers(decoder)
    if layers is None or any(p.requires_grad for p in _embedding_parameters(decoder)):
        return 0
    for index, layer in enumerate(layers):
        if any(parameter.requires_grad for parameter in layer.parameters()):
            return index
    return 0


def _embedding_parameters(decoder: nn.Module) -> list[nn.Parameter]:
    get = getattr(decoder, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    return list(embedding.parameters()) if isinstance(embedding, nn.Module) else []


@contextlib.contextmanager
def top_layers(decoder: nn.Module, start: int) -> Iterator[None]:
    """The decoder runs its layers from ``start`` on (given the trunk's output as
    ``inputs_embeds``). Each layer keeps its own index, so a cache is read per layer as
    in a whole pass."""
    layers = decoder_layers(decoder)
    assert layers is not None and start > 0
    decoder.layers = nn.ModuleList(list(layers)[start:])
    try:
        yield
    finally:
        decoder.layers = layers


@dataclass
class PassLayout:
    """Where a pass of :meth:`Policy._continuations` puts each token: one row per
    ``prompts`` entry (their first ``shared`` tokens run once, as a prefix; the rest
    left-padded to ``width`` columns) and each of the ``unique`` (row, continuation)
    pairs after its row, from column ``width + start``, ``tail_width`` columns in all.
    A row's prompt may hold other prompts of the pass as prefixes (the turns of one
    episode with its history: turn t's prompt starts with turn t-1's): a pair's own
    prompt (``owners``, None: its row's) then ends inside the row, at
    :meth:`end_column`, and its tokens see the row up to there. A pass that reads each
    row's turn cache (``cached``: how many of each row's first tokens it holds) runs a
    row's tokens after those instead, and ``shared`` is 0."""

    prompts: list[tuple[int, ...]]
    unique: list[tuple[int, tuple[int, ...]]]
    starts: list[int]
    shared: int
    width: int
    tail_width: int
    cached: list[int] | None = None
    owners: list[tuple[int, ...]] | None = None

    def owner(self, pair: int) -> tuple[int, ...]:
        """The prompt the ``unique`` pair continues."""
        return self.owners[pair] if self.owners is not None else self.prompts[self.unique[pair][0]]

    def end_column(self, pair: int) -> int:
        """The column, in its row, of the last token of the pair's own prompt (the one
        that predicts the pair's first token)."""
        row = self.unique[pair][0]
        return self.width - len(self.prompts[row]) + len(self.owner(pair)) - 1

    def prompt_columns(self, row: int) -> slice:
        """The columns of row ``row`` that hold its prompt's own tokens (after the prefix,
        or after what its turn cache held)."""
        skipped = self.cached[row] if self.cached is not None else self.shared
        return slice(self.width - (len(self.prompts[row]) - skipped), self.width)

    def tail_columns(self, pair: int) -> slice:
        """The columns, in its row, of the ``unique`` pair's tokens but its last."""
        start = self.width + self.starts[pair]
        return slice(start, start + len(self.unique[pair][1]) - 1)

    def real_columns(self) -> torch.Tensor:
        """[rows, columns]: which columns hold a token (not padding) in the rows' pass."""
        columns = self.width + self.tail_width
        real = torch.zeros(len(self.prompts), columns, dtype=torch.bool)
        for row in range(len(self.prompts)):
            real[row, self.prompt_columns(row)] = True
        for pair, (row, _) in enumerate(self.unique):
            real[row, self.tail_columns(pair)] = True
        return real


class TrunkStates:
    """The trunk's output per token context.

    ``prompts`` maps a prompt's tokens to its states [len, H]; ``tails`` maps (prompt,
    continuation) to the states of the continuation's tokens but its last [len - 1, H]
    (the last is only predicted). ``verified`` is set once a pass from the kept states
    has matched a whole pass (a model whose decoder does more to its input than its
    layers, as OPT's adding of position embeddings, would not)."""

    def __init__(self, start: int, limit_bytes: int = MAX_TRUNK_BYTES):
        self.start = start
        self.limit_bytes = limit_bytes
        self.bytes = 0
        self.prompts: dict[tuple[int, ...], torch.Tensor] = {}
        self.tails: dict[tuple[tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
        self.full = False
        self.disabled = False
        self.verified = False

    def clear(self) -> None:
        """Forget every kept state (the verification stands)."""
        self.prompts.clear()
        self.tails.clear()
        self.bytes, self.full = 0, False

    # -- recording -------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self, decoder: nn.Module, seen: list[torch.Tensor]) -> Iterator[None]:
        """Append to ``seen`` what the first trained layer is given, call by call."""
        layers = decoder_layers(decoder)
        assert layers is not None

        def keep(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            seen.append(hidden.detach())

        hook = layers[self.start].register_forward_pre_hook(keep, with_kwargs=True)
        try:
            yield
        finally:
            hook.remove()

    def record(
        self,
        seen: Sequence[torch.Tensor],
        layout: PassLayout,
        before: Sequence[torch.Tensor | None] | None = None,
    ) -> None:
        """Keep the states of a pass laid out as ``layout`` (the prefix call's, if any,
        then the main call's, as :meth:`capturing` saw them). A pass from turn caches
        gives each row's states for the tokens its cache held (``before``; None where
        its cache kept none: that prompt is not kept whole, so not at all)."""
        if self.full or self.disabled:
            return
        main = seen[-1]
        prefix = seen[0][0] if layout.shared else main.new_zeros((0, main.shape[-1]))
        for row, prompt in enumerate(layout.prompts):
            if prompt not in self.prompts:
                first = before[row] if before is not None else prefix
                if first is None:
                    continue
                own = main[row, layout.prompt_columns(row)]
                self._keep(self.prompts, prompt, torch.cat([first, own]))
        for pair, (row, tokens) in enumerate(layout.unique):
            key = (layout.owner(pair), tokens)
            if key not in self.tails:
                self._keep(self.tails, key, main[row, layout.tail_columns(pair)])

    def _keep(self, table: dict, key: Any, states: torch.Tensor) -> None:
        size = states.numel() * states.element_size()
        if self.bytes + size > self.limit_bytes:
            self.full = True
            return
        table[key] = states.clone()
        self.bytes += size

    # -- replay ----------------------------------------------------------------------
    def prompt_states(self, prompt: tuple[int, ...]) -> torch.Tensor | None:
        """The kept states of ``prompt``: its own, or the first tokens' of a kept prompt
        that starts with it (a later turn of the same episode), else None."""
        states = self.prompts.get(prompt)
        if states is not None:
            return states
        length = len(prompt)
        for kept, states in self.prompts.items():
            if len(kept) > length and kept[:length] == prompt:
                return states[:length]
        return None

    def holds(self, layout: PassLayout) -> bool:
        """Whether every context of a pass laid out as ``layout`` is kept (and usable)."""
        return (
            not self.disabled
            and all(self.prompt_states(p) is not None for p in layout.prompts)
            and all(
                (layout.owner(pair), tokens) in self.tails
                for pair, (_, tokens) in enumerate(layout.unique)
                if len(tokens) > 1
            )
        )

    def inputs(self, layout: PassLayout) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        """The top layers' input for a pass laid out as ``layout``: the prefix's states
        [1, shared, H] (None without a shared prefix) and the rows' [rows, columns, H],
        padding zero; None unless :meth:`holds`."""
        if not self.holds(layout):
            return None
        rows = [cast(torch.Tensor, self.prompt_states(prompt)) for prompt in layout.prompts]
        main = rows[0].new_zeros(
            (len(layout.prompts), layout.width + layout.tail_width, rows[0].shape[-1])
        )
        for row, states in enumerate(rows):
            main[row, layout.prompt_columns(row)] = states[layout.shared :]
        for pair, (row, tokens) in enumerate(layout.unique):
            if len(tokens) > 1:
                main[row, layout.tail_columns(pair)] = self.tails[(layout.owner(pair), tokens)]
        prefix = rows[0][None, : layout.shared] if layout.shared else None
        return prefix, main
