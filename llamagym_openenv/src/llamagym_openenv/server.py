"""Any installed agent's env as an OpenEnv server (``llamagym serve AGENT``).

Each WebSocket session gets an env of its own (:class:`ServedEnvironment`, made by the
agent's ``make_env``); OpenEnv's ``create_app`` makes the FastAPI app (its ``/ws``
sessions, ``/health``, ``/schema``) and refuses a session past ``--max-sessions`` with
its ``CAPACITY_REACHED`` error; uvicorn serves it. What a session sees is what the
agent's prompts show: the observation as the agent formats it (through the plugins'
``llamagym_format_observation``, as a run renders it), the legal actions by name in
the observation's metadata, and the reward and done the env gives. A reset's seed goes
to ``env.reset(seed=...)``, so a seeded episode plays as it does in process.

uvicorn's WebSocket keepalive (a ping every ``keepalive`` seconds, closed when no pong
comes within as long) ends the session of a client that vanished without closing: its
env is closed and its slot freed.
"""

from __future__ import annotations

import logging
import math
import socket
from collections.abc import Callable, Mapping
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

from llamagym.errors import LlamaGymError
from llamagym.rollout.env_checks import checked_reset, checked_step, max_turns
from llamagym.rollout.trajectory import info_summary
from llamagym.task import Task
from llamagym_openenv import protocol
from llamagym_openenv.protocol import TextAction, TextObservation
from llamagym_openenv.serve_command import DEFAULT_KEEPALIVE_SECONDS, LOOPBACK

logger = logging.getLogger(__name__)


class ServeError(LlamaGymError):
    """The server could not start (a port in use, an agent whose env cannot be made)."""


class ServedEnvironment(Environment[TextAction, TextObservation, State]):
    """One session's env: the agent's ``make_env()``, spoken to in its text."""

    # Every session has an env of its own, and the agent (the prompts) is read only.
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, agent: Task):
        super().__init__()
        self.agent = agent
        self.env = agent.make_env()
        self.turn_cap = max_turns(self.env, agent.config.rollout.max_episode_turns)
        self._state = State()
        self._legal: list[str] | None = None
        self._done = True
        self._started = False  # whether this session was ever reset

    # -- OpenEnv's Environment -----------------------------------------------------
    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> TextObservation:
        observation, info = checked_reset(self.env, seed)  # type: ignore[arg-type]
        self._state = State(episode_id=episode_id, step_count=0)
        self._done, self._started = False, True
        extra = {
            protocol.AGENT: self.agent.name,
            protocol.SYSTEM_PROMPT: self.agent.plugins.system_prompt(self.agent),
            protocol.EPISODE_CONTEXT: self.agent.episode_context(observation, info),
        }
        return self._observation(observation, info, None, False, False, extra)

    def step(
        self, action: TextAction, timeout_s: float | None = None, **kwargs: Any
    ) -> TextObservation:
        if self._done:
            if not self._started:
                raise ValueError(
                    "this session has no episode: reset first (a client that stepped a "
                    "new session lost its episode with its connection, e.g. to a server "
                    "restart)")
            raise ValueError("the episode is over: reset before stepping again")
        env_action = self._env_action(action.action)
        observation, reward, terminated, truncated, info = checked_step(self.env, env_action)
        self._state.step_count += 1
        if not terminated and self._state.step_count >= self.turn_cap:
            truncated = True  # cut where a run in process would cut it
        self._done = terminated or truncated
        return self._observation(observation, info, float(reward), terminated, truncated, {})

    @property
    def state(self) -> State:
        return self._state

    def close(self) -> None:
        self.env.close()

    # -- the agent's text ------------------------------------------------------------
    def _legal_actions(self, observation: Any, info: Mapping[str, Any]) -> list[str] | None:
        names = self.agent.legal_actions(observation, info)
        if names is None:
            space = getattr(self.env, "action_space", None)
            if space is None or not hasattr(space, "n"):
                return None  # generate mode only: the action's text goes to env.step as it is
            return [str(i) for i in range(int(space.n))]
        return [str(name) for name in names]

    def _env_action(self, name: str) -> Any:
        legal = self._legal
        if legal is None:
            return name
        index = self.agent.action_index(name, legal)
        if index is None:
            shown = ", ".join(legal[:20]) + (", ..." if len(legal) > 20 else "")
            raise ValueError(f"{name[:80]!r} is not a legal action now; legal: {shown}")
        return self.agent.env_action(index, legal)

    def _observation(
        self,
        observation: Any,
        info: Mapping[str, Any],
        reward: float | None,
        terminated: bool,
        truncated: bool,
        extra: Mapping[str, Any],
    ) -> TextObservation:
        self._legal = None if terminated or truncated else self._legal_actions(observation, info)
        text = self.agent.plugins.format_observation(self.agent, observation, dict(info))
        metadata = {
            protocol.LEGAL_ACTIONS: self._legal,
            protocol.TERMINATED: bool(terminated),
            protocol.TRUNCATED: bool(truncated),
            protocol.INFO: json_scalars(info),
            **extra,
        }
        return TextObservation(
            text=text, reward=reward, done=bool(terminated or truncated), metadata=metadata
        )


def json_scalars(info: Mapping[str, Any]) -> dict[str, Any]:
    """The env's info as JSON can carry it: its scalars (:func:`info_summary`), finite
    numbers only, strings cut, at most :data:`protocol.MAX_INFO_KEYS` keys."""
    kept: dict[str, Any] = {}
    for key, value in info_summary(info).items():
        if len(kept) >= protocol.MAX_INFO_KEYS:
            break
        if isinstance(value, float) and not math.isfinite(value):
            continue
        if isinstance(value, str):
            value = value[: protocol.MAX_INFO_STRING_CHARS]
        kept[str(key)[:100]] = value
    return kept


def build_app(agent: Task, max_sessions: int) -> Any:
    """The OpenEnv FastAPI app serving ``agent``'s env, one env per session."""
    from openenv.core.env_server.http_server import create_fastapi_app

    def make_environment() -> ServedEnvironment:
        return ServedEnvironment(agent)

    make_environment.__name__ = f"llamagym:{agent.name}"
    # The plain app (the WebSocket sessions, /reset, /step, /health, /schema): never
    # OpenEnv's web interface, which ENABLE_WEB_INTERFACE would add through create_app.
    return create_fastapi_app(
        make_environment, TextAction, TextObservation, max_concurrent_envs=max_sessions,
        env_name=agent.name,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or a one-line error."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as error:
        raise ServeError(
            f"cannot listen on {host}:{port} ({error.strerror or error}): give another "
            "--port (0 picks a free one) or --host"
        ) from error
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def make_server(app: Any, keepalive: float) -> Any:
    """A uvicorn server for ``app``: requests bounded, keepalive pings on."""
    import uvicorn

    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on",
        ws_max_size=protocol.MAX_REQUEST_BYTES, ws_ping_interval=keepalive,
        ws_ping_timeout=keepalive, timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)


def serve(
    agent: Task,
    host: str,
    port: int,
    max_sessions: int,
    keepalive: float = DEFAULT_KEEPALIVE_SECONDS,
    announce: Callable[[str], None] = print,
) -> None:
    """Serve ``agent``'s env until interrupted; the first line ``announce`` is given
    says where (and whether only this machine can connect)."""
    probe = ServedEnvironment(agent)  # an env that cannot be made fails here, once
    probe.close()
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    reach = ("loopback only: other machines cannot connect; --host 0.0.0.0 serves them"
             if host in (LOOPBACK, "localhost", "::1") else
             f"reachable from other machines on {host}")
    announce(
        f"llamagym serve {agent.name}: OpenEnv server on ws://{_url_host(bound_host)}:"
        f"{bound_port} ({reach}); at most {max_sessions} sessions"
    )
    server = make_server(build_app(agent, max_sessions), keepalive)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

