"""A checkpoint's tensors read from disk and checked against where they go (the model,
its value head, the optimizer) before any is copied: name, shape, dtype, finite values."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from llamagym.training.checkpoint.errors import (
    CheckpointMismatchError,
    damaged,
    first_line,
)

#: The optimizer moments that have one value per parameter entry (Adam, AdamW, SGD).
PARAMETER_SHAPED_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


def load_tensors(directory: Path, name: str) -> dict[str, Any]:
    path = Path(directory) / name
    if not path.is_file():
        raise damaged(directory, f"{name} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise damaged(
            directory, f"{name} is truncated or not a safetensors file ({first_line(error)})"
        ) from None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def check_tensors(
    saved: dict[str, Any],
    expected: dict[str, Any],
    directory: Path,
    what: str,
    trained_with: str,
    required: set[str],
) -> None:
    """Every saved tensor must have a place in ``expected`` with the same shape and
    dtype, and finite values; every name in ``required`` must be saved."""
    unknown = sorted(set(saved) - set(expected))
    missing = sorted(required - set(saved))
    if unknown or missing:
        name, where = (unknown[0], "this model has none") if unknown else (
            missing[0], "the checkpoint has none"
        )
        raise CheckpointMismatchError(
            f"checkpoint {str(directory)!r} does not match this model: {what} {name!r} "
            f"({where}); it was trained with {trained_with}"
        )
    for name in sorted(saved):
        tensor, target = saved[name], expected[name]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointMismatchError(
                f"checkpoint {str(directory)!r} does not match this model: {what} {name!r} "
                f"has shape {tuple(tensor.shape)} in the checkpoint, {tuple(target.shape)} "
                f"in the model; it was trained with {trained_with}"
            )
        if tensor.dtype != target.dtype:
            wanted = _dtype_name(tensor.dtype)
            raise CheckpointMismatchError(
                f"checkpoint {str(directory)!r} does not match this model: {what} {name!r} "
                f"is {wanted} in the checkpoint, {_dtype_name(target.dtype)} in the model "
                f"(it is not converted); load the model as {wanted} "
                f"(--set model.dtype={wanted})"
            )
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise damaged(
                directory, f"{what} {name!r} holds NaN or infinite values; use an earlier "
                "checkpoint of the run"
            )


def check_optimizer_state(saved: Any, optimizer: Any, policy: Any, directory: Path) -> None:
    """A saved optimizer state must fit ``optimizer``: as many groups and parameters,
    and each per-parameter moment shaped like its parameter, with finite values."""
    if saved is None or not isinstance(optimizer, torch.optim.Optimizer):
        return
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(
        saved, dict
    ) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise damaged(directory, "its optimizer state has no parameter groups")
    prefix = f"checkpoint {str(directory)!r} does not match this run: its optimizer"
    if len(groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(
            f"{prefix} has {len(groups)} parameter group(s), this run's "
            f"{len(optimizer.param_groups)}"
        )
    parameters: dict[Any, Any] = {}
    for number, (group, live) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(live["params"]):
            count = len(ids) if isinstance(ids, list) else 0
            raise CheckpointMismatchError(
                f"{prefix} has {count} parameter(s) in group {number}, this run's "
                f"{len(live['params'])}"
            )
        parameters.update(zip(ids, live["params"], strict=True))
    names = {id(p): n for n, p in policy.model.named_parameters()}
    names.update({id(p): f"value_head.{n}" for n, p in policy.value_head.named_parameters()})
    for index, moments in state.items():
        parameter = parameters.get(index)
        if parameter is None or not isinstance(moments, dict):
            raise CheckpointMismatchError(
                f"{prefix} has state for parameter {index!r}, which this run's has not"
            )
        name = names.get(id(parameter), f"#{index}")
        for key, value in moments.items():
            if not isinstance(value, torch.Tensor):
                continue
            if key in PARAMETER_SHAPED_MOMENTS and value.shape != parameter.shape:
                raise CheckpointMismatchError(
                    f"{prefix} state {key!r} of parameter {name!r} has shape "
                    f"{tuple(value.shape)}, the parameter {tuple(parameter.shape)}"
                )
            if value.is_floating_point() and not bool(torch.isfinite(value).all()):
                raise damaged(
                    directory, f"optimizer state {key!r} of parameter {name!r} holds NaN "
                    "or infinite values"
                )
