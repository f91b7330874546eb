"""The built-in plugin through which a task's own methods answer the per-step hooks at
normal priority, between ``tryfirst`` and other plugins: its system prompt, its
observation text, and its own parsers (:attr:`llamagym.Task.reply_parsers`).

Which of the task's parsers read a reply is kept for the call (:func:`own_parser`), so
the turn records it rather than this plugin's name.
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from typing import Any

from llamagym.plugin_runtime.hookspecs import hookimpl

# The task's parser that found the action in the llamagym_extract_action call of this
# context, if the task's parsers answered it.
_own_parser: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llamagym_own_parser", default=None
)


def own_parser() -> str | None:
    """The task's parser that found the action in the last ``llamagym_extract_action``
    call of this context, or ``None`` when they found none."""
    return _own_parser.get()


def forget_own_parser() -> None:
    _own_parser.set(None)


@hookimpl
def llamagym_system_prompt(agent: Any) -> str | None:
    return agent.get_system_prompt()


@hookimpl
def llamagym_format_observation(agent: Any, observation: Any, info: dict) -> str | None:
    return agent.observation_text(observation, info)


@hookimpl
def llamagym_extract_action(agent: Any, reply: str, legal_actions: Sequence[str]) -> int | None:
    index, parser = agent.parse_reply(reply, legal_actions)
    _own_parser.set(parser)
    return index
