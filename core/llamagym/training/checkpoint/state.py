"""A checkpoint's training state: nested values as JSON with their tensors stored apart
by name, and the process-wide random generators."""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

# The warnings of checkpoints come from one logger, whichever module gives them.
logger = logging.getLogger("llamagym.training.checkpoint.store")


# -- nested state <-> JSON plus named tensors -------------------------------------------
def encode_state(value: Any, tensors: dict[str, Any]) -> Any:
    """A JSON-safe copy of ``value``; each tensor goes into ``tensors`` under a new name.

    Tuples, numpy arrays and dicts with non-string keys (an optimizer's ``state`` is
    keyed by parameter index) are tagged so :func:`decode_state` restores them exactly.
    """
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(value, np.ndarray):
        return {"__ndarray__": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, tuple):
        return {"__tuple__": [encode_state(item, tensors) for item in value]}
    if isinstance(value, list):
        return [encode_state(item, tensors) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("__") for key in value):
            return {key: encode_state(item, tensors) for key, item in value.items()}
        return {
            "__items__": [
                [encode_state(key, tensors), encode_state(item, tensors)]
                for key, item in value.items()
            ]
        }
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a checkpoint cannot hold a {type(value).__name__} ({value!r:.80})")


def decode_state(value: Any, tensors: dict[str, Any]) -> Any:
    """The inverse of :func:`encode_state`."""
    if isinstance(value, list):
        return [decode_state(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__ndarray__" in value:
        return np.asarray(value["__ndarray__"], dtype=value["dtype"])
    if "__tuple__" in value:
        return tuple(decode_state(item, tensors) for item in value["__tuple__"])
    if "__items__" in value:
        return {
            decode_state(key, tensors): decode_state(item, tensors)
            for key, item in value["__items__"]
        }
    return {key: decode_state(item, tensors) for key, item in value.items()}


def tensor_names(value: Any) -> set[str]:
    """The tensor names an encoded state refers to."""
    if isinstance(value, list):
        return set().union(*(tensor_names(item) for item in value))
    if isinstance(value, dict):
        if isinstance(value.get("__tensor__"), str):
            return {value["__tensor__"]}
        return set().union(*(tensor_names(item) for item in value.values()))
    return set()


# -- random states ---------------------------------------------------------------------
def capture_global_rng() -> dict[str, Any]:
    """The process-wide generators: python ``random``, numpy's legacy one, torch's."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_global_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            logger.warning(
                "checkpoint has CUDA random states for %d devices, this machine has %d: "
                "GPU sampling will not repeat the original run exactly",
                len(cuda),
                torch.cuda.device_count(),
            )
