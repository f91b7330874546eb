"""A Gymnasium env on an OpenEnv server: OpenEnv's sync client, one session per env.

The observation is text (what the server's observation says, in its ``text`` field or
another named one), the legal actions are names (the metadata's ``legal_actions``, or a
named discrete set the config gives), and ``step`` takes a name (or an index). What the
server sends is data: every message is bounded in bytes (the WebSocket's ``max_size``),
every answer must come within ``timeout`` seconds, every value is checked for its type
and cut to its bound, and anything else ends the call with :class:`OpenEnvError`, one
line naming the server and the fix. A run counts an env that raised and replaces it
(:mod:`llamagym.rollout.env_failures`); this env never blocks past its timeouts.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium
from gymnasium import spaces

from llamagym.display import cut, printable
from llamagym.errors import LlamaGymError
from llamagym_openenv import protocol

#: Keys of the info this env returns (``_``: kept out of episode summaries).
LEGAL = "_legal_actions"
CONTEXT = "_episode_context"
#: How much of a server's own words an error message quotes.
_QUOTED_CHARS = 160


class OpenEnvError(LlamaGymError):
    """An OpenEnv server could not be reached, refused, or sent what is not allowed."""


@dataclass(frozen=True)
class Bounds:
    """What this env accepts from a server, and how long it waits."""

    connect_timeout: float = 20.0
    timeout: float = 30.0
    max_message_bytes: int = 1_000_000
    max_observation_chars: int = 4_000
    max_legal_actions: int = 256
    max_action_chars: int = 200
    #: Steps after which an episode the server has not ended is truncated (Gymnasium's
    #: TimeLimit): a server's env may never say done.
    max_episode_steps: int = 200


@dataclass(frozen=True)
class Wire:
    """How a server's messages are read: which observation field holds the text,
    which metadata key the legal actions, the action's field, and a named discrete set
    (``actions``) to use instead of the server's list (sent as the index when
    ``send_index``)."""

    text_field: str = "text"
    legal_key: str = protocol.LEGAL_ACTIONS
    action_field: str = "action"
    actions: tuple[str, ...] = ()
    send_index: bool = False


def quoted(value: Any) -> str:
    """A server's words as an error message may show them: one line, escaped, cut."""
    text = printable(value if isinstance(value, str) else repr(value), keep="")
    return text if len(text) <= _QUOTED_CHARS else text[:_QUOTED_CHARS] + "..."


class OpenEnvEnv(gymnasium.Env):
    """One OpenEnv session as a Gymnasium env (connected on the first reset)."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, url: str, wire: Wire | None = None, bounds: Bounds | None = None):
        super().__init__()
        if not url.startswith(("ws://", "wss://", "http://", "https://")):
            raise OpenEnvError(
                f"agent.url {quoted(url)} is not an OpenEnv server's URL: give "
                "ws://HOST:PORT or http://HOST:PORT (`llamagym serve AGENT` prints one)"
            )
        self.url = url
        self.wire = wire or Wire()
        self.bounds = bounds or Bounds()
        self.observation_space = spaces.Text(max_length=self.bounds.max_observation_chars + 4)
        self.action_space = spaces.Text(max_length=self.bounds.max_action_chars)
        self._client: Any = None
        self._legal: list[str] | None = None
        self._steps = 0

    # -- Gymnasium -------------------------------------------------------------------
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        kwargs = {} if seed is None else {"seed": int(seed)}
        result = self._call("reset", lambda client: client.reset(**kwargs))
        observation, _, _, _, info = self._read(result, reset=True)
        self._steps = 0
        return observation, info

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        payload = {self.wire.action_field: self._action_value(action)}
        result = self._call("step", lambda client: client.step(payload))
        observation, reward, terminated, truncated, info = self._read(result, reset=False)
        self._steps += 1
        if not (terminated or truncated) and self._steps >= self.bounds.max_episode_steps:
            truncated, self._legal = True, None  # the episode ends here for this env
            info[LEGAL] = None
        return observation, reward, terminated, truncated, info

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)
        super().close()

    # -- the session -------------------------------------------------------------------
    def _connect(self) -> Any:
        from openenv.core.generic_client import GenericEnvClient

        bounds = self.bounds
        client = GenericEnvClient(
            base_url=self.url,
            connect_timeout_s=bounds.connect_timeout,
            message_timeout_s=bounds.timeout,
            max_message_size_mb=bounds.max_message_bytes / 2**20,
            websocket_ping_interval_s=max(bounds.timeout, 1.0),
            websocket_ping_timeout_s=max(bounds.timeout, 1.0),
        ).sync()
        return client

    def _call(self, what: str, call: Any) -> Any:
        """``call(client)``, with whatever goes wrong said in one line; a session that
        failed is dropped (closed in the background), so the next reset starts anew.
        A new session whose connection is refused is tried again every half second
        until ``connect_timeout``: a server that is starting, or restarting after a
        crash, is waited for as long."""
        fresh = self._client is None
        deadline = time.monotonic() + self.bounds.connect_timeout
        while True:
            if self._client is None:
                self._client = self._connect()
            try:
                return call(self._client)
            except Exception as error:
                client, self._client = self._client, None
                threading.Thread(target=_close_quietly, args=(client,), daemon=True).start()
                if fresh and _refused(error) and time.monotonic() + 0.5 < deadline:
                    time.sleep(0.5)
                    continue
                raise OpenEnvError(self._problem(what, error)) from error

    def _problem(self, what: str, error: BaseException) -> str:
        where = f"the OpenEnv server at {quoted(self.url)}"
        bounds = self.bounds
        text = str(error)
        code = _close_code(error)
        if isinstance(error, (asyncio.TimeoutError, TimeoutError)):
            return (f"{where} did not answer a {what} within {bounds.timeout:g} s: raise "
                    "agent.timeout_seconds or check the server")
        if code == 1009:
            return (f"{where} sent a message over {bounds.max_message_bytes:,} bytes on a "
                    f"{what}: raise agent.max_message_bytes if it is meant to")
        if isinstance(error, (json.JSONDecodeError, RecursionError)):
            return f"{where} answered a {what} with what is not JSON ({quoted(text)})"
        if "CAPACITY_REACHED" in text:
            return (f"{where} is full and refused a session ({quoted(text)}): start it "
                    "with a larger --max-sessions, or run fewer envs (rollout.num_envs)")
        if isinstance(error, ConnectionError) or code is not None or _is_closed(error):
            return (f"{where} closed or refused the connection on a {what} ({quoted(text)}): "
                    "is it running? (`llamagym serve AGENT` starts one)")
        if isinstance(error, RuntimeError) and text.startswith("Server error:"):
            return f"{where} refused a {what}: {quoted(text)}"
        return f"{where} failed on a {what}: {type(error).__name__}: {quoted(text)}"

    # -- what the server sent -----------------------------------------------------
    def _read(self, result: Any, reset: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        try:
            return self._parse(result, reset)
        except OpenEnvError:
            self.close()
            raise

    def _parse(self, result: Any, reset: bool) -> tuple[str, float, bool, bool, dict[str, Any]]:
        where = f"the OpenEnv server at {quoted(self.url)}"
        observation = getattr(result, "observation", None)
        if not isinstance(observation, Mapping):
            raise OpenEnvError(f"{where} sent an observation that is not a JSON object "
                               f"({quoted(observation)})")
        metadata = getattr(result, "metadata", None) or observation.get("metadata") or {}
        if not isinstance(metadata, Mapping):
            raise OpenEnvError(f"{where} sent metadata that is not a JSON object "
                               f"({quoted(metadata)})")
        text = self._text(observation, where)
        reward = _reward(getattr(result, "reward", None), where)
        done = getattr(result, "done", False)
        if not isinstance(done, bool):
            raise OpenEnvError(f"{where} sent a done that is not true or false ({quoted(done)})")
        truncated = done and metadata.get(protocol.TRUNCATED) is True
        self._legal = None if done else self._legal_actions(metadata, where)
        info: dict[str, Any] = _scalars(metadata.get(protocol.INFO))
        info[LEGAL] = self._legal
        if reset:  # what the server says holds for the episode: its prompt, its context
            parts = [metadata.get(key) for key in (protocol.SYSTEM_PROMPT,
                                                   protocol.EPISODE_CONTEXT)]
            context = "\n".join(p.strip() for p in parts if isinstance(p, str) and p.strip())
            if context:
                info[CONTEXT] = context[: self.bounds.max_observation_chars]
        return text, reward, done and not truncated, truncated, info

    def _text(self, observation: Mapping[str, Any], where: str) -> str:
        field = self.wire.text_field
        if field in observation:
            value = observation[field]
            if not isinstance(value, str):
                raise OpenEnvError(f"{where} sent an observation {field!r} that is not text "
                                   f"({quoted(value)}); set agent.text_field to its text field")
            text = value
        else:  # no text field: its other fields, one per line
            text = "\n".join(f"{key}: {_field_text(value)}" for key, value
                             in sorted(observation.items(), key=lambda item: str(item[0]))
                             if key != "metadata")
        return cut(text, self.bounds.max_observation_chars)

    def _legal_actions(self, metadata: Mapping[str, Any], where: str) -> list[str] | None:
        if self.wire.actions:
            return list(self.wire.actions)
        names = metadata.get(self.wire.legal_key)
        if names is None:
            return None
        bounds = self.bounds
        if not isinstance(names, list) or not names:
            raise OpenEnvError(f"{where} sent legal actions that are not a non-empty list "
                               f"of names ({quoted(names)})")
        if len(names) > bounds.max_legal_actions:
            raise OpenEnvError(f"{where} sent {len(names):,} legal actions, more than "
                               f"agent.max_legal_actions = {bounds.max_legal_actions}")
        for name in names:
            if not isinstance(name, str) or not name.strip():
                raise OpenEnvError(f"{where} sent a legal action that is not a name "
                                   f"({quoted(name)})")
            if len(name) > bounds.max_action_chars:
                raise OpenEnvError(f"{where} sent a legal action of {len(name):,} characters, "
                                   f"more than agent.max_action_chars = {bounds.max_action_chars}")
        if len(set(names)) != len(names):
            raise OpenEnvError(f"{where} sent legal actions with a name twice ({quoted(names)})")
        return list(names)

    def _action_value(self, action: Any) -> Any:
        """What the server is sent for ``action`` (a legal action's name or index)."""
        legal = self._legal
        if isinstance(action, (int,)) and not isinstance(action, bool) and legal:
            if not 0 <= action < len(legal):
                raise OpenEnvError(f"action {action} is out of range: {len(legal)} legal actions")
            return action if self.wire.send_index else legal[action]
        text = str(action)
        if self.wire.send_index and legal and text in legal:
            return legal.index(text)
        if len(text) > self.bounds.max_action_chars:
            raise OpenEnvError(f"an action of {len(text):,} characters is more than "
                               f"agent.max_action_chars = {self.bounds.max_action_chars}")
        return text


def _close_quietly(client: Any) -> None:
    # A session that failed may fail to close; it is dropped either way.
    with contextlib.suppress(Exception):
        client.close()


def _close_code(error: BaseException) -> int | None:
    for frame in (getattr(error, "sent", None), getattr(error, "rcvd", None)):
        code = getattr(frame, "code", None)
        if isinstance(code, int):
            return code
    cause = error.__cause__ or error.__context__
    return _close_code(cause) if cause is not None and cause is not error else None


def _refused(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it) is a connection refused: no server listens."""
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, ConnectionRefusedError):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _is_closed(error: BaseException) -> bool:
    return type(error).__name__.startswith("ConnectionClosed") or isinstance(error, OSError)


def _reward(value: Any, where: str) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise OpenEnvError(f"{where} sent a reward that is not a finite number ({quoted(value)})")
    return float(value)


def _field_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)[:2_000]


def _scalars(info: Any) -> dict[str, Any]:
    """A server's info as this env keeps it: JSON scalars, strings cut, keys bounded."""
    if not isinstance(info, Mapping):
        return {}
    kept: dict[str, Any] = {}
    for key, value in list(info.items())[: protocol.MAX_INFO_KEYS]:
        if not isinstance(key, str) or key.startswith("_"):
            continue
        if isinstance(value, str):
            kept[key[:100]] = value[: protocol.MAX_INFO_STRING_CHARS]
        elif isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
            kept[key[:100]] = value
    return kept


def named_set(text: str) -> tuple[str, ...]:
    """``"stick,hit"`` -> ``("stick", "hit")``: a named discrete set of actions."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def legal_of(info: Mapping[str, Any]) -> Sequence[str] | None:
    """The legal actions this env put in ``info`` (None: the server names none)."""
    names = info.get(LEGAL)
    return list(names) if isinstance(names, list) else None
