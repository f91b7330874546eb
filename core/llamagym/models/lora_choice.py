"""When a model trains through a LoRA adapter rather than whole: the rule the loader,
the config resolver and the run apply. Reads the model object only (no torch import),
so the agent and its config layers stay light."""

from __future__ import annotations

from typing import Any

# Above this many parameters full fine-tuning stops being practical on the
# machines LlamaGym targets, so lora=None switches LoRA on.
LORA_AUTO_THRESHOLD = 50_000_000


def count_parameters(model: Any) -> int:
    try:
        return int(model.num_parameters())
    except Exception:  # noqa: BLE001 - a count is only advisory; fall back to numel
        return sum(p.numel() for p in model.parameters())


def uses_lora_by_default(model: Any, quantized: bool = False) -> bool:
    """LoRA for quantized models (their base weights cannot train) and for models above
    ``LORA_AUTO_THRESHOLD`` parameters; full fine-tuning for smaller ones."""
    return quantized or count_parameters(model) > LORA_AUTO_THRESHOLD


def trains_through_lora(model: Any, lora: bool | None = None) -> bool:
    """Whether a model object trains through a LoRA adapter: it carries one, or it gets
    one (``lora``, else :func:`uses_lora_by_default`). A value-head wrapper (the original
    LlamaGym's) is judged by the LM inside it."""
    model = getattr(model, "pretrained_model", model)
    if hasattr(model, "peft_config"):
        return True
    return lora if lora is not None else uses_lora_by_default(model)
