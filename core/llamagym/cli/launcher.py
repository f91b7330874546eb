"""``llamagym run --num-processes N``: the launcher of a multi-process run.

accelerate's launcher (torchrun underneath) starts the processes; this module adds what
makes a failed run end at once, in one line:

* the processes die with the launcher (``LLAMAGYM_LAUNCHER_PID``, see
  :func:`llamagym.distributed.end_with_launcher`);
* a :class:`FailureWatch` sees a process fail the moment it exits and kills the others,
  which could not go on without it. torchrun would ask them to stop with SIGTERM, which
  a training process answers by finishing its update (saying so), and wait 30 s, or for
  ever for a stopped process's SIGTERM, before it kills them;
* the line printed names the process that failed first and why: the signal or exit code
  it died of, or, when a process stopped answering, the message of the process that
  gave up waiting for it (it exits with ``PROCESS_LOST_EXIT_CODE``; its message reaches
  the launcher through torchrun's error file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import typer

from llamagym.display import printable
from llamagym.errors import LlamaGymError

#: Exit codes of a run stopped by a signal, as a shell reports them (128 + signal).
SIGNAL_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}
#: Exit codes of a process that ended as every process of the run does: done, or
#: stopped by a signal (which the processes agree on, and end on together).
TOGETHER_EXIT_CODES = (0, *SIGNAL_EXIT_CODES.values())
#: Exit codes after which the process has said itself what happened (2: a bad input).
SAID_EXIT_CODES = (2, *SIGNAL_EXIT_CODES.values())


def launch_processes(count: int, run_arguments: list[str]) -> int:
    """``llamagym run RUN_ARGUMENTS`` in ``count`` processes through accelerate's
    launcher (torchrun underneath; on a machine without GPUs every process runs on the
    CPU and they talk over gloo); returns the exit code of the run.

    The launcher runs in this process rather than as ``python -m accelerate...``: run as
    a program it ends any failed run with exit code 1 and a traceback, while here the
    failed process's own exit code (2 for a bad input, 130/143 after a signal) is
    passed on and one line says what happened."""
    from llamagym import distributed

    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError:
        raise LlamaGymError(
            f"--num-processes {count} needs the package 'accelerate': pip install accelerate"
        ) from None
    import torch.distributed.run  # noqa: F401  (torchrun's loggers, quieted below)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    distributed.process_timeout()  # a bad value is one line here, not one per process
    # --multi_gpu is accelerate's name for its torchrun launcher, for GPUs and CPUs alike.
    launcher = launch_command_parser().parse_args(
        [
            *("--multi_gpu", "--num_processes", str(count), "--num_machines", "1"),
            *("--mixed_precision", "no", "--dynamo_backend", "no"),
            *("--main_process_port", "0"),  # a free port: runs side by side never collide
            *("-m", "llamagym.cli", "run", *run_arguments),
        ]
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
    os.environ[distributed.LAUNCHER_VARIABLE] = str(os.getpid())
    # torchrun logs a failed or signalled process; the line below says what happened.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    watch = FailureWatch(count)
    try:
        with watch.running():
            launch_command(launcher)
    except SignalException as error:
        return 128 + int(error.sigval)
    except ChildFailedError as error:
        return _report(watch, error.failures, count)
    return 0


def _report(watch: FailureWatch, failures: dict[int, Any], count: int) -> int:
    """Print the one line about the process that failed first; return its exit code."""
    from llamagym.distributed import PROCESS_LOST_EXIT_CODE

    by_pid = {failure.pid: (rank, failure) for rank, failure in failures.items()}
    first = watch.first_failure()
    if first is not None and first[0] in by_pid:
        rank, failure = by_pid[first[0]]
        exit_code = first[1]
    else:  # it failed before the watch could see it: torchrun's account
        rank, failure = min(failures.items())
        exit_code = failure.exitcode
    if exit_code == PROCESS_LOST_EXIT_CODE:
        # A process that gave up on a lost one is named only when torchrun knows of no
        # process that failed by itself (collected before the watch saw it end).
        own = sorted(
            (r, f) for r, f in failures.items()
            if f.exitcode != PROCESS_LOST_EXIT_CODE and f.pid not in watch.killed
        )
        if own:
            rank, failure = own[0]
            exit_code = failure.exitcode
    code = exit_code if exit_code >= 0 else 128 - exit_code
    if exit_code in SAID_EXIT_CODES:
        return code
    if exit_code == PROCESS_LOST_EXIT_CODE:
        what = printable(str(failure.message))
    elif exit_code < 0:
        what = f"process {rank} of {count} was killed by {signal.Signals(-exit_code).name}"
    else:
        what = f"process {rank} of {count} ended with exit code {exit_code}"
    typer.secho(
        f"error: {what}; every process of the run has stopped (--resume continues from "
        "its last checkpoint)",
        fg="red",
        err=True,
    )
    return code


class FailureWatch:
    """Watches the launched processes (this process's children that torchrun gave a
    ``LOCAL_RANK``): the first to fail (a signal, or an exit code not in
    :data:`TOGETHER_EXIT_CODES`) is remembered and every other one is killed at once
    (SIGKILL: it cannot go on alone, and a stopped process answers nothing else). An exit
    is seen with ``waitid(WNOWAIT)``, which leaves the process for torchrun to collect
    and report as usual."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._workers: set[int] = set()
        self._failures: list[tuple[int, int]] = []  # (pid, exit code or -signal)
        self._ended: set[int] = set()  # seen to end, or killed here
        self.killed: set[int] = set()  # killed here
        self._done = threading.Event()

    def first_failure(self) -> tuple[int, int] | None:
        """The first process that failed by itself (not killed here); one that ended
        because another was lost comes after any that was not."""
        from llamagym.distributed import PROCESS_LOST_EXIT_CODE

        for pid, code in self._failures:
            if code != PROCESS_LOST_EXIT_CODE:
                return pid, code
        return self._failures[0] if self._failures else None

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        thread = threading.Thread(target=self._watch, name="llamagym-failure-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._done.set()

    def _watch(self) -> None:
        import psutil  # accelerate's dependency

        me = psutil.Process()
        while len(self._workers) < self.count and not self._done.wait(0.05):
            for child in me.children():
                with contextlib.suppress(psutil.Error):
                    if "LOCAL_RANK" in child.environ():
                        self._workers.add(child.pid)
        while self._workers - self._ended and not self._done.is_set():
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:  # all collected
                return
            if info is None:
                continue
            pid = info.si_pid
            if pid in self._workers and pid not in self._ended:
                self._exited(pid, _exit_code(info))
            self._until_collected(pid)

    def _exited(self, pid: int, code: int) -> None:
        self._ended.add(pid)
        if code in TOGETHER_EXIT_CODES:
            return
        self._failures.append((pid, code))
        for other in sorted(self._workers - self._ended):
            self._ended.add(other)
            with contextlib.suppress(ChildProcessError):  # collected: no longer ours
                info = os.waitid(os.P_PID, other, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if info is None:
                    os.kill(other, signal.SIGKILL)
                    self.killed.add(other)
                elif (own := _exit_code(info)) not in TOGETHER_EXIT_CODES:
                    # It had ended by itself, unseen: the kernel reported this one first.
                    self._failures.append((other, own))

    def _until_collected(self, pid: int) -> None:
        """Wait for torchrun to collect ``pid`` (it polls every 0.1 s), so the next
        ``waitid`` reports another process."""
        while not self._done.is_set():
            try:
                if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                    return  # not ended (a new process with this pid)
            except ChildProcessError:
                return
            self._done.wait(0.02)


def _exit_code(info: Any) -> int:
    """A ``waitid`` result as an exit code, or minus the signal that killed the process."""
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
