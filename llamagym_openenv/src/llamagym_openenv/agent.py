"""Agent ``openenv``: an env on an OpenEnv server, by URL, trained like any other.

A user turn is the server's observation text; the legal actions are the names the
server lists in the observation's metadata (``legal_actions``, as ``llamagym serve``
sends them), or a named discrete set given here (``agent.actions=stick,hit``); score
mode ranks them, generate mode reads a reply through the parsers. What the server says
holds for the episode (its system prompt and episode context, sent at reset) goes into
that episode's system prompt. Each env is one session, so ``rollout.num_envs`` sessions
are open at once: the server must allow as many (``llamagym serve --max-sessions``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llamagym.agent import Agent
from llamagym.config import MAX_OBSERVATION_CHARS
from llamagym_openenv import protocol
from llamagym_openenv.client import (
    CONTEXT,
    Bounds,
    OpenEnvEnv,
    OpenEnvError,
    Wire,
    legal_of,
    named_set,
)
from llamagym_openenv.plugin import OPENENV


class OpenEnvOptions(BaseModel):
    """The ``agent`` section keys of agent ``openenv`` (``--set agent.url=...``)."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(
        "", max_length=2_000,
        description="The OpenEnv server: ws://HOST:PORT or http://HOST:PORT (what "
        "`llamagym serve AGENT` prints).",
    )
    text_field: str = Field(
        "text", min_length=1, max_length=100,
        description="The observation field holding its text; an observation without it "
        "is shown as its fields, one 'key: value' per line.",
    )
    legal_actions_key: str = Field(
        protocol.LEGAL_ACTIONS, min_length=1, max_length=100,
        description="The metadata key listing the legal actions by name.",
    )
    action_field: str = Field(
        "action", min_length=1, max_length=100,
        description="The field of the server's action that takes the action's name.",
    )
    actions: str = Field(
        "", max_length=10_000,
        description="A named discrete set, NAME,NAME,... (in the server's order), used "
        "instead of the server's list; empty: the server's list.",
    )
    send_index: bool = Field(
        False, description="Send the chosen action's index in the legal actions, not its name."
    )
    system_prompt: str = Field(
        "", max_length=10_000, description="The system prompt; empty: a generic one."
    )
    timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="The longest wait for one answer of the server."
    )
    connect_timeout_seconds: float = Field(
        20.0, gt=0, le=600,
        description="The longest wait for a connection; a refused one (a server starting, "
        "or restarting after a crash) is tried again every 0.5 s until then.",
    )
    max_message_bytes: int = Field(
        1_000_000, ge=1_024, le=100_000_000,
        description="The largest message taken from the server; a larger one ends the session.",
    )
    max_observation_chars: int = Field(
        4_000, ge=50, le=MAX_OBSERVATION_CHARS,
        description="Observation text longer than this is cut.",
    )
    max_legal_actions: int = Field(
        256, ge=1, le=10_000, description="More legal actions than this end the session."
    )
    max_episode_steps: int = Field(
        200, ge=1, le=100_000,
        description="Steps after which an episode the server has not ended is cut "
        "(truncated): a server's env may never say done.",
    )
    max_action_chars: int = Field(
        200, ge=1, le=protocol.MAX_ACTION_CHARS, description="The longest action name taken."
    )


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


@OPENENV.bind
class OpenEnvAgent(Agent):
    baselines = {"random": random_action}
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "reply_prefix": '{"action": "',
                    "max_new_tokens": 16},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 64,
                      "minibatch_size": 64, "epochs": 2, "entropy_coef": 0.01},
        "training": {"episodes": 2_000, "eval_episodes": 100},
    }
    Config: type[BaseModel] = OpenEnvOptions
    options: Any

    def make_env(self) -> OpenEnvEnv:
        options = self.options
        if not options.url:
            raise OpenEnvError(
                "agent openenv needs its server's URL: --set agent.url=ws://127.0.0.1:PORT "
                "(`llamagym serve AGENT` starts one and prints it)"
            )
        wire = Wire(
            text_field=options.text_field, legal_key=options.legal_actions_key,
            action_field=options.action_field, actions=named_set(options.actions),
            send_index=options.send_index,
        )
        bounds = Bounds(
            connect_timeout=options.connect_timeout_seconds, timeout=options.timeout_seconds,
            max_message_bytes=options.max_message_bytes,
            max_observation_chars=options.max_observation_chars,
            max_legal_actions=options.max_legal_actions, max_action_chars=options.max_action_chars,
            max_episode_steps=options.max_episode_steps,
        )
        return OpenEnvEnv(options.url, wire, bounds)

    def get_system_prompt(self) -> str:
        if self.options.system_prompt:
            return str(self.options.system_prompt)
        if self.config.rollout.mode == "generate":
            return ('Act in the environment. Reply with one legal action as JSON: '
                    '{"action": "NAME"}.')
        return "Act in the environment. Reply with one legal action."

    def episode_context(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        context = info.get(CONTEXT)
        return context if isinstance(context, str) else None

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str] | None:
        return legal_of(info)

    def env_action(self, index: int, legal_actions: Sequence[str]) -> str:
        return legal_actions[index]  # the env sends the name, or its index (send_index)
