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
"""

from __future__ import annotations

import copy
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
from llamagym.paths import write_failure, write_failure_text

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
#: How a user lets a checkpoint's model run its own code, wherever a checkpoint is loaded.
TRUST_HINT = (
    "llamagym eval (or play) --trust-remote-code, llamagym run --resume ... "
    "--trust-remote-code, or load_agent(..., trust_remote_code=True)"
)
#: The optimizer moments that have one value per parameter entry (Adam, AdamW, SGD).
PARAMETER_SHAPED_MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")


class CheckpointError(LlamaGymError):
    """A checkpoint that cannot be used as asked."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint's files are missing, unreadable, truncated or inconsistent."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint's tensors do not fit the model or optimizer they would load into."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a read-only directory)."""


class UntrustedModelError(CheckpointError):
    """A checkpoint names a model that would run code of its own, and nobody allowed it."""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


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
    """Checkpoint a training run (a :class:`llamagym.run.Run`) after update
    ``counters["updates"]``; keep the last ``keep`` checkpoints of ``run_dir``.
    ``plugins`` lists the plugins that answered per-step hooks so far.

    A write that fails (a full disk) leaves every earlier checkpoint as it was and raises
    :class:`CheckpointWriteError` naming the run directory and the one to resume from."""
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
    """Every ``update-N`` directory of a run, complete or not, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.match(path.name)) and path.is_dir()
    ]
    return [path for _, path in sorted(found)]


def find_checkpoint(path: Path) -> Path:
    """``path`` itself if it is a checkpoint, else the newest intact checkpoint of the
    run directory ``path``.

    A checkpoint given by name must be intact (:func:`check_intact`), or this raises
    :class:`DamagedCheckpointError` naming it. In a run directory a damaged checkpoint is
    skipped with a warning naming it, for the newest intact one before it."""
    path = Path(path)
    if (path / META).is_file():
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


def _damaged(directory: Path, problem: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(f"checkpoint {str(directory)!r} is damaged: {problem}")


def read_meta(directory: Path) -> dict[str, Any]:
    """The checkpoint's ``checkpoint.json``, checked against its schema
    (:class:`~llamagym.training.run_files.CheckpointMeta`: counters are counts, the config
    sections mappings...), or :class:`DamagedCheckpointError` naming the checkpoint and
    the field."""
    from llamagym.training.run_files import read_json_file

    path = Path(directory) / META
    if not path.is_file():
        raise LlamaGymError(
            f"{str(directory)!r} is not a checkpoint (no {META}); pass a run's checkpoint dir"
        )
    try:
        meta = read_json_file(path)
    except ValueError as error:
        raise _damaged(directory, f"{META} {error}") from None
    except OSError as error:
        raise _damaged(directory, f"{META} cannot be read ({_first_line(error)})") from None
    problem = _meta_problem(meta)
    if problem is not None:
        raise _damaged(directory, f"{META} {problem}")
    algorithm = meta["config"].get("algorithm")
    if isinstance(algorithm, dict):
        from llamagym.training.algorithm import nest_warm_start_keys

        # Written before the warm-start settings had their own section.
        meta["config"]["algorithm"] = nest_warm_start_keys(algorithm)
    return meta


def _meta_problem(meta: Any) -> str | None:
    """What makes ``meta`` unusable as a checkpoint's record, if anything."""
    from llamagym.training.run_files import CheckpointMeta, check

    problem = check(CheckpointMeta, meta)
    if problem is not None:
        return problem
    recorded, model = meta.get("model"), meta["config"].get("model", {})
    if recorded is not None and "name" in model and recorded != model["name"]:
        return f"names two models: {recorded!r} and {model['name']!r} in its config"
    return None


def _tensor_names(value: Any) -> set[str]:
    """The tensor names an encoded state refers to."""
    if isinstance(value, list):
        return set().union(*(_tensor_names(item) for item in value))
    if isinstance(value, dict):
        if isinstance(value.get("__tensor__"), str):
            return {value["__tensor__"]}
        return set().union(*(_tensor_names(item) for item in value.values()))
    return set()


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
    from safetensors import SafetensorError, safe_open

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
                f"safetensors file ({_first_line(error)})"
            )
        if name == STATE_TENSORS:
            absent = sorted(_tensor_names(meta["state"]) - keys)
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


def _dotted(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def is_newer_format(meta: dict[str, Any]) -> bool:
    return int(meta.get("format", 0)) > FORMAT_VERSION


def check_format(meta: dict[str, Any], directory: Path) -> None:
    """Refuse to resume a checkpoint of a newer format, naming both versions."""
    if is_newer_format(meta):
        from llamagym import __version__

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
        before, now = _dotted(saved, key), _dotted(config, key)
        if before != now:
            raise LlamaGymError(
                f"cannot resume from {str(directory)!r}: it was trained with {key} = "
                f"{before!r}, this run has {key} = {now!r}; use the same {key} "
                "or start a new run"
            )


# -- the model a checkpoint names --------------------------------------------------------
def untrusted_config(meta: dict[str, Any]) -> dict[str, Any]:
    """A copy of a checkpoint's config to build a run or agent from, with
    ``model.trust_remote_code`` off: only the user can turn it on, never the checkpoint."""
    config = copy.deepcopy(meta["config"])
    model = config.setdefault("model", {})
    model["trust_remote_code"] = False
    return config


def _code_map(model_name: str) -> tuple[str, str] | None:
    """The file of the local model directory ``model_name`` that maps classes to Python
    code of its own (``auto_map``) and the modules it names; ``None`` for anything else
    (the tiny model, a Hub id, a GGUF file, a directory without ``auto_map``)."""
    if not model_name or model_name.strip().lower() == "tiny":
        return None
    local = Path(model_name).expanduser()
    if not local.is_dir():
        return None
    for name in ("config.json", "tokenizer_config.json"):
        try:
            data = json.loads((local / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            targets = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            modules = sorted(
                {
                    str(target).split(".")[0]
                    for item in targets
                    for target in (item if isinstance(item, (list, tuple)) else [item])
                    if target
                }
            )
            return name, ", ".join(modules) or "?"
    return None


def check_model_source(
    meta: dict[str, Any], model_name: str, trust_remote_code: bool, directory: Path
) -> None:
    """Before the model of a checkpoint (``meta``) is loaded as ``model_name``: with
    ``trust_remote_code`` (which only the user can give) a warning that the model's own
    code will run; without it, a local model directory that maps classes to its own
    Python code (``auto_map``) is refused, since loading it would either run that code
    or quietly swap in another class. A checkpoint that recorded
    ``trust_remote_code = true`` says so in a warning."""
    if trust_remote_code:
        logger.warning(
            "trust_remote_code is on: loading model %r (checkpoint %s) will run Python code "
            "that comes with it",
            model_name,
            directory,
        )
        return
    code = _code_map(model_name)
    if code is not None:
        file, modules = code
        raise UntrustedModelError(
            f"checkpoint {str(directory)!r} names model {model_name!r}, a local directory "
            f"whose {file} maps classes to Python code of its own (auto_map: {modules}); "
            f"loading it would run that code, so it is refused (if you trust that code, "
            f"allow it: {TRUST_HINT})"
        )
    if _dotted(meta.get("config", {}), "model.trust_remote_code") is True:
        logger.warning(
            "checkpoint %s records model.trust_remote_code = true; a checkpoint cannot turn "
            "it on, so model %r loads without its own code (if you trust that code, allow "
            "it: %s)",
            directory,
            model_name,
            TRUST_HINT,
        )


# -- loading tensors ---------------------------------------------------------------------
def _load_tensors(directory: Path, name: str) -> dict[str, Any]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory) / name
    if not path.is_file():
        raise _damaged(directory, f"{name} is missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as error:
        raise _damaged(
            directory, f"{name} is truncated or not a safetensors file ({_first_line(error)})"
        ) from None


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensors(
    saved: dict[str, Any],
    expected: dict[str, Any],
    directory: Path,
    what: str,
    trained_with: str,
    required: set[str],
) -> None:
    """Every saved tensor must have a place in ``expected`` with the same shape and
    dtype, and finite values; every name in ``required`` must be saved."""
    import torch

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
            raise _damaged(
                directory, f"{what} {name!r} holds NaN or infinite values; use an earlier "
                "checkpoint of the run"
            )


def _read_weights(
    policy: Any, directory: Path, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's weights and value head, checked against ``policy``; nothing is
    copied yet."""
    trained_with = f"model {meta.get('model')!r}"
    weights = _load_tensors(directory, WEIGHTS)
    parameters = dict(policy.model.named_parameters())
    trainable = {name for name, parameter in parameters.items() if parameter.requires_grad}
    _check_tensors(weights, parameters, directory, "parameter", trained_with, trainable)
    value_head = _load_tensors(directory, VALUE_HEAD)
    expected = policy.value_head.state_dict()
    _check_tensors(value_head, expected, directory, "value head tensor", trained_with,
                   set(expected))
    return weights, value_head


def _copy_weights(policy: Any, weights: dict[str, Any], value_head: dict[str, Any]) -> None:
    import torch

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


def _check_optimizer_state(saved: Any, optimizer: Any, policy: Any, directory: Path) -> None:
    """A saved optimizer state must fit ``optimizer``: as many groups and parameters,
    and each per-parameter moment shaped like its parameter, with finite values."""
    import torch

    if saved is None or not isinstance(optimizer, torch.optim.Optimizer):
        return
    groups, state = (saved.get("param_groups"), saved.get("state")) if isinstance(
        saved, dict
    ) else (None, None)
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise _damaged(directory, "its optimizer state has no parameter groups")
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
                raise _damaged(
                    directory, f"optimizer state {key!r} of parameter {name!r} holds NaN "
                    "or infinite values"
                )


def restore_training_checkpoint(directory: Path, run: Any) -> dict[str, Any]:
    """Load weights, optimizer, algorithm, engine and global RNG state into ``run`` (a
    :class:`llamagym.run.Run`); return the saved counters. Everything is read and
    checked before anything is loaded."""
    directory = Path(directory)
    meta = read_meta(directory)
    if "state" not in meta:
        raise LlamaGymError(
            f"{str(directory)!r} holds weights only (no training state); it can be "
            "evaluated but not resumed"
        )
    weights, value_head = _read_weights(run.policy, directory, meta)
    tensors = _load_tensors(directory, STATE_TENSORS)
    try:
        state = decode_state(meta["state"], tensors)
    except (KeyError, TypeError, ValueError) as error:
        raise _damaged(
            directory, f"its training state does not decode ({_first_line(error)})"
        ) from None
    absent = [key for key in ("algorithm", "engine", "rng") if key not in state]
    if absent or not isinstance(meta.get("counters"), dict):
        raise _damaged(directory, f"its training state lacks {(absent or ['counters'])[0]!r}")
    algorithm_state = state["algorithm"]
    _check_optimizer_state(
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
        raise _damaged(
            directory, f"its training state does not fit this run ({_first_line(error)})"
        ) from None
    return dict(meta["counters"])
