"""The frozen trunk at a lower precision: where it pays, and the casts at its edges.

With ``model.lora_layers: N`` the decoder layers below the last N hold no trainable
weight (:mod:`llamagym.models.trunk`). Nothing flows back through them, so their matrix
products can run in bfloat16 while the trained layers, the value head and the loss stay
in float32. The weights of the trunk's layers are cast once, and each runs under
autocast: its linear layers and attention compute in bfloat16 while the residual stream
and the norms stay in float32 (casting the whole layer, the residual stream included,
moved SmolLM2's action log-probabilities twice as far from float32's). The layers above
are handed float32 as before, so the trunk's kept output (:class:`TrunkStates`) stays
float32 and a pass from it equals a whole pass. The keys and values each layer keeps
(the turn cache's) are in the dtype it computes in.

``model.trunk_dtype: auto`` chooses bfloat16 where the hardware computes it natively and
float32 elsewhere (an emulated bfloat16 matmul is slower than a float32 one);
``float32`` keeps every number as it was.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llamagym.models.decoder import decoder_and_head
from llamagym.models.trunk import decoder_layers, first_trained_layer

logger = logging.getLogger(__name__)

#: ``model.trunk_dtype`` values and the dtypes they name (auto is decided per machine).
TRUNK_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: CPU flags (Linux's /proc/cpuinfo) that mean bfloat16 matrix products in hardware.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_bf16_flags() -> tuple[str, ...]:
    """The CPU's bfloat16 flags (empty where none, or where they cannot be read)."""
    if not sys.platform.startswith("linux"):
        return ()
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="ascii", errors="replace")
    except OSError:
        return ()
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return tuple(flag for flag in NATIVE_BF16_FLAGS if flag in flags)


def choose_trunk_dtype(setting: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The dtype ``model.trunk_dtype`` (``auto``, ``float32``, ``bfloat16``) gives on
    ``device``, and why, in words for the run's first lines."""
    if setting != "auto":
        return TRUNK_DTYPES[setting], f"model.trunk_dtype={setting}"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "this GPU computes bfloat16 natively"
        return torch.float32, "this GPU has no native bfloat16"
    if device.type == "cpu":
        flags = cpu_bf16_flags()
        if flags:
            return torch.bfloat16, f"this CPU has {', '.join(flags)}"
        return torch.float32, "this CPU has no avx512_bf16 or amx_bf16"
    return torch.float32, f"no native bfloat16 known on {device.type}"


def _under_autocast(forward: Any, device_type: str, dtype: torch.dtype) -> Any:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return forward(*args, **kwargs)

    return run


def lower_trunk_precision(model: nn.Module, setting: str, device: torch.device) -> int:
    """Run the frozen trunk of ``model`` in the dtype ``setting`` chooses (see the module
    docstring); returns how many layers it holds (0: no trunk, nothing changed). Says
    in the log what was chosen and why."""
    decoder = decoder_and_head(model)[0]
    start = first_trained_layer(decoder)
    layers = decoder_layers(decoder)
    if not start or layers is None:
        return 0
    dtype, why = choose_trunk_dtype(setting, device)
    trunk = [p for layer in layers[:start] for p in layer.parameters()]
    if not all(p.is_floating_point() for p in trunk):  # quantized (4/8-bit): as it is
        return start
    if all(p.dtype == dtype for p in trunk):  # loaded so, or lowered already
        logger.info("frozen trunk (layers 0-%d) in %s (%s)", start - 1,
                    str(trunk[0].dtype).removeprefix("torch."), why)
        return start

    for layer in layers[:start]:
        layer.to(dtype)
        layer.forward = _under_autocast(layer.forward, device.type, dtype)
    logger.info("frozen trunk (layers 0-%d) in %s (%s; model.trunk_dtype=float32 turns it "
                "off)", start - 1, str(dtype).removeprefix("torch."), why)
    return start


