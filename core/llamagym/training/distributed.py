"""Data-parallel training over several processes.

``accelerate launch --multi_gpu --num_processes N -m llamagym.cli run AGENT ...`` (or
``llamagym run AGENT --num-processes N``, which does the same) starts N processes,
each of which runs the whole ``llamagym run``:

* every process (rank) holds the whole model and starts from rank 0's weights, steps its
  own environments with its own seeds, and computes the loss of its own episodes;
* :meth:`llamagym.training.algorithm.Algorithm.step` averages the gradients over the processes
  before the optimizer step, so the weights stay identical everywhere;
* what decides control flow is agreed: the number of gradient steps per epoch (the
  smallest over the processes), the target-KL stop (the largest KL), a non-finite loss
  (skipped everywhere), the adaptive KL coefficient, the episode and time budgets and a
  stop signal. An algorithm agrees through the ``group`` it is given
  (:func:`process_group`), in its methods named ``sync_*``;
* rank 0 alone writes the run directory, shows progress and evaluates.

With one process every function here is a no-op: nothing from accelerate is imported,
no collective runs, and a run computes exactly what it computes without this module.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from llamagym.errors import ConfigError, LlamaGymError

logger = logging.getLogger(__name__)

#: Environment variables a launcher sets to the number of processes (torchrun/accelerate,
#: then MPI implementations, as accelerate reads them).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
RANK_SEED_STRIDE = 1000
UPDATE_SEED_STRIDE = 1_000_003


def launched_processes() -> int:
    """How many processes the launcher started; 1 when not started by one."""
    for name in WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return 1


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if world_size() > 1 else 0


def is_main() -> bool:
    return rank() == 0


def process_seed(seed: int, rank: int, update: int = 0) -> int:
    """The seed of process ``rank``'s own random streams (episode seeds, sampling).

    ``seed + 1000 * rank`` at the start of a run, so rank 0 uses the run's seed and a
    one-process run is unchanged. A resumed run restores rank 0's saved streams (the
    checkpoint holds rank 0's); the other ranks re-derive theirs with the update the run
    resumes from, ``+ 1_000_003 * update``, so they do not replay their first episodes.
    """
    return (seed + RANK_SEED_STRIDE * rank + UPDATE_SEED_STRIDE * update) % 2**32


def start(device: str, sharding: bool = False) -> str:
    """Join the process group of a launched multi-process run through accelerate's
    ``PartialState`` (gloo on CPU, NCCL on GPUs); return the device this process trains
    on. Does nothing for a single process. ``sharding``: the run's backend shards the
    model itself (the TRL backend, under DeepSpeed or FSDP)."""
    if launched_processes() <= 1:
        if os.environ.get("ACCELERATE_USE_CPU", "").lower() == "true" and os.environ.get(
            "MASTER_ADDR"
        ):
            # What accelerate's plain launcher leaves for --cpu --num_processes N > 1.
            raise ConfigError(
                "`accelerate launch --cpu` started one process: its CPU launcher needs MPI "
                "for several. Use `accelerate launch --multi_gpu --num_processes N ...` "
                "(on a machine without GPUs every process runs on the CPU) or "
                "`llamagym run ... --num-processes N`"
            )
        return device
    for variable, what in SHARDING.items():
        if not sharding and os.environ.get(variable, "").lower() == "true":
            raise ConfigError(
                f"the native backend trains data-parallel (each process holds the whole "
                f"model); accelerate's {what} runs with --backend trl, or launch with "
                "`accelerate launch --multi_gpu --num_processes N` / use --num-processes N"
            )
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(
            f"model.device = {device!r}: with several processes use auto or cuda (each "
            "process then uses its own GPU) or cpu"
        )
    try:
        from accelerate import PartialState
    except ImportError:
        message = "training with several processes needs the package 'accelerate'"
        raise LlamaGymError(f"{message}: pip install accelerate") from None
    state = PartialState(cpu=device == "cpu" or not torch.cuda.is_available())
    if sharding and state.is_main_process:
        warn_if_not_sharded(str(state.distributed_type))
    if world_size() != launched_processes():
        raise LlamaGymError(
            f"the launcher started {launched_processes()} processes but accelerate joined "
            f"{world_size()}; launch with `accelerate launch --multi_gpu --num_processes N` "
            "or `llamagym run --num-processes N`"
        )
    return "cpu" if device == "cpu" else str(state.device)


#: What each sharding switch of ``accelerate launch`` is called in its warning.
SHARDING = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed"}


def warn_if_not_sharded(distributed_type: str) -> None:
    """accelerate (1.15, ``AcceleratorState``) turns FSDP and DeepSpeed on only on GPUs
    and other accelerators: on CPUs, ``distributed_type`` stays ``MULTI_CPU`` and the
    launch trains plain data-parallel (DDP), every process holding the whole model,
    without a word. Say so, once, on the main process."""
    asked = [what for variable, what in SHARDING.items()
             if os.environ.get(variable, "").lower() == "true"]
    if asked and distributed_type.endswith("MULTI_CPU"):
        logger.warning(
            "accelerate was launched with %s, which it runs only on GPUs: on the CPU it "
            "trains data-parallel (DDP), each process holding the whole model",
            asked[0],
        )


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def finish() -> None:
    """Leave the process group (after the run's last collective)."""
    if world_size() > 1:
        dist.destroy_process_group()


# -- collectives ----------------------------------------------------------------------
def _device() -> torch.device:
    """Where collective tensors live: the GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(value: Any) -> list[Any]:
    """``value`` of every process (any picklable object), in rank order."""
    if world_size() == 1:
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def agreed_min(count: int) -> int:
    """The smallest ``count`` over the processes."""
    if world_size() == 1:
        return count
    tensor = torch.tensor([count], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def agreed_max(value: float) -> float:
    """The largest ``value`` over the processes (NaN if any process has NaN)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    nan = torch.isnan(tensor).to(torch.float64)
    finite = tensor.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    both = torch.cat([finite, nan])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float("nan") if both[1] > 0 else float(both[0])


def weighted_mean(value: float, weight: float) -> tuple[float, float]:
    """The ``weight``-weighted mean of ``value`` over the processes, and the total
    weight (NaN when the total weight is 0)."""
    if world_size() == 1:
        return value, weight
    tensor = torch.tensor([value * weight, weight], dtype=torch.float64, device=_device())
    dist.all_reduce(tensor)
    total = float(tensor[1])
    return (float(tensor[0]) / total if total else float("nan")), total


def broadcast_parameters(parameters: Sequence[torch.Tensor]) -> None:
    """Copy rank 0's values of ``parameters`` into every other process."""
    if world_size() == 1 or not parameters:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in parameters])
        flat = flat.to(_device())
        dist.broadcast(flat, src=0)
        sizes = [p.numel() for p in parameters]
        for parameter, chunk in zip(parameters, flat.split(sizes), strict=True):
            parameter.copy_(chunk.view_as(parameter))


def average_gradients(parameters: Sequence[torch.Tensor], finite: bool) -> bool:
    """Replace each gradient with its mean over the processes; return False (nothing
    averaged) if the loss was not finite on some process, so every process skips the
    step together. ``finite`` is this process's answer; a process with a non-finite
    loss took no backward pass and contributes zeros."""
    if world_size() == 1:
        return finite
    with torch.no_grad():
        device = _device()
        pieces = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float().to(device)
            for p in parameters
        ]
        pieces.append(torch.tensor([0.0 if finite else 1.0], device=device))
        flat = torch.cat(pieces)
        dist.all_reduce(flat)
        if flat[-1] > 0:
            return False
        flat /= world_size()
        chunks = flat[:-1].split([p.numel() for p in parameters])
        for parameter, chunk in zip(parameters, chunks, strict=True):
            if parameter.grad is not None:
                parameter.grad.copy_(chunk.view_as(parameter.grad))
    return True


# -- the collectives an algorithm agrees through -------------------------------------
class Collectives(Protocol):
    """What the processes of a run agree on. An algorithm receives one of these as
    ``group`` and takes every decision that must be the same on all processes through
    it, so where processes synchronise is visible at the call."""

    @property
    def world_size(self) -> int: ...

    @property
    def rank(self) -> int: ...

    def all_min(self, value: int) -> int:
        """The smallest ``value`` over the processes."""
        ...

    def all_max(self, value: float) -> float:
        """The largest ``value`` over the processes (NaN if any process has NaN)."""
        ...

    def all_mean(self, value: float, weight: float) -> tuple[float, float]:
        """The ``weight``-weighted mean of ``value`` over the processes, and the total
        weight (NaN when the total weight is 0)."""
        ...

    def all_gather(self, value: Any) -> list[Any]:
        """``value`` of every process (any picklable object), in rank order."""
        ...

    def average_gradients(self, parameters: Sequence[torch.Tensor], finite: bool) -> bool:
        """Replace each gradient of ``parameters`` with its mean over the processes;
        False (nothing averaged) when the loss was not finite on some process."""
        ...


class SingleProcess:
    """The collectives of a run with one process: every answer is this process's own."""

    world_size = 1
    rank = 0

    def all_min(self, value: int) -> int:
        return value

    def all_max(self, value: float) -> float:
        return value

    def all_mean(self, value: float, weight: float) -> tuple[float, float]:
        return value, weight

    def all_gather(self, value: Any) -> list[Any]:
        return [value]

    def average_gradients(self, parameters: Sequence[torch.Tensor], finite: bool) -> bool:
        return finite


class ProcessGroup:
    """The collectives of the default process group this process joined (:func:`start`)."""

    @property
    def world_size(self) -> int:
        return world_size()

    @property
    def rank(self) -> int:
        return rank()

    def all_min(self, value: int) -> int:
        return agreed_min(value)

    def all_max(self, value: float) -> float:
        return agreed_max(value)

    def all_mean(self, value: float, weight: float) -> tuple[float, float]:
        return weighted_mean(value, weight)

    def all_gather(self, value: Any) -> list[Any]:
        return all_gather(value)

    def average_gradients(self, parameters: Sequence[torch.Tensor], finite: bool) -> bool:
        return average_gradients(parameters, finite)


def process_group() -> Collectives:
    """The collectives of this process's run: a :class:`ProcessGroup` once it has joined
    a group of several processes, else :class:`SingleProcess`."""
    return ProcessGroup() if world_size() > 1 else SingleProcess()


def parameters_digest(parameters: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the values of ``parameters``, in order (equal digests: equal weights)."""
    digest = hashlib.sha256()
    for parameter in parameters:
        digest.update(parameter.detach().cpu().contiguous().float().numpy().tobytes())
    return digest.hexdigest()
