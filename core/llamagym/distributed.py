"""Data-parallel training over several processes.

``accelerate launch --multi_gpu --num_processes N -m llamagym.cli run AGENT ...`` (or
``llamagym run AGENT --num-processes N``, which does the same) starts N processes,
each of which runs the whole ``llamagym run``:

* every process (rank) holds the whole model and starts from rank 0's weights, steps its
  own environments with its own seeds, and computes the loss of its own episodes;
* :meth:`llamagym.algorithms.algorithm.Algorithm.step` averages the gradients over the processes
  before the optimizer step, so the weights stay identical everywhere;
* what decides control flow is agreed: the number of gradient steps per epoch (the
  smallest over the processes), the target-KL stop (the largest KL), a non-finite loss
  (skipped everywhere), the adaptive KL coefficient, the episode and time budgets and a
  stop signal. An algorithm agrees through the ``group`` it is given
  (:func:`process_group`), in its methods named ``sync_*``;
* rank 0 alone writes the run directory, shows progress and evaluates.

A run whose processes cannot all go on ends, within a bound, rather than hanging:

* a launcher started by ``llamagym run --num-processes N`` takes its processes with it
  when it dies (:func:`end_with_launcher`);
* every collective waits at most ``LLAMAGYM_PROCESS_TIMEOUT`` seconds (default 300) for
  the other processes; one that died or stopped answering ends the collective with a
  :class:`ProcessLostError` naming it. In the process group's store each process counts
  the collectives it has entered, and a thread of each a heartbeat a second: the
  processes missing are those that did not reach the collective, else those whose
  heartbeat stands still.

With one process every function here is a no-op: nothing from accelerate is imported,
no collective runs, and a run computes exactly what it computes without this module.

Top level: a floor of its own below the algorithms, the training loop and the TRL
backend, which all use it; none of them is its home.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from llamagym.config import MAX_WAIT_SECONDS
from llamagym.errors import ConfigError, LlamaGymError

logger = logging.getLogger(__name__)

#: Environment variables a launcher sets to the number of processes (torchrun/accelerate,
#: then MPI implementations, as accelerate reads them).
WORLD_SIZE_VARIABLES = ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
RANK_SEED_STRIDE = 1000
UPDATE_SEED_STRIDE = 1_000_003
#: Seconds a collective waits for the other processes before the run ends.
TIMEOUT_VARIABLE = "LLAMAGYM_PROCESS_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 300.0
#: Set by ``llamagym run --num-processes N`` to its own pid in the processes it starts.
LAUNCHER_VARIABLE = "LLAMAGYM_LAUNCHER_PID"
#: Exit code of a process that ended because another one died or stopped answering.
PROCESS_LOST_EXIT_CODE = 3
#: Store keys under which each rank counts the collectives it has entered, and its
#: heartbeats (one a second).
ARRIVALS_KEY = "llamagym/collectives/"
HEARTBEAT_KEY = "llamagym/heartbeat/"
HEARTBEAT_SECONDS = 1.0
#: How long leaving the run waits for a heartbeat caught in a store call.
HEARTBEAT_JOIN_SECONDS = 5.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

T = TypeVar("T")


class ProcessLostError(LlamaGymError):
    """Another process of the run died or stopped answering during a collective."""


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


def process_timeout() -> float:
    """Seconds a collective may wait for the other processes (``LLAMAGYM_PROCESS_TIMEOUT``,
    default 300)."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_WAIT_SECONDS:
        raise ConfigError(
            f"{TIMEOUT_VARIABLE}={text[:40]!r} is not a number of seconds from 0 to "
            f"{MAX_WAIT_SECONDS:,} (a week); set it to how long one process may wait "
            f"for the others (default {DEFAULT_TIMEOUT_SECONDS:g})"
        )
    return seconds


def end_with_launcher() -> None:
    """Die with the ``llamagym run --num-processes N`` process that started this one.

    torchrun starts each process in a session of its own, so nothing reaches the
    processes when their launcher is killed outright (SIGKILL, the OOM killer): they
    would train on, the run directory still locked by rank 0. On Linux the kernel is
    asked to send SIGKILL when the launcher dies (``PR_SET_PDEATHSIG``): it arrives even
    while this process is blocked inside a collective or in C code that holds the GIL,
    which a watching thread could not act on. (The signal follows the launcher's thread
    that started this process: accelerate runs torchrun in the launcher's main thread,
    which lives as long as the launcher.) Elsewhere a daemon thread polls the parent
    pid once a second. The run lock is an operating-system lock, so it goes with rank
    0; the next run takes over its directory, saying whose it was."""
    text = os.environ.get(LAUNCHER_VARIABLE, "")
    if not text.isdigit():
        return  # started by another launcher: its own rules apply
    launcher = int(text)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    else:
        threading.Thread(target=_poll_launcher, args=(launcher,), daemon=True).start()
    if os.getppid() != launcher:  # it died before the request above was made
        os._exit(PROCESS_LOST_EXIT_CODE)


def _poll_launcher(launcher: int) -> None:
    while os.getppid() == launcher:
        time.sleep(1.0)
    os._exit(PROCESS_LOST_EXIT_CODE)


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
    end_with_launcher()
    timeout = process_timeout()
    try:
        from accelerate import PartialState
    except ImportError:
        message = "training with several processes needs the package 'accelerate'"
        raise LlamaGymError(f"{message}: pip install accelerate") from None
    try:
        state = PartialState(
            cpu=device == "cpu" or not torch.cuda.is_available(),
            timeout=timedelta(seconds=timeout),
        )
    except dist.DistError as error:  # the rendezvous: not every process joined in time
        raise ProcessLostError(
            f"not all {launched_processes()} processes joined the run within {timeout:g} s "
            f"({_reason(error)}; {TIMEOUT_VARIABLE} sets the limit)"
        ) from None
    start_heartbeat(dist.distributed_c10d._get_default_store(), rank())
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
        _agreed(dist.barrier)


def finish() -> None:
    """Leave the process group (after the run's last collective), the heartbeat first."""
    stop_heartbeat()
    if world_size() > 1:
        dist.destroy_process_group()


# -- collectives ----------------------------------------------------------------------
_entered = 0  # the collectives this process has entered


def _agreed(collective: Callable[[], T]) -> T:
    """Run one collective. A process that died, or did not answer within the process
    group's timeout, ends it with a :class:`ProcessLostError` naming that process."""
    global _entered
    _entered += 1
    store = dist.distributed_c10d._get_default_store()
    try:
        # The store may live in the process that died (rank 0's, outside torchrun).
        store.add(f"{ARRIVALS_KEY}{rank()}", 1)
        return collective()
    except RuntimeError as error:  # gloo and NCCL report a lost peer as RuntimeError
        try:
            lost = _lost(store, error)
        except RuntimeError:  # the store is gone with it: no one to ask which process
            lost = (f"process {rank()} of {world_size()} lost its connection to the others "
                    f"({_reason(error)})")
        raise ProcessLostError(lost) from None


_heartbeat: tuple[threading.Thread, threading.Event] | None = None


def start_heartbeat(store: Any, rank: int) -> None:
    """Count up this process's heartbeat in ``store`` every second, from a thread that
    keeps going while the main thread waits in a collective (and stops with the process
    when it is stopped or frozen), until :func:`stop_heartbeat` or the store is gone."""
    global _heartbeat
    stop = threading.Event()
    thread = threading.Thread(
        target=_beat, args=(store, rank, stop), name="llamagym-heartbeat", daemon=True
    )
    thread.start()
    _heartbeat = thread, stop


def stop_heartbeat() -> None:
    """End the heartbeat thread before the interpreter does. A daemon thread that comes
    back from a store call while Python shuts down is ended there by the interpreter,
    inside C++ that may not be ended so: the process aborts (SIGABRT, "terminate called
    without an active exception") after a run that went well. A store call that hangs
    (its server gone) is waited for at most a few heartbeats."""
    global _heartbeat
    if _heartbeat is None:
        return
    thread, stop = _heartbeat
    _heartbeat = None
    stop.set()
    thread.join(timeout=HEARTBEAT_JOIN_SECONDS)


def _beat(store: Any, rank: int, stop: threading.Event) -> None:
    with contextlib.suppress(RuntimeError):
        while not stop.is_set():
            store.add(f"{HEARTBEAT_KEY}{rank}", 1)
            stop.wait(HEARTBEAT_SECONDS)


def _lost(store: Any, error: Exception) -> str:
    """Which processes the failed collective was missing, in words: those that did not
    reach it, else those whose heartbeat stands still (stopped inside it)."""
    me, world = rank(), world_size()
    others = [other for other in range(world) if other != me]
    missing = [other for other in others if store.add(f"{ARRIVALS_KEY}{other}", 0) < _entered]
    timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
    if not missing and timed_out:
        beats = {other: store.add(f"{HEARTBEAT_KEY}{other}", 0) for other in others}
        time.sleep(3 * HEARTBEAT_SECONDS)
        missing = [other for other in others if store.add(f"{HEARTBEAT_KEY}{other}", 0)
                   == beats[other]]
    if not missing:
        return f"process {me} of {world} lost its connection to the others ({_reason(error)})"
    who = (f"process {missing[0]}" if len(missing) == 1
           else f"processes {', '.join(map(str, missing))}")
    if timed_out:
        return (
            f"{who} of {world} stopped answering: process {me} waited {process_timeout():g} "
            f"s for {'it' if len(missing) == 1 else 'them'} ({TIMEOUT_VARIABLE} sets the limit)"
        )
    return f"{who} of {world} ended: process {me} lost its connection ({_reason(error)})"


def _reason(error: Exception) -> str:
    """The first sentence of a gloo/NCCL/store error, without its source location."""
    lines = str(error).strip().splitlines() or [""]
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]).split(". ")[0]
    return (first or type(error).__name__)[:200]


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
    _agreed(lambda: dist.all_gather_object(gathered, value))
    return gathered


def agreed_min(count: int) -> int:
    """The smallest ``count`` over the processes."""
    if world_size() == 1:
        return count
    tensor = torch.tensor([count], dtype=torch.int64, device=_device())
    _agreed(lambda: dist.all_reduce(tensor, op=dist.ReduceOp.MIN))
    return int(tensor.item())


def agreed_max(value: float) -> float:
    """The largest ``value`` over the processes (NaN if any process has NaN)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=_device())
    nan = torch.isnan(tensor).to(torch.float64)
    finite = tensor.nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    both = torch.cat([finite, nan])
    _agreed(lambda: dist.all_reduce(both, op=dist.ReduceOp.MAX))
    return float("nan") if both[1] > 0 else float(both[0])


def weighted_mean(value: float, weight: float) -> tuple[float, float]:
    """The ``weight``-weighted mean of ``value`` over the processes, and the total
    weight (NaN when the total weight is 0)."""
    if world_size() == 1:
        return value, weight
    tensor = torch.tensor([value * weight, weight], dtype=torch.float64, device=_device())
    _agreed(lambda: dist.all_reduce(tensor))
    total = float(tensor[1])
    return (float(tensor[0]) / total if total else float("nan")), total


def broadcast_parameters(parameters: Sequence[torch.Tensor]) -> None:
    """Copy rank 0's values of ``parameters`` into every other process."""
    if world_size() == 1 or not parameters:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in parameters])
        flat = flat.to(_device())
        _agreed(lambda: dist.broadcast(flat, src=0))
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
        _agreed(lambda: dist.all_reduce(flat))
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
