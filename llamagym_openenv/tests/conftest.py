"""Real servers for the tests, on 127.0.0.1 only, always stopped: ``llamagym serve`` as
a subprocess (the installed command, its entry point and its first line), and a
server in a thread for the tests that need one quickly."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

START_TIMEOUT = 60.0  # seconds for `llamagym serve` to print its first line


@dataclass
class Served:
    process: subprocess.Popen
    url: str
    first_line: str


def _llamagym() -> list[str]:
    script = Path(sys.executable).with_name("llamagym")
    return [str(script)] if script.exists() else [sys.executable, "-m", "llamagym.cli"]


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


@contextlib.contextmanager
def serving(agent: str, *options: str) -> Iterator[Served]:
    """``llamagym serve AGENT --port 0 OPTIONS`` until the block ends (then SIGTERM, and
    SIGKILL if it has not ended within 10 s)."""
    command = [*_llamagym(), "serve", agent, "--port", "0", *options]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        first = _first_line(lines, process)
        url = first.split("OpenEnv server on ", 1)[1].split(" ", 1)[0]
        yield Served(process, url, first)
    finally:
        stop(process)


def _first_line(lines: queue.Queue, process: subprocess.Popen) -> str:
    deadline = time.monotonic() + START_TIMEOUT
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            continue
        if line is None:
            break
        seen.append(line)
        if "OpenEnv server on " in line:
            return line.strip()
    stop(process)
    pytest.fail(f"llamagym serve printed no address: {''.join(seen)[-2000:]}")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextlib.contextmanager
def serving_in_thread(agent_name: str, max_sessions: int = 8, keepalive: float = 20.0,
                      overrides: dict | None = None) -> Iterator[str]:
    """The same server in a thread of this process (uvicorn on 127.0.0.1, port 0)."""
    from llamagym_openenv.server import bind, build_app, make_server

    from llamagym.cli.run_commands import resolve_run_config

    agent_class, resolved = resolve_run_config(agent_name, None, [], {})
    agent = agent_class(config=resolved)
    sock = bind("127.0.0.1", 0)
    server = make_server(build_app(agent, max_sessions), keepalive)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the server in a thread did not start"
    try:
        yield f"ws://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        assert not thread.is_alive(), "the server in a thread did not stop"


@pytest.fixture(scope="module")
def blackjack_server() -> Iterator[Served]:
    with serving("blackjack", "--max-sessions", "16") as served:
        yield served


@pytest.fixture
def serve() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """``serve(agent, *options)``: ``llamagym serve`` as a subprocess, for a block."""
    return serving


@pytest.fixture
def serve_in_thread() -> Callable[..., contextlib.AbstractContextManager[str]]:
    """``serve_in_thread(agent, max_sessions, keepalive)``: the server in a thread."""
    return serving_in_thread


@pytest.fixture
def llamagym() -> list[str]:
    """The installed ``llamagym`` command."""
    return _llamagym()


@pytest.fixture(scope="session")
def stop_process() -> Callable[[subprocess.Popen], None]:
    """``stop_process(process)``: SIGTERM, and SIGKILL if it has not ended within 10 s."""
    return stop
