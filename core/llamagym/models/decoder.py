"""The transformers decoder as the policy's passes call it: the decoder stack and LM head
of a causal LM (PEFT-wrapped or not), its key/value cache across transformers versions,
which attention mask it takes, and what the policy reads from its config.

These are the places where models and transformers versions differ; the passes in
passes.py and turn_passes.py, and the policy itself, go through them.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import DynamicCache

from llamagym.errors import ModelLoadError

if TYPE_CHECKING:
    from transformers.modeling_layers import GradientCheckpointingLayer


def is_peft(model: nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (a LoRA adapter around the LM)."""
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The causal LM's decoder stack (hidden states out) and its LM head, so the head
    runs only where log-probabilities are needed. A LoRA model's adapters live inside
    these modules, so calling them directly keeps (or, disabled, skips) the adapter."""
    # PEFT's and transformers' methods: torch's stubs type module attributes Tensor | Module.
    base = model.get_base_model() if is_peft(model) else model  # type: ignore[operator]
    return base.get_decoder(), base.get_output_embeddings()  # type: ignore[operator]


def checkpointable_layers(model: nn.Module) -> list[GradientCheckpointingLayer]:
    """The decoder layers transformers can checkpoint (none for other models)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # transformers before 4.52
        return []
    return [module for module in model.modules() if isinstance(module, GradientCheckpointingLayer)]


def cache_keyword(decoder: nn.Module) -> str:
    """The name a decoder's forward (and so generate) takes a key/value cache by:
    ``cache`` since transformers 5.24, ``past_key_values`` before (the old name warns)."""
    return "cache" if "cache" in inspect.signature(type(decoder).forward).parameters else (
        "past_key_values"
    )


def new_cache(output: Any) -> Any:
    """The cache a forward with ``use_cache=True`` returned (None if the model keeps none)."""
    return output["cache"] if "cache" in output else output.get("past_key_values")


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values) in a transformers cache."""
    if hasattr(cache, "layers"):  # transformers 4.56+
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


@functools.cache
def prefix_cache_class() -> type:
    """The cache class of a pass that runs after a read-only prefix (made on first
    use)."""

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


def uses_additive_mask(model: nn.Module) -> bool:
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


def model_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter is (CPU for a model with none)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def hidden_size(model: nn.Module) -> int:
    """The width of the decoder's hidden states, which the value head reads."""
    config = model.config
    for attribute in ("hidden_size", "n_embd", "d_model"):
        if getattr(config, attribute, None):
            return int(getattr(config, attribute))
    # transformers' method: torch's stubs type module attributes Tensor | Module.
    return int(model.get_input_embeddings().embedding_dim)  # type: ignore[operator]


def max_context(model: nn.Module, tokenizer) -> int:
    """The longest context the model takes: its position limit, or the tokenizer's where
    that is lower (2,048 where the config names none)."""
    limit = getattr(model.config, "max_position_embeddings", None) or 2048
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if tokenizer_limit and tokenizer_limit < 1_000_000:
        limit = min(limit, tokenizer_limit)
    return int(limit)
