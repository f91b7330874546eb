"""Checkpoints: trainable weights and value head as safetensors, plus what made them.

A checkpoint is written into a temporary sibling directory and renamed into place, so
a crash mid-write leaves the previous checkpoint intact. Nothing here unpickles.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from llamagym.errors import LlamaGymError

WEIGHTS = "weights.safetensors"
VALUE_HEAD = "value_head.safetensors"
META = "checkpoint.json"


def trainable_state(policy: Any) -> dict[str, Any]:
    """The tensors that training changes: the adapter or all of the model, by name."""
    return {
        name: parameter.detach().cpu().contiguous()
        for name, parameter in policy.model.named_parameters()
        if parameter.requires_grad
    }


def save_checkpoint(policy: Any, directory: Path, meta: dict[str, Any]) -> Path:
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        save_file(trainable_state(policy), str(staging / WEIGHTS))
        value_head = {k: v.detach().cpu() for k, v in policy.value_head.state_dict().items()}
        save_file(value_head, str(staging / VALUE_HEAD))
        (staging / META).write_text(json.dumps(meta, indent=2, default=str))
        if directory.exists():
            retired = directory.with_name(f".{directory.name}-old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(directory, retired)
            os.replace(staging, directory)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def read_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory) / META
    if not path.is_file():
        raise LlamaGymError(
            f"{str(directory)!r} is not a checkpoint (no {META}); pass a run's checkpoint dir"
        )
    return json.loads(path.read_text())


def load_checkpoint(policy: Any, directory: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    meta = read_meta(directory)
    weights = load_file(str(Path(directory) / WEIGHTS))
    parameters = dict(policy.model.named_parameters())
    unknown = sorted(set(weights) - set(parameters))
    if unknown:
        raise LlamaGymError(
            f"checkpoint {str(directory)!r} does not match this model "
            f"(e.g. parameter {unknown[0]!r}); was it trained with model {meta.get('model')!r}?"
        )
    import torch

    with torch.no_grad():
        for name, tensor in weights.items():
            parameters[name].copy_(tensor.to(parameters[name].device))
    policy.value_head.load_state_dict(load_file(str(Path(directory) / VALUE_HEAD)))
    return meta
