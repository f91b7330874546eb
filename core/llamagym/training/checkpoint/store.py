"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is a directory ``<run>/checkpoints/update-000040/`` holding

* ``weights.safetensors``: the trainable parameters (the LoRA adapter, or the whole model);
* ``value_head.safetensors``: the policy's value head;
* ``state.safetensors``: every other tensor of the training state (optimizer moments,
  torch RNG states), referred to by name from ``checkpoint.json``;
* ``checkpoint.json``: what made it (agent, algorithm, model, config), the counters, and
  the rest of the training state as JSON (python/numpy RNG states, optimizer settings);
* ``config.yaml``: the run's config, for people.

A checkpoint is data. Nothing is pickled, and the model section it records never turns on
``trust_remote_code`` (see :func:`untrusted_config` and :func:`check_model_source`), so
loading a checkpoint never runs code from it. A checkpoint is written into a hidden
sibling directory, flushed to disk and renamed into place: a crash or a full disk
mid-write leaves the previous checkpoints untouched and no half directory. A damaged
checkpoint is named and never half-loaded: every tensor is checked against the model or
optimizer it goes into (name, shape, dtype, finite values) before any is copied, and a
run directory whose newest checkpoint is damaged falls back to its newest intact one.

This module writes, finds and reads checkpoints; its pieces have modules of their own
beside it, and their names are imported from there: the errors (``errors``), the
training state as JSON and named tensors (``state``), the checks on tensors before they
load (``tensors``) and on the model a checkpoint names (``trust``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

from llamagym import __version__
from llamagym.algorithms.algorithm_config import nest_warm_start_keys
from llamagym.errors import LlamaGymError
from llamagym.paths import check_own_entry, write_failure, write_failure_text
from llamagym.training.checkpoint.errors import (
    CheckpointError,
    CheckpointWriteError,
    DamagedCheckpointError,
    damaged,
    first_line,
)
from llamagym.training.checkpoint.state import (
    capture_global_rng,
    decode_state,
    encode_state,
    restore_global_rng,
    tensor_names,
)
from llamagym.training.checkpoint.tensors import (
    check_optimizer_state,
    check_tensors,
    load_tensors,
)
from llamagym.training.checkpoint.trust import (
    dotted,
)
from llamagym.training.records.run_files import CheckpointMeta, check, read_json_file

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "FORMAT_VERSION",
    "IDENTITY_FIELDS",
    "META",
    "STATE_TENSORS",
    "VALUE_HEAD",
    "WEIGHTS",
    "check_compatible",
    "check_format",
    "check_intact",
    "checkpoint_name",
    "find_checkpoint",
    "how_to_continue",
    "is_newer_format",
    "list_checkpoints",
    "load_checkpoint",
    "prune_checkpoints",
    "read_meta",
    "restore_training_checkpoint",
    "run_dir_of",
    "save_checkpoint",
    "save_training_checkpoint",
    "trainable_state",
    "write_atomically",
]

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
    check_own_entry(directory.parent, folder=True)  # never written through a link
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
            try:
                os.replace(staging, directory)
            except BaseException:
                os.replace(retired, directory)  # the one there before stays
                raise
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

    def write(staging: Path) -> None:
        # Looked up here, so a replaced ``safetensors.torch.save_file`` is the one used.
        save_file = safetensors.torch.save_file
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


def _set_aside_if_damaged(directory: Path) -> None:
    """A damaged checkpoint about to be written again is kept beside the new one as
    ``update-N.damaged`` (never listed, never pruned), not deleted."""
    if not directory.exists() or _damage(directory) is None:
        return
    aside = directory.with_name(f"{directory.name}.damaged")
    number = 1
    while aside.exists():
        number += 1
        aside = directory.with_name(f"{directory.name}.damaged-{number}")
    os.replace(directory, aside)
    logger.warning("the damaged checkpoint %s is kept as %s; writing it again", directory, aside)


def save_training_checkpoint(
    run_dir: Path,
    run: Any,
    counters: dict[str, Any],
    config: dict[str, Any],
    config_yaml: str | None = None,
    keep: int | None = None,
    plugins: list[dict[str, Any]] | None = None,
) -> Path:
    """Checkpoint a training run (a :class:`llamagym.training.loop.run_state.Run`) after update
    ``counters["updates"]``; keep the last ``keep`` checkpoints of ``run_dir``.
    ``plugins`` lists the plugins that answered per-step hooks so far.

    A write that fails (a full disk) leaves every earlier checkpoint as it was and raises
    :class:`CheckpointWriteError` naming the run directory and the one to resume from."""
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
    try:
        _set_aside_if_damaged(directory)
        save_checkpoint(run.policy, directory, meta, state, config_yaml)
    except Exception as error:
        failure = write_failure(error)
        if failure is None:
            raise
        raise CheckpointWriteError(
            f"could not write checkpoint {directory.name} of run {str(run_dir)!r}: "
            f"{write_failure_text(failure, directory.parent)}, {how_to_continue(run_dir)}"
        ) from error
    if keep is not None:
        prune_checkpoints(run_dir, keep)
    return directory


def how_to_continue(run_dir: Path) -> str:
    """How to go on after a write into ``run_dir`` failed: from its newest intact
    checkpoint (a failed write changes none), or from the start."""
    previous = next(
        (path for path in reversed(list_checkpoints(run_dir)) if _damage(path) is None), None
    )
    if previous is None:
        return "then start the run again (it has no earlier checkpoint)"
    return (
        f"then continue with --resume {run_dir}; the previous checkpoint is intact at "
        f"{str(previous)!r}"
    )


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    """Keep the newest ``keep`` intact checkpoints and any newer than the oldest of them;
    delete the older ones and staging dirs left by a crash. A damaged checkpoint never
    counts: it cannot stand in for an intact one that pruning would delete."""
    root = Path(run_dir) / CHECKPOINTS
    found = list_checkpoints(run_dir)
    intact = [path for path in found if _damage(path) is None]
    if len(intact) > keep:
        oldest_kept = found.index(intact[-keep])
        for old in found[:oldest_kept]:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".update-*"):
        shutil.rmtree(leftover, ignore_errors=True)


# -- finding and reading --------------------------------------------------------------
def list_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first."""
    return [path for path in _checkpoint_dirs(run_dir) if (path / META).is_file()]


def _checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Every ``update-N`` directory of a run, complete or not, oldest first. A symbolic
    link among them (or as ``checkpoints``) is refused: a run resumed from another run's
    checkpoint would write into that run's directory."""
    root = Path(run_dir) / CHECKPOINTS
    check_own_entry(root, folder=True)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if (match := _NAME.match(path.name)) and (path.is_symlink() or path.is_dir()):
            check_own_entry(path, folder=True)
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest intact checkpoint of the
    run directory ``path``.

    A checkpoint given by name must be intact (:func:`check_intact`), or this raises
    :class:`DamagedCheckpointError` naming it. In a run directory a damaged checkpoint is
    skipped with a warning naming it, for the newest intact one before it."""
    path = Path(path)
    if (path / META).is_file():
        if path.parent.name == CHECKPOINTS:  # its run is the one it is in, by no link
            _checkpoint_dirs(path.parent.parent)
        try:
            check_intact(path)
        except DamagedCheckpointError as error:
            raise DamagedCheckpointError(
                f"{error}; pass another checkpoint, or the run directory "
                f"{str(run_dir_of(path))!r} to use its newest intact one"
            ) from None
        return path
    candidates = _checkpoint_dirs(path)
    damaged: list[DamagedCheckpointError] = []
    for candidate in reversed(candidates):
        try:
            check_intact(candidate)
        except DamagedCheckpointError as error:
            damaged.append(error)
            continue
        for skipped in damaged:
            logger.warning(
                "%s; skipped, using %s, the newest intact checkpoint", skipped, candidate
            )
        return candidate
    if damaged:
        more = f" (and {len(damaged) - 1} older damaged one(s))" if len(damaged) > 1 else ""
        raise DamagedCheckpointError(
            f"{str(path)!r} holds no intact checkpoint: {damaged[0]}{more}"
        )
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
    """The checkpoint's ``checkpoint.json``, checked against its schema
    (:class:`~llamagym.training.records.run_files.CheckpointMeta`: counters are counts, the config
    sections mappings...), or :class:`DamagedCheckpointError` naming the checkpoint and
    the field."""
    path = Path(directory) / META
    if not path.is_file():
        raise LlamaGymError(
            f"{str(directory)!r} is not a checkpoint (no {META}); pass a run's checkpoint dir"
        )
    try:
        meta = read_json_file(path)
    except ValueError as error:
        raise damaged(directory, f"{META} {error}") from None
    except OSError as error:
        raise damaged(directory, f"{META} cannot be read ({first_line(error)})") from None
    problem = _meta_problem(meta)
    if problem is not None:
        raise damaged(directory, f"{META} {problem}")
    algorithm = meta["config"].get("algorithm")
    if isinstance(algorithm, dict):
        # Written before the warm-start settings had their own section.
        meta["config"]["algorithm"] = nest_warm_start_keys(algorithm)
    return meta


def _meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` unusable as a checkpoint's record, if anything."""
    problem = check(CheckpointMeta, meta)
    if problem is not None:
        return problem
    recorded, model = meta.get("model"), meta["config"].get("model", {})
    if recorded is not None and "name" in model and recorded != model["name"]:
        return f"names two models: {recorded!r} and {model['name']!r} in its config"
    return None


def _damage(directory: Path) -> str | None:
    """Why the checkpoint ``directory`` is damaged, or ``None`` when it is intact: its
    record reads, and every tensor file it needs is complete with the tensors it names.
    A checkpoint of a newer format is judged by its record alone (its files may differ)."""
    try:
        meta = read_meta(directory)
    except DamagedCheckpointError as error:
        return str(error)
    except LlamaGymError:
        return f"checkpoint {str(directory)!r} is damaged: it has no {META}"
    if meta.get("format", 0) > FORMAT_VERSION:
        return None
    needed = [WEIGHTS, VALUE_HEAD] + ([STATE_TENSORS] if "state" in meta else [])
    for name in needed:
        path = Path(directory) / name
        if not path.is_file():
            return f"checkpoint {str(directory)!r} is damaged: {name} is missing"
        try:
            with safe_open(str(path), framework="pt") as handle:
                keys = set(handle.keys())
        except (SafetensorError, OSError) as error:
            return (
                f"checkpoint {str(directory)!r} is damaged: {name} is truncated or not a "
                f"safetensors file ({first_line(error)})"
            )
        if name == STATE_TENSORS:
            absent = sorted(tensor_names(meta["state"]) - keys)
            if absent:
                return (
                    f"checkpoint {str(directory)!r} is damaged: {STATE_TENSORS} lacks "
                    f"tensor {absent[0]!r} that {META} refers to"
                )
    return None


def check_intact(directory: Path) -> dict[str, Any]:
    """The record of the checkpoint ``directory``, after checking that its files are
    complete; :class:`DamagedCheckpointError` naming it otherwise."""
    problem = _damage(Path(directory))
    if problem is not None:
        raise DamagedCheckpointError(problem)
    return read_meta(directory)


def is_newer_format(meta: dict[str, Any]) -> bool:
    return int(meta.get("format", 0)) > FORMAT_VERSION


def check_format(meta: dict[str, Any], directory: Path) -> None:
    """Refuse to resume a checkpoint of a newer format, naming both versions."""
    if is_newer_format(meta):
        raise CheckpointError(
            f"cannot resume from {str(directory)!r}: it was written in checkpoint format "
            f"{meta['format']} (llamagym {meta.get('llamagym_version', '?')}), this llamagym "
            f"{__version__} reads format {FORMAT_VERSION} and older; upgrade llamagym to "
            "resume it (llamagym eval can still evaluate it)"
        )


def check_compatible(meta: dict[str, Any], config: dict[str, Any], directory: Path) -> None:
    """Refuse to resume from a checkpoint made by another agent, algorithm or model."""
    check_format(meta, directory)
    saved = meta.get("config", {})
    for key in IDENTITY_FIELDS:
        before, now = dotted(saved, key), dotted(config, key)
        if before != now:
            raise LlamaGymError(
                f"cannot resume from {str(directory)!r}: it was trained with {key} = "
                f"{before!r}, this run has {key} = {now!r}; use the same {key} "
                "or start a new run"
            )


# -- loading tensors ---------------------------------------------------------------------
def _read_weights(
    policy: Any, directory: Path, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's weights and value head, checked against ``policy``; nothing is
    copied yet."""
    trained_with = f"model {meta.get('model')!r}"
    weights = load_tensors(directory, WEIGHTS)
    parameters = dict(policy.model.named_parameters())
    trainable = {name for name, parameter in parameters.items() if parameter.requires_grad}
    check_tensors(weights, parameters, directory, "parameter", trained_with, trainable)
    value_head = load_tensors(directory, VALUE_HEAD)
    expected = policy.value_head.state_dict()
    check_tensors(value_head, expected, directory, "value head tensor", trained_with,
                   set(expected))
    return weights, value_head


def _copy_weights(policy: Any, weights: dict[str, Any], value_head: dict[str, Any]) -> None:
    parameters = dict(policy.model.named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            parameters[name].copy_(tensor.to(parameters[name].device))
    policy.value_head.load_state_dict(value_head)


def load_checkpoint(policy: Any, directory: Path) -> dict[str, Any]:
    """Load the weights and value head of a checkpoint into ``policy``; return its meta.
    Every tensor is checked (name, shape, dtype, finite values) before any is copied."""
    directory = Path(directory)
    meta = read_meta(directory)
    weights, value_head = _read_weights(policy, directory, meta)
    _copy_weights(policy, weights, value_head)
    return meta


def restore_training_checkpoint(directory: Path, run: Any) -> dict[str, Any]:
    """Load weights, optimizer, algorithm, engine and global RNG state into ``run`` (a
    :class:`llamagym.training.loop.run_state.Run`); return the saved counters. Everything
    is read and checked before anything is loaded."""
    directory = Path(directory)
    meta = read_meta(directory)
    if "state" not in meta:
        raise LlamaGymError(
            f"{str(directory)!r} holds weights only (no training state); it can be "
            "evaluated but not resumed"
        )
    weights, value_head = _read_weights(run.policy, directory, meta)
    tensors = load_tensors(directory, STATE_TENSORS)
    try:
        state = decode_state(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise damaged(
            directory, f"its training state does not decode ({first_line(error)})"
        ) from None
    absent = [key for key in ("algorithm", "engine", "rng") if key not in state]
    if absent or not isinstance(meta.get("counters"), dict):
        raise damaged(directory, f"its training state lacks {(absent or ['counters'])[0]!r}")
    algorithm_state = state["algorithm"]
    check_optimizer_state(
        algorithm_state.get("optimizer") if isinstance(algorithm_state, dict) else None,
        getattr(run.algorithm, "optimizer", None),
        run.policy,
        directory,
    )
    _copy_weights(run.policy, weights, value_head)
    try:
        run.load_state_dict(state)
        # Last: building the model and algorithm above may have drawn random numbers.
        restore_global_rng(state["rng"])
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise damaged(
            directory, f"its training state does not fit this run ({first_line(error)})"
        ) from None
    return dict(meta["counters"])

