"""Every extension point of LlamaGym, in one place.

Plugins implement these with ``@llamagym.hookimpl`` and are found through the
``llamagym`` entry-point group. Hooks are always called with keyword arguments.

Three kinds of hook:

* registration hooks run once at start-up; each receives a ``register`` callback;
* per-step hooks (system prompt, observation text, action extraction) return the
  first non-``None`` answer: the agent's own methods answer at normal priority, so a
  plugin marked ``tryfirst`` overrides them and one marked ``trylast`` is a fallback;
* observer hooks (reward shaping, episode end, update end) call every plugin.

A plugin that raises inside a per-step or observer hook is reported once, by name and
distribution, and skipped for that call; the run goes on. (These hooks are called one
implementation at a time, so pluggy hook wrappers do not apply to them.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from llamagym.agent import Agent
    from llamagym.model_registry import ModelEntry
    from llamagym.trajectory import Episode

PROJECT_NAME = "llamagym"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def llamagym_register_agents(register: Callable[..., None]) -> None:
    """Register agents: ``register(name, entry_point, description=..., env_id=...)``.

    ``entry_point`` is ``"module:AgentSubclass"``, imported only when the agent is used,
    so ``llamagym list`` stays fast. Called once for every plugin at start-up.
    """


@hookspec
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    """Register algorithms: ``register(name, entry_point, description=...)``.

    ``entry_point`` is ``"module:AlgorithmClass"`` (a :class:`llamagym.Algorithm`).
    Called once for every plugin at start-up.
    """


@hookspec
def llamagym_register_envs(register: Callable[..., None]) -> None:
    """Register Gymnasium environments: ``register(id, entry_point, **kwargs)``.

    ``register`` is :func:`gymnasium.register`; an id already registered is skipped.
    Called once for every plugin, the first time an environment is made.
    """


@hookspec
def llamagym_register_models(register: Callable[[ModelEntry], None]) -> None:
    """Add model registry entries: ``register(ModelEntry(...))`` (see ``llamagym models``).

    An entry gives a model's LoRA targets, rank, generation defaults and chat-template
    fallback. Called once for every plugin, the first time the registry is read.
    """


@hookspec
def llamagym_register_commands(cli: typer.Typer) -> None:
    """Add sub-commands to the ``llamagym`` command line (``cli.command()(fn)``).

    Called once for every plugin when the CLI starts.
    """


@hookspec(firstresult=True)
def llamagym_system_prompt(agent: Agent) -> str | None:
    """Return the system prompt for ``agent``'s episodes. First non-None answer wins.

    The agent's own ``get_system_prompt`` answers at normal priority.
    """


@hookspec(firstresult=True)
def llamagym_format_observation(agent: Agent, observation: Any, info: dict) -> str | None:
    """Return the user-turn text for one observation. First non-None answer wins.

    The agent's own ``format_observation`` answers at normal priority.
    """


@hookspec(firstresult=True)
def llamagym_extract_action(agent: Agent, reply: str, legal_actions: Sequence[str]) -> int | None:
    """Map a model reply to an index into ``legal_actions``. First non-None answer wins.

    Return ``None`` when the reply holds no legal action, so the next parser may try.
    Built in: JSON ``{"action": ...}`` (tryfirst), the agent's own ``extract_action``
    (normal), a whole-word regex over the action names (trylast). When every parser
    returns ``None`` the run's invalid-action policy applies.
    """


@hookspec
def llamagym_shape_reward(
    agent: Agent, observation: Any, action: str, reward: float, info: dict
) -> float | None:
    """Return a term added to the environment's reward for one step (or ``None``).

    Every plugin is called and the terms are summed; only called when the run sets
    ``rollout.reward_shaping = true``.
    """


@hookspec
def llamagym_episode_end(agent: Agent, episode: Episode) -> None:
    """Observe a finished episode (loggers, replay buffers). Every plugin is called."""


@hookspec
def llamagym_update_end(agent: Agent, update: int, metrics: dict[str, float]) -> None:
    """Observe the metrics of one finished update (loggers). Every plugin is called."""


def all_hook_names() -> list[str]:
    """Names of every hook declared here, in file order."""
    return [name for name in globals() if name.startswith("llamagym_")]


__all__: Sequence[str] = ["hookimpl", "hookspec", "all_hook_names", "PROJECT_NAME"]
