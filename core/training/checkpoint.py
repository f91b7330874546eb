"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a directory ``<run>/checkpoints/update-000040/`` holding

* ``weights.safetensors``: the trainable parameters (the LoRA adapter, or the whole model);
* ``value_head.safetensors``: the policy's value head;
* ``state.safetensors``: every other tensor of the training state (optimizer moments,
  torch RNG states), referred to by name from ``checkpoint.json``;
* ``checkpoint.json``: what made it (agent, algorithm, model, config), the counters, and
  the rest of the training state as JSON (python/numpy RNG states, optimizer settings);
* ``config.yaml``: the run's config, for people.

Nothing is pickled, so loading a checkpoint never runs code from it. A checkpoint is
written into a hidden sibling directory, flushed to disk and renamed into place: a
crash mid-write leaves the previous checkpoints untouched and no half directory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from llamagym.errors import LlamaGymError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
WEIGHTS = "weights.safetensors"
VALUE_HEAD = "value_head.safetensors"
STATE_TENSORS = "state.safetensors"
META = "checkpoint.json"
CONFIG = "config.yaml"
CHECKPOINTS = "checkpoints"
_NAME = re.compile(r"^update-(\d+)$")

#: Config fields a resumed run must share with its checkpoint: a different value means
#: different weights or a different optimizer, so the saved state cannot apply.
IDENTITY_FIELDS = ("agent.name", "algorithm.name", "model.name", "model.lora", "model.lora_rank")


# -- nested state <-> JSON plus named tensors -------------------------------------------
def encode_state(value: Any, tensors: dict[str, Any]) -> Any:
    """A JSON-safe copy of ``value``; each tensor goes into ``tensors`` under a new name.

    Tuples, numpy arrays and dicts with non-string keys (an optimizer's ``state`` is
    keyed by parameter index) are tagged so :func:`decode_state` restores them exactly.
    """
    import torch

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


# -- random states ---------------------------------------------------------------------
def capture_global_rng() -> dict[str, Any]:
    """The process-wide generators: python ``random``, numpy's legacy one, torch's."""
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_global_rng(state: dict[str, Any]) -> None:
    import torch

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


# -- writing -------------------------------------------------------------------------
def trainable_state(policy: Any) -> dict[str, Any]:
    """The tensors that training changes: the adapter or all of the model, by name."""
    return {
        name: parameter.detach().cpu().contiguous()
        for name, parameter in policy.model.named_parameters()
        if parameter.requires_grad
    }


def _fsync(path: Path) -> None:
    """Flush a file or directory to disk, so a rename never publishes unwritten data."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return  # some filesystems (and Windows directories) cannot be opened this way
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def write_atomically(directory: Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(staging_dir)``, then move the staging dir to ``directory`` in one
    rename. If ``write`` raises (or the process dies) ``directory`` is untouched."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        write(staging)
        for path in staging.iterdir():
            _fsync(path)
        if directory.exists():
            retired = directory.with_name(f".{directory.name}-old")
            shutil.rmtree(retired, ignore_errors=True)
            os.replace(directory, retired)
            os.replace(staging, directory)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, directory)
        _fsync(directory.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return directory


def save_checkpoint(
    policy: Any,
    directory: Path,
    meta: dict[str, Any],
    state: dict[str, Any] | None = None,
    config_yaml: str | None = None,
) -> Path:
    """Write weights, value head, ``meta`` and (optionally) a training ``state``.

    ``state`` may nest tensors, tuples and numpy arrays (see :func:`encode_state`).
    """
    from safetensors.torch import save_file

    def write(staging: Path) -> None:
        save_file(trainable_state(policy), str(staging / WEIGHTS))
        value_head = {k: v.detach().cpu() for k, v in policy.value_head.state_dict().items()}
        save_file(value_head, str(staging / VALUE_HEAD))
        record = dict(meta)
        if state is not None:
            tensors: dict[str, Any] = {}
            record["state"] = encode_state(state, tensors)
            save_file(tensors, str(staging / STATE_TENSORS))
        (staging / META).write_text(json.dumps(record, indent=1, default=str))
        if config_yaml is not None:
            (staging / CONFIG).write_text(config_yaml)

    return write_atomically(Path(directory), write)


def checkpoint_name(update: int) -> str:
    return f"update-{update:06d}"


def save_training_checkpoint(
    run_dir: Path,
    run: Any,
    counters: dict[str, Any],
    config: dict[str, Any],
    config_yaml: str | None = None,
    keep: int | None = None,
    plugins: list[dict[str, Any]] | None = None,
) -> Path:
    """Checkpoint a training run (a :class:`llamagym.run.Run`) after update
    ``counters["updates"]``; keep the last ``keep`` checkpoints of ``run_dir``.
    ``plugins`` lists the plugins that answered per-step hooks so far."""
    from llamagym import __version__

    meta = {
        "format": FORMAT_VERSION,
        "llamagym_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "agent": config["agent"]["name"],
        "algorithm": config["algorithm"]["name"],
        "model": config["model"]["name"],
        "update": counters["updates"],
        "episodes": counters["episodes"],
        "counters": counters,
        "config": config,
        "plugins": plugins or [],
    }
    # The run's state is the sum of its parts' state dicts, and the global RNGs.
    state = {**run.state_dict(), "rng": capture_global_rng()}
    directory = Path(run_dir) / CHECKPOINTS / checkpoint_name(counters["updates"])
    save_checkpoint(run.policy, directory, meta, state, config_yaml)
    if keep is not None:
        prune_checkpoints(run_dir, keep)
    return directory


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints, and staging dirs left by a crash."""
    root = Path(run_dir) / CHECKPOINTS
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".update-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- finding and reading --------------------------------------------------------------
def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.match(path.name)) and (path / META).is_file()
    ]
    return [path for _, path in sorted(found)]


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest checkpoint of the run
    directory ``path``."""
    path = Path(path)
    if (path / META).is_file():
        return path
    found = list_checkpoints(path)
    if found:
        return found[-1]
    if not path.exists():
        raise LlamaGymError(f"{str(path)!r} does not exist; pass a run or checkpoint directory")
    raise LlamaGymError(
        f"{str(path)!r} holds no checkpoint ({META} or {CHECKPOINTS}/update-*/); pass a "
        "run directory or one of its checkpoints"
    )


def run_dir_of(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to."""
    checkpoint = Path(checkpoint).resolve()
    if checkpoint.parent.name == CHECKPOINTS:
        return checkpoint.parent.parent
    return checkpoint.parent


def read_meta(directory: Path) -> dict[str, Any]:
    path = Path(directory) / META
    if not path.is_file():
        raise LlamaGymError(
            f"{str(directory)!r} is not a checkpoint (no {META}); pass a run's checkpoint dir"
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise LlamaGymError(f"{str(path)!r} is damaged: {error}") from None
    algorithm = meta.get("config", {}).get("algorithm")
    if isinstance(algorithm, dict):
        from llamagym.training.algorithm import nest_warm_start_keys

        # Written before the warm-start settings had their own section.
        meta["config"]["algorithm"] = nest_warm_start_keys(algorithm)
    return meta


def _dotted(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_compatible(meta: dict[str, Any], config: dict[str, Any], directory: Path) -> None:
    """Refuse to resume from a checkpoint made by another agent, algorithm or model."""
    saved = meta.get("config", {})
    for key in IDENTITY_FIELDS:
        before, now = _dotted(saved, key), _dotted(config, key)
        if before != now:
            raise LlamaGymError(
                f"cannot resume from {str(directory)!r}: it was trained with {key} = "
                f"{before!r}, this run has {key} = {now!r}; use the same {key} "
                "or start a new run"
            )
    if meta.get("format", 0) > FORMAT_VERSION:
        raise LlamaGymError(
            f"{str(directory)!r} was written by a newer LlamaGym (checkpoint format "
            f"{meta['format']}); upgrade llamagym to resume it"
        )


def load_checkpoint(policy: Any, directory: Path) -> dict[str, Any]:
    """Load the weights and value head of a checkpoint into ``policy``; return its meta."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = read_meta(directory)
    weights = load_file(str(directory / WEIGHTS))
    parameters = dict(policy.model.named_parameters())
    unknown = sorted(set(weights) - set(parameters))
    missing = sorted(n for n, p in parameters.items() if p.requires_grad and n not in weights)
    mismatched = sorted(
        n for n in set(weights) & set(parameters) if weights[n].shape != parameters[n].shape
    )
    problem = next(iter(unknown or missing or mismatched), None)
    if problem is not None:
        raise LlamaGymError(
            f"checkpoint {str(directory)!r} does not match this model (parameter "
            f"{problem!r}); it was trained with model {meta.get('model')!r}"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            parameters[name].copy_(tensor.to(parameters[name].device))
    policy.value_head.load_state_dict(load_file(str(directory / VALUE_HEAD)))
    return meta


def restore_training_checkpoint(directory: Path, run: Any) -> dict[str, Any]:
    """Load weights, optimizer, algorithm, engine and global RNG state into ``run`` (a
    :class:`llamagym.run.Run`); return the saved counters."""
    from safetensors.torch import load_file

    directory = Path(directory)
    meta = load_checkpoint(run.policy, directory)
    if "state" not in meta:
        raise LlamaGymError(
            f"{str(directory)!r} holds weights only (no training state); it can be "
            "evaluated but not resumed"
        )
    tensors = load_file(str(directory / STATE_TENSORS))
    state = decode_state(meta["state"], tensors)
    run.load_state_dict(state)
    # Last: building the model and algorithm above may have drawn random numbers.
    restore_global_rng(state["rng"])
    return dict(meta["counters"])
