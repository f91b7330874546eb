"""What a server does wrong ends a call in one line within its timeout, never a hang:
killed mid-episode, garbage, a frame over the bound, silence, values of the wrong
type; and a client that vanishes without closing gives its slot back."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from llamagym_openenv.client import Bounds, OpenEnvEnv, OpenEnvError

QUICK = Bounds(connect_timeout=2.0, timeout=1.5, max_message_bytes=64 * 1024)


@contextlib.contextmanager
def fake_server(answer: Callable[[dict], object], port: int = 0) -> Iterator[str]:
    """A WebSocket server on 127.0.0.1 (``port``, 0: any free one) that answers each
    message with ``answer(message)`` (a str or bytes frame sent as it is; None: no answer
    at all)."""
    from websockets.asyncio.server import serve

    ready = threading.Event()
    state: dict = {}

    async def handler(websocket) -> None:
        async for raw in websocket:
            reply = answer(json.loads(raw))
            if reply is not None:
                await websocket.send(reply)

    async def main() -> None:
        state["stop"] = asyncio.get_running_loop().create_future()
        async with serve(handler, "127.0.0.1", port, max_size=None) as server:
            state["port"] = next(iter(server.sockets)).getsockname()[1]
            ready.set()
            await state["stop"]

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(main(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the fake server did not start"
    try:
        yield f"ws://127.0.0.1:{state['port']}"
    finally:
        loop.call_soon_threadsafe(state["stop"].set_result, None)
        thread.join(timeout=10)


def _observation(**overrides) -> str:
    data = {"observation": {"text": "hello"}, "reward": None, "done": False,
            "metadata": {"legal_actions": ["a", "b"]}}
    data.update(overrides)
    return json.dumps({"type": "observation", "data": data})


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _timed_error(url: str, call: Callable[[OpenEnvEnv], object]) -> tuple[str, float]:
    env = OpenEnvEnv(url, bounds=QUICK)
    start = time.monotonic()
    try:
        with pytest.raises(OpenEnvError) as raised:
            call(env)
    finally:
        env.close()
    message = str(raised.value)
    assert "\n" not in message and "\x1b" not in message, message
    return message, time.monotonic() - start


@pytest.mark.parametrize(
    ("reply", "said"),
    [
        ("{this is not json", "with what is not JSON"),
        ("[" * 100_000 + "]" * 100_000, "more than|over 65,536 bytes|not JSON"),
        ("x" * 200_000, "sent a message over 65,536 bytes"),
        (_observation(observation=["not", "an", "object"]), "observation that is not a JSON"),
        (_observation(reward="NaN"), "reward that is not a finite number"),
        (_observation(reward=float("inf")), "reward that is not a finite number|not JSON"),
        (_observation(done="yes"), "done that is not true or false"),
        (_observation(metadata={"legal_actions": "a, b"}), "not a non-empty list of names"),
        (_observation(metadata={"legal_actions": ["a"] * 2}), "a name twice"),
        (_observation(metadata={"legal_actions": [str(i) for i in range(300)]}),
         "300 legal actions, more than agent.max_legal_actions"),
        (_observation(metadata={"legal_actions": ["\x1b[31mred"]}), None),
        (_observation(observation={"text": 42}), "observation 'text' that is not text"),
        (json.dumps({"type": "error", "data": {"message": "\x1b[2Jboom\nsecond line"}}),
         "refused a reset"),
    ],
)
def test_a_server_that_answers_wrong_ends_the_call_in_one_line(reply, said):
    with fake_server(lambda message: reply) as url:
        if said is None:  # a name with an escape is data: kept, never obeyed
            env = OpenEnvEnv(url, bounds=QUICK)
            try:
                _, info = env.reset(seed=0)
                assert info["_legal_actions"] == ["\x1b[31mred"]
            finally:
                env.close()
            return
        message, seconds = _timed_error(url, lambda env: env.reset(seed=0))
    assert any(part in message for part in said.split("|")), message
    assert seconds < QUICK.timeout + 3


def test_a_server_that_never_answers_times_out():
    with fake_server(lambda message: None) as url:
        message, seconds = _timed_error(url, lambda env: env.reset(seed=0))
    assert "did not answer a reset within 1.5 s" in message
    assert seconds < QUICK.timeout + 2


def test_no_server_at_all_is_one_line_within_the_connect_timeout():
    port = _free_port()
    message, seconds = _timed_error(f"ws://127.0.0.1:{port}", lambda env: env.reset(seed=0))
    assert "closed or refused the connection" in message and "llamagym serve" in message
    assert seconds < QUICK.connect_timeout + 2


def test_a_server_that_starts_late_is_waited_for_within_the_connect_timeout():
    port, started = _free_port(), threading.Event()

    def start_late() -> None:
        time.sleep(1.0)
        with fake_server(lambda message: _observation(), port=port):
            started.set()
            time.sleep(5)

    threading.Thread(target=start_late, daemon=True).start()
    env = OpenEnvEnv(f"ws://127.0.0.1:{port}", bounds=QUICK)
    try:
        start = time.monotonic()
        observation, info = env.reset(seed=0)  # refused at first, then answered
        assert started.is_set() and 0.9 < time.monotonic() - start < QUICK.connect_timeout
        assert info["_legal_actions"] == ["a", "b"]
    finally:
        env.close()


def test_a_server_killed_mid_episode_ends_the_step_in_one_line(serve):
    with serve("blackjack", "--max-sessions", "4") as served:
        env = OpenEnvEnv(served.url, bounds=QUICK)
        try:
            env.reset(seed=0)
            os.kill(served.process.pid, signal.SIGKILL)
            served.process.wait(timeout=10)
            start = time.monotonic()
            with pytest.raises(OpenEnvError, match="closed or refused the connection"):
                env.step("hit")
            assert time.monotonic() - start < QUICK.timeout + 3
            with pytest.raises(OpenEnvError, match="closed or refused"):  # and stays so
                env.reset(seed=1)
        finally:
            env.close()


def _handshake(port: int) -> socket.socket:
    """A WebSocket opened by hand, so that it can vanish without a close frame."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                  "Sec-WebSocket-Version: 13\r\n\r\n").encode())
    assert b" 101 " in sock.recv(4096).split(b"\r\n", 1)[0]
    return sock


def _wait_for_slot(url: str, seconds: float) -> float:
    start = time.monotonic()
    while True:
        env = OpenEnvEnv(url, bounds=QUICK)
        try:
            env.reset(seed=0)
            return time.monotonic() - start
        except OpenEnvError as error:
            assert "is full" in str(error), error
            assert time.monotonic() - start < seconds, "the vanished client kept its slot"
            time.sleep(0.2)
        finally:
            env.close()


def test_a_client_that_drops_its_socket_without_closing_frees_its_slot(serve_in_thread):
    with serve_in_thread("blackjack", max_sessions=1) as url:
        port = int(url.rsplit(":", 1)[1])
        sock = _handshake(port)
        time.sleep(0.3)  # the session is made
        with pytest.raises(OpenEnvError, match="is full"):
            OpenEnvEnv(url, bounds=QUICK).reset(seed=0)
        sock.close()  # no close frame: the TCP connection just ends
        assert _wait_for_slot(url, 10) < 10


def test_a_client_gone_silent_is_dropped_by_the_keepalive_and_its_slot_freed(serve_in_thread):
    with serve_in_thread("blackjack", max_sessions=1, keepalive=0.5) as url:
        port = int(url.rsplit(":", 1)[1])
        sock = _handshake(port)  # open, but it never reads nor answers a ping again
        try:
            time.sleep(0.3)
            with pytest.raises(OpenEnvError, match="is full"):
                OpenEnvEnv(url, bounds=QUICK).reset(seed=0)
            assert _wait_for_slot(url, 10) < 10
        finally:
            sock.close()
