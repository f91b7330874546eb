"""A multi-process run whose processes cannot all go on ends at once, in one line:
`llamagym run blackjack --num-processes 2` on the tiny model, with its launcher killed,
one process stopped (SIGSTOP) or one process killed, while it trains."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.records.run_lock import RunDirectoryLock

#: Seconds a collective waits for the other process in these runs.
TIMEOUT = 5
ENDLESS = [
    *("--quiet", "--num-envs", "4", "--episodes", "100000", "--eval-episodes", "0"),
    *("--checkpoint-every", "1", "--set", "algorithm.episodes_per_update=8"),
    *("--set", "algorithm.epochs=1"),
]


class Run:
    """A two-process run in the background, its output in files."""

    def __init__(self, run_dir: Path):
        from llamagym.models.tiny import build_tiny_model

        build_tiny_model()  # once, before two processes both look for it
        self.run_dir = run_dir
        self.stderr_path = run_dir.parent / "stderr.txt"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LLAMAGYM_PROCESS_TIMEOUT": str(TIMEOUT)}
        with self.stderr_path.open("w") as stderr:
            self.launcher = subprocess.Popen(
                [sys.executable, "-m", "llamagym.cli", "run", "blackjack",
                 "--num-processes", "2", *ENDLESS, "-o", str(run_dir)],
                stdout=subprocess.DEVNULL, stderr=stderr, env=env,
            )
        self.ranks = self._trained_a_little()

    def _trained_a_little(self) -> dict[int, int]:
        """Each process's pid by rank, once the run has checkpointed its first update."""
        deadline = time.monotonic() + 180
        while not list(self.run_dir.glob("checkpoints/update-*/checkpoint.json")):
            assert self.launcher.poll() is None, self.stderr()
            assert time.monotonic() < deadline, "the run wrote no update in 180 s"
            time.sleep(0.2)
        ranks = {}
        for child in psutil.Process(self.launcher.pid).children():
            ranks[int(child.environ()["RANK"])] = child.pid
        assert sorted(ranks) == [0, 1]
        return ranks

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def seconds_until_all_gone(self, bound: float) -> float:
        """How long until the launcher and both processes have exited (fails past
        ``bound``)."""
        start = time.monotonic()
        while time.monotonic() - start < bound:
            if self.launcher.poll() is not None and not self.alive():
                return time.monotonic() - start
            time.sleep(0.1)
        pytest.fail(f"still running after {bound} s: launcher {self.launcher.poll()}, "
                    f"processes {self.alive()}")

    def alive(self) -> list[int]:
        running = []
        for pid in self.ranks.values():
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    running.append(pid)
            except psutil.NoSuchProcess:
                pass
        return running

    def end(self) -> None:
        for pid in [*self.alive(), self.launcher.pid]:
            try:
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.launcher.wait(timeout=30)


@pytest.fixture
def run(tmp_path) -> Iterator[Run]:
    started = Run(tmp_path / "run")
    try:
        yield started
    finally:
        started.end()


def assert_lock_free(run_dir: Path) -> None:
    lock = RunDirectoryLock(run_dir)
    lock.acquire()  # raises RunDirectoryBusyError while a process holds it
    lock.release()


@pytest.mark.slow
def test_a_killed_launcher_takes_its_processes_with_it(run) -> None:
    os.kill(run.launcher.pid, signal.SIGKILL)
    assert run.seconds_until_all_gone(bound=10) < 5
    # The lock went with rank 0; the run resumes, naming the process that held it, with
    # a budget of one more update than its newest checkpoint holds (however far it got).
    done = checkpoints.read_meta(checkpoints.find_checkpoint(run.run_dir))["counters"]
    budget = str(done["episodes"] + 16)
    resumed = subprocess.run(
        [sys.executable, "-m", "llamagym.cli", "run", "blackjack", "--resume", str(run.run_dir),
         "--quiet", "--episodes", budget, "--eval-episodes", "0", "--set", "output.report=false"],
        capture_output=True, text=True, timeout=180, check=False,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"last written by process {run.ranks[0]}, which is no longer running" in (
        resumed.stderr
    )


@pytest.mark.slow
def test_a_stopped_process_ends_the_run_naming_it(run) -> None:
    os.kill(run.ranks[1], signal.SIGSTOP)
    # The other process waits TIMEOUT s at its next collective, then 3 s of heartbeats.
    run.seconds_until_all_gone(bound=60)
    assert run.launcher.returncode == 3
    assert run.stderr().strip().splitlines() == [
        f"error: process 1 of 2 stopped answering: process 0 waited {TIMEOUT} s for it "
        "(LLAMAGYM_PROCESS_TIMEOUT sets the limit); every process of the run has stopped "
        "(--resume continues from its last checkpoint)"
    ]
    assert_lock_free(run.run_dir)


@pytest.mark.slow
def test_a_killed_process_ends_the_run_in_one_line(run) -> None:
    os.kill(run.ranks[1], signal.SIGKILL)
    assert run.seconds_until_all_gone(bound=10) < 5
    assert run.launcher.returncode == 128 + signal.SIGKILL
    assert run.stderr().strip().splitlines() == [
        "error: process 1 of 2 was killed by SIGKILL; every process of the run has stopped "
        "(--resume continues from its last checkpoint)"
    ]
    assert_lock_free(run.run_dir)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "inf", "1e15", "604801"])
def test_a_bad_process_timeout_is_one_line(cli, monkeypatch, tmp_path, value) -> None:
    # 1e15 seconds is past the longest span a timedelta holds: it once got through.
    monkeypatch.setenv("LLAMAGYM_PROCESS_TIMEOUT", value)
    code, _, err = cli("run", "blackjack", "--num-processes", "2", "-o", tmp_path / "r")
    assert code == 2
    assert err.strip() == (
        f"error: LLAMAGYM_PROCESS_TIMEOUT={value!r} is not a number of seconds from 0 to "
        "604,800 (a week); set it to how long one process may wait for the others "
        "(default 300)"
    )


def _ended_unreaped(*codes: str) -> list[subprocess.Popen]:
    """Child processes running each code, left ended but not collected (zombies)."""
    children = [subprocess.Popen([sys.executable, "-c", code]) for code in codes]
    for child in children:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    return children


def test_a_killed_process_is_named_when_the_one_that_lost_it_is_seen_first(capsys) -> None:
    from types import SimpleNamespace

    from llamagym.cli.launcher import FailureWatch, _report

    # Both ended before the watch looked, and the kernel reported the one that gave up
    # on its peer (exit code 3) first: the kill, not the giving up, is the failure.
    lost, killed = _ended_unreaped(
        "raise SystemExit(3)", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    )
    watch = FailureWatch(2)
    watch._workers = {lost.pid, killed.pid}
    watch._exited(lost.pid, 3)
    assert watch.first_failure() == (killed.pid, -signal.SIGKILL)
    for child in (lost, killed):
        child.wait()
    # torchrun collected the killed one before the watch saw it: its account names it.
    unseen = FailureWatch(2)
    unseen._failures = [(lost.pid, 3)]
    failures = {
        0: SimpleNamespace(pid=lost.pid, exitcode=3, message="process 1 of 2 is gone"),
        1: SimpleNamespace(pid=killed.pid, exitcode=-signal.SIGKILL, message=""),
    }
    assert _report(unseen, failures, 2) == 128 + signal.SIGKILL
    assert capsys.readouterr().err.strip() == (
        "error: process 1 of 2 was killed by SIGKILL; every process of the run has stopped "
        "(--resume continues from its last checkpoint)"
    )
