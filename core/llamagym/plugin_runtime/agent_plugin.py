"""The built-in plugin that lets an :class:`~llamagym.Agent`'s own methods answer the
per-step hooks at normal priority, between ``tryfirst`` and ``trylast`` plugins."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamagym.plugin_runtime.hookspecs import hookimpl


@hookimpl
def llamagym_system_prompt(agent: Any) -> str | None:
    return agent.get_system_prompt()


@hookimpl
def llamagym_format_observation(agent: Any, observation: Any, info: dict) -> str | None:
    return agent.observation_text(observation, info)


@hookimpl
def llamagym_extract_action(agent: Any, reply: str, legal_actions: Sequence[str]) -> int | None:
    return agent.action_index(agent.extract_action(reply), legal_actions)
