"""Every extension point of LlamaGym, in one place.

Plugins implement these with ``@llamagym.hookimpl`` and are found through the
``llamagym`` entry-point group. Hooks are always called with keyword arguments, and an
implementation may take any subset of a hook's arguments (an observer written before
``run`` was added still receives its calls).

Three kinds of hook:

* registration hooks run once at start-up; each receives a ``register`` callback that
  takes a spec (:mod:`llamagym.plugin_runtime.registry`) or the spec's fields;
* per-step hooks (system prompt, observation text, action extraction, reward shaping)
  are called for every step: the first three return the first non-``None`` answer (the
  agent's own methods answer at normal priority, so a plugin marked ``tryfirst``
  overrides them and one marked ``trylast`` is a fallback), reward shaping sums every
  answer;
* observer hooks (episode end, update end) call every plugin and receive a
  :class:`~llamagym.plugin_runtime.registry.RunContext`.

A plugin that raises inside a hook is reported once, by name and distribution, and its
answer counts as ``None``; the run goes on. Hook wrappers (``wrapper=True`` or
``hookwrapper=True``) apply to every hook, as in any pluggy project.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import typer

    from llamagym.plugin_runtime.registry import AgentView, EpisodeView, RunContext

PROJECT_NAME = "llamagym"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: Hooks called for every step; the plugins that answer them are recorded
#: (:meth:`llamagym.plugin_runtime.manager.Plugins.participants`).
PER_STEP_HOOKS: tuple[str, ...] = (
    "llamagym_system_prompt",
    "llamagym_format_observation",
    "llamagym_extract_action",
    "llamagym_shape_reward",
)


@hookspec
def llamagym_register_agents(register: Callable[..., None]) -> None:
    """Register agents: ``register(AgentSpec(...))`` or
    ``register(name, entry_point, description=..., env_id=...)``.

    ``entry_point`` is ``"module:AgentSubclass"``, imported only when the agent is used,
    so ``llamagym list`` stays fast; the class gets its name, description and env id
    from the spec. ``override=True`` replaces an agent of that name registered by
    another plugin (a warning names both); without it such a name is refused.
    Called once for every plugin at start-up.
    """


@hookspec
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    """Register algorithms: ``register(AlgorithmSpec(...))`` or
    ``register(name, entry_point, description=...)``.

    ``entry_point`` is ``"module:AlgorithmClass"`` (a :class:`llamagym.Algorithm`).
    ``override=True`` replaces a built-in or another plugin's algorithm of that name.
    Called once for every plugin at start-up.
    """


@hookspec
def llamagym_register_envs(register: Callable[..., None]) -> None:
    """Register Gymnasium environments: ``register(id, entry_point, **kwargs)``.

    ``register`` is :func:`gymnasium.register`; an id already registered is skipped.
    Called once for every plugin, the first time an environment is made.
    """


@hookspec
def llamagym_register_models(register: Callable[..., None]) -> None:
    """Add model registry entries: ``register(ModelEntry(...))`` (see ``llamagym models``).

    An entry gives a model's LoRA targets, rank, chat-template fallback and offline
    source (its generation defaults are a note that `llamagym models --json` shows; a
    run samples with ``rollout.*``). A name or Hub id already registered is refused
    unless the call passes ``override=True``. Called once for every plugin, the first
    time the registry is read.
    """


@hookspec
def llamagym_register_commands(cli: typer.Typer) -> None:
    """Add sub-commands to the ``llamagym`` command line (``cli.command()(fn)``).

    Called once for every plugin when the CLI starts.
    """


@hookspec(firstresult=True)
def llamagym_system_prompt(agent: AgentView) -> str | None:
    """Return the system prompt for ``agent``'s episodes. First non-None answer wins.

    The agent's own ``get_system_prompt`` answers at normal priority.
    """


@hookspec(firstresult=True)
def llamagym_format_observation(agent: AgentView, observation: Any, info: dict) -> str | None:
    """Return the user-turn text for one observation. First non-None answer wins.

    The agent's own ``format_observation`` answers at normal priority.
    """


@hookspec(firstresult=True)
def llamagym_extract_action(
    agent: AgentView, reply: str, legal_actions: Sequence[str]
) -> int | None:
    """Map a model reply to an index into ``legal_actions``. First non-None answer wins.

    Return ``None`` when the reply holds no legal action, so the next parser may try.
    The agent answers at normal priority with its own parser chain
    (``Task.reply_parsers``: JSON ``{"action": ...}``, its ``extract_action``, a
    whole-word regex over the action names), so a plugin overrides it, or with
    ``trylast`` adds a fallback after it. When every parser returns ``None`` the run's
    invalid-action policy applies.
    """


@hookspec
def llamagym_shape_reward(
    agent: AgentView, observation: Any, action: str, reward: float, info: dict
) -> float | None:
    """Return a term added to the environment's reward for one step (or ``None``).

    Every plugin is called and the terms are summed; only called when the run sets
    ``rollout.reward_shaping = true``.
    """


@hookspec
def llamagym_episode_end(agent: AgentView, episode: EpisodeView, run: RunContext) -> None:
    """Observe a finished episode (loggers, replay buffers). Every plugin is called.

    ``run.run_dir`` is ``None`` outside a run and on ranks other than 0.
    """


@hookspec
def llamagym_update_end(
    agent: AgentView, update: int, metrics: dict[str, float], run: RunContext
) -> None:
    """Observe the metrics of one finished update (loggers). Every plugin is called.

    ``run.run_dir`` is the run directory to write to (``None``: write nothing).
    """


def all_hook_names() -> list[str]:
    """Names of every hook declared here, in file order."""
    return [name for name in globals() if name.startswith("llamagym_")]


__all__: Sequence[str] = [
    "hookimpl",
    "hookspec",
    "all_hook_names",
    "PER_STEP_HOOKS",
    "PROJECT_NAME",
]
