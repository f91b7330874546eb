"""Finds plugins through entry points, keeps the registry of what they register (agents,
algorithms, models: :mod:`llamagym.plugin_runtime.registry`), and calls pluggy's untyped
hooks through typed functions.

Each plugin is registered with pluggy through a stand-in whose hook functions call the
plugin's own (:mod:`llamagym.plugin_runtime.isolation`): when one raises, the plugin is reported
once (by name and distribution) and its answer counts as ``None``, so one broken plugin
never ends a run. Hooks are then called the way pluggy calls them, so ``tryfirst`` /
``trylast`` and hook wrappers apply.

What a plugin is handed and what it answers are both checked:

* per-step hooks receive read-only views (the legal actions as a tuple, ``info`` and
  ``metrics`` as read-only mappings, arrays as read-only views: :func:`read_only`), so
  no plugin changes what another plugin, the engine or the env sees;
* a per-step answer of the wrong kind (an action that is not an index or a name of the
  legal actions, a prompt that is not a string, a reward term that is not a finite
  number: :func:`action_index_of`, :func:`reward_term`) is reported once per plugin
  and counts as ``None``, so the next plugin is asked (:mod:`llamagym.plugin_runtime.hook_values`);
* registration hooks run in a worker thread with a time limit
  (``LLAMAGYM_PLUGIN_TIMEOUT`` seconds, default 5; ``0``: none): a plugin that does not
  answer in time is reported and skipped from then on;
* whatever plugin code prints while plugins load or register goes to stderr, so the
  output of a command (``llamagym plugins``' JSON) stays its own.

Environment variables (entry-point names, comma separated; ``DIST:NAME`` names the entry
point ``NAME`` of distribution ``DIST`` only):

* ``LLAMAGYM_DISABLE_PLUGINS=a,b`` skips those plugins; built-in ones too
  (``algorithms``, ``models``, ``tensorboard-logger``, ``wandb-logger``).
  ``llamagym:algorithms`` skips only the built-in, so a third-party plugin of that name
  loads in its place. (The parsers are each agent's: ``llamagym.Task.reply_parsers``.)
* ``LLAMAGYM_LOAD_PLUGINS=a,b`` loads only those third-party plugins; set but empty,
  it loads none but the built-ins (those of the ``llamagym`` distribution).
* ``LLAMAGYM_PLUGIN_TIMEOUT=SECONDS`` bounds each plugin's registration hook (default
  5; ``0`` waits for ever).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import itertools
import logging
import math
import os
import reprlib
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

from llamagym import __version__
from llamagym import moved_name as _moved_name
from llamagym.plugin_runtime import agent_plugin, hookspecs
from llamagym.plugin_runtime.hook_values import (
    RefusedAnswer,
    action_index_of,
    read_only,
    reward_term,
)
from llamagym.plugin_runtime.isolation import (
    AGENT_METHODS,
    Isolation,
    answering_plugin,
    legal_actions_of_call,
)
from llamagym.plugin_runtime.registry import (
    BUILTIN_DISTRIBUTION,
    AgentSpec,
    AlgorithmSpec,
    ModelEntry,
    Registry,
    RunContext,
    Spec,
    disable_hint,
)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "llamagym"
NO_RUN = RunContext(None)


@contextlib.contextmanager
def plugin_output_to_stderr() -> Iterator[None]:
    """While plugin code runs at start-up (imports, registration hooks), what it prints
    goes to stderr: a command's stdout carries only the command's own output."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


@dataclass
class PluginInfo:
    name: str
    distribution: str
    version: str
    hooks: list[str]
    location: str = ""


def _names_from_env(variable: str) -> set[str] | None:
    value = os.environ.get(variable)
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _call_text(args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    shown = [reprlib.repr(arg) for arg in args]
    shown += [f"{key}={reprlib.repr(value)}" for key, value in kwargs.items()]
    return f"register({', '.join(shown)})"


def _registration(
    spec_class: type[Spec], args: tuple, kwargs: dict[str, Any]
) -> tuple[Spec, bool]:
    """The spec and ``override`` flag of one ``register(...)`` call, or TypeError /
    ValueError saying what is wrong with it."""
    kwargs = dict(kwargs)
    override = kwargs.pop("override", False)
    if not isinstance(override, bool):
        raise TypeError(f"override must be True or False, got {override!r}")
    if len(args) == 1 and not kwargs and isinstance(args[0], spec_class):
        return args[0], override
    if spec_class is ModelEntry or (args and isinstance(args[0], (AgentSpec, AlgorithmSpec))):
        given = type(args[0]).__name__ if args else "nothing"
        raise TypeError(f"this hook registers one {spec_class.__name__}, got {given}")
    if len(args) > 3:
        raise TypeError("at most three positional arguments: name, entry_point, description")
    filled = {"plugin", "distribution"} & kwargs.keys()
    if filled:
        raise TypeError(f"{', '.join(sorted(filled))} is filled in by LlamaGym, not passed")
    return spec_class(*args, **kwargs), override


#: Built-in plugins that are gone, by name -> what a user who disabled one does now.
FORMER_PLUGINS = {
    name: f"the {what} parser is the agent's own; to read replies without it, set "
          f"reply_parsers = {without!r} on the agent class (llamagym.Task.reply_parsers)"
    for name, what, without in (("json-action", "JSON", ("extract_action", "regex")),
                                ("regex-action", "regex", ("json", "extract_action")))
}

#: Plugins' methods that forwarded to its registry, moved there in 0.5: the old name ->
#: its place. They work, with a DeprecationWarning, through 0.5, and go in 0.6.
MOVED_METHODS = {name: f"registry.{name}" for name in
                 ("agents", "algorithms", "models", "model", "get")}


class Plugins:
    """The plugin runtime of one process: a pluggy manager, the registry of what the
    plugins registered, and typed access to both."""

    def __init__(self, load_entry_points: bool = True):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.problems: list[str] = []
        self._distributions: dict[str, tuple[str, str]] = {}
        # Each plugin's stand-in, and what the stand-ins report (through _problem) and
        # record: raised hooks, refused answers, late plugins, who answered.
        self._isolation = Isolation(
            self.manager, self._problem, self._distributions, self._registered_by
        )
        self._overflow_reported = False
        self._originals: dict[str, Any] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._lock = threading.RLock()
        self._own_models: list[tuple[ModelEntry, bool]] = []
        #: agent entry point -> the plugin that registered it (built on first use)
        self._agent_plugins: dict[str, str] | None = None
        self._forget_registrations()
        self._envs_registered = False
        self.register(
            agent_plugin, name=AGENT_METHODS, distribution=BUILTIN_DISTRIBUTION, version=__version__
        )
        if load_entry_points:
            with plugin_output_to_stderr():
                self._load_entry_points()
        self.manager.check_pending()

    @property
    def registration_timeout(self) -> float | None:
        """Seconds each plugin's registration hook may take; ``None``: no limit."""
        return self._isolation.registration_timeout

    @registration_timeout.setter
    def registration_timeout(self, seconds: float | None) -> None:
        self._isolation.registration_timeout = seconds

    # -- loading -----------------------------------------------------------------
    def _load_entry_points(self) -> None:
        disabled = _names_from_env("LLAMAGYM_DISABLE_PLUGINS") or set()
        for name in sorted(disabled):
            former = FORMER_PLUGINS.get(name.rpartition(":")[2])
            if former is not None:
                self._problem(f"LLAMAGYM_DISABLE_PLUGINS names {name!r}, which is no "
                              f"plugin since LlamaGym 0.5.1: {former}")
        allowed = _names_from_env("LLAMAGYM_LOAD_PLUGINS")
        found = []
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else "unknown"
            version = (dist.version if dist is not None else "") or (
                __version__ if dist_name == BUILTIN_DISTRIBUTION else "unknown"
            )
            found.append((entry_point, dist_name, version))
        # Built-ins first: they hold their names against any third party.
        found.sort(key=lambda item: item[1] != BUILTIN_DISTRIBUTION)
        claimed = dict(self._distributions)
        for entry_point, dist_name, version in found:
            name = entry_point.name
            names = {name, f"{dist_name}:{name}"}
            if names & disabled:
                continue
            builtin = dist_name == BUILTIN_DISTRIBUTION
            if allowed is not None and not builtin and not names & allowed:
                continue
            if name in claimed:
                held_by, held_version = claimed[name]
                if held_by != dist_name:  # else the same distribution seen twice on sys.path
                    self._name_taken(name, held_by, held_version, dist_name, version)
                continue
            claimed[name] = (dist_name, version)
            try:
                plugin = entry_point.load()
            except Exception as error:
                self._problem(
                    f"plugin {name!r} (distribution {dist_name} {version}) failed to import: "
                    f"{type(error).__name__}: {error}; {disable_hint(name)}"
                )
                continue
            self.register(plugin, name=name, distribution=dist_name, version=version)

    def _name_taken(
        self, name: str, held_by: str, held_version: str, dist_name: str, version: str
    ) -> None:
        holder = f"{'the built-in' if held_by == BUILTIN_DISTRIBUTION else 'the'} plugin "
        self._problem(
            f"plugin {name!r} of distribution {dist_name} {version} is not loaded: "
            f"{holder}{name!r} (distribution {held_by} {held_version}) has that name; to "
            f"load it in that one's place set LLAMAGYM_DISABLE_PLUGINS={held_by}:{name}"
        )

    def register(
        self, plugin: Any, name: str, distribution: str = "", version: str = ""
    ) -> bool:
        """Register a plugin object; a misspelt hook is reported and the plugin skipped.
        A built-in (distribution ``llamagym``) given no version gets LlamaGym's."""
        if distribution == BUILTIN_DISTRIBUTION and not version:
            version = __version__
        unknown = [
            attr
            for attr in dir(plugin)
            if attr.startswith("llamagym_") and attr not in hookspecs.all_hook_names()
        ]
        if unknown:
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) implements "
                f"unknown hook(s) {', '.join(unknown)}: check the spelling against "
                f"llamagym.plugin_runtime.hookspecs; {disable_hint(name)}"
            )
            return False
        if name in self._distributions:
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) could not be "
                f"registered: the name is taken by the plugin of distribution "
                f"{self._distributions[name][0] or 'unknown'}; {disable_hint(name)}"
            )
            return False
        twice = [known for known, original in self._originals.items() if original is plugin]
        if twice:
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) could not be "
                f"registered: the same object is registered as plugin {twice[0]!r}"
            )
            return False
        self._distributions[name] = (distribution, version)
        try:
            self.manager.register(self._isolation.stand_in(plugin, name), name=name)
        except Exception as error:
            del self._distributions[name]
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) could not be "
                f"registered: {error}; {disable_hint(name)}"
            )
            return False
        self._originals[name] = plugin
        self._order[name] = next(self._counter)
        self._forget_registrations()
        return True

    def unregister(self, name: str) -> None:
        self.manager.unregister(name=name)
        self._distributions.pop(name, None)
        self._originals.pop(name, None)
        # A plugin registered later under that name is asked again.
        self._isolation.not_answering.discard(name)
        self._forget_registrations()

    def _problem(self, message: str) -> None:
        if message in self.problems:
            return
        self.problems.append(message)
        logger.warning(message)

    # -- who took part --------------------------------------------------------------
    def _registered_by(self, agent: Any) -> str | None:
        """The plugin that registered ``agent``'s class, if one did (an agent subclassed
        in a script was registered by none). Asked on every answer an agent's method
        gives, so the agents' entry points are looked up once per registry."""
        if self._agent_plugins is None:
            agents = self.registry.agents().values()
            self._agent_plugins = {spec.entry_point: spec.plugin for spec in agents if spec.plugin}
        cls = type(agent)
        return self._agent_plugins.get(f"{cls.__module__}:{cls.__qualname__}")

    def participants(self) -> list[dict[str, Any]]:
        """Every plugin that answered a per-step hook (not ``None``) in this process since
        start or :meth:`reset_participants`: name, distribution, version and hooks."""
        return self._isolation.participants()

    def reset_participants(self) -> None:
        self._isolation.reset_participants()

    # -- the registry ----------------------------------------------------------------
    def _forget_registrations(self) -> None:
        """Drop what the plugins registered; it is collected again on the next read."""
        self._registry = Registry(self._problem)
        self._specs_collected = False
        self._models_collected = False
        self._agent_plugins = None

    def _collect(self, hook_name: str, spec_class: type[Spec]) -> None:
        """Call a registration hook and add what each plugin registered, in the order
        the plugins were registered (built-ins first)."""
        pending: list[tuple[str, Spec, bool]] = []
        open_ = [True]

        def register(*args: Any, **kwargs: Any) -> None:
            plugin = answering_plugin() or "unknown"
            if plugin in self._isolation.not_answering:
                return  # too late: the plugin was reported as not answering
            try:
                if not open_[0]:
                    raise TypeError(f"called after {hook_name} returned")
                spec, override = _registration(spec_class, args, kwargs)
            except (TypeError, ValueError) as error:
                distribution = self._isolation.distribution_of(plugin)
                self._problem(
                    f"plugin {plugin!r} (distribution {distribution}) made a registration "
                    f"in {hook_name} that cannot be used, {_call_text(args, kwargs)}: "
                    f"{error}; {disable_hint(plugin)}"
                )
                return
            pending.append((plugin, spec, override))

        with plugin_output_to_stderr():
            getattr(self.manager.hook, hook_name)(register=register)
        open_[0] = False
        late = self._isolation.not_answering
        pending = [item for item in pending if item[0] not in late]
        pending.sort(key=lambda item: self._order.get(item[0], float("inf")))
        for plugin, spec, override in pending:
            distribution = self._distributions.get(plugin, ("", ""))[0]
            self._registry.add(spec, plugin=plugin, distribution=distribution, override=override)

    @property
    def registry(self) -> Registry:
        """What the plugins registered, agents, algorithms and models, in one
        :class:`~llamagym.plugin_runtime.registry.Registry` (``registry.agents()``,
        ``registry.get("agent", name)``, ``registry.model(name)``, ...): collected from
        the registration hooks on first use, and again after a plugin is registered or
        unregistered."""
        with self._lock:
            if not self._specs_collected:
                self._specs_collected = True
                self._collect("llamagym_register_agents", AgentSpec)
                self._collect("llamagym_register_algorithms", AlgorithmSpec)
        self.register_models()
        return self._registry

    def register_models(self) -> None:
        """Let plugins add model registry entries (once, until a plugin is registered or
        unregistered)."""
        with self._lock:
            if self._models_collected:
                return
            self._models_collected = True
            self._collect("llamagym_register_models", ModelEntry)
            for entry, overwrite in self._own_models:
                try:
                    self._registry.add(
                        entry, plugin="", distribution="", override=overwrite, strict=True
                    )
                except ValueError as error:
                    self._problem(f"{error}; the entry of register_model_entry() is skipped")

    def add_model(self, entry: ModelEntry, *, overwrite: bool = False) -> None:
        """Add a model entry from Python code; a clash raises ``ValueError`` unless
        ``overwrite``. See :func:`llamagym.models.registry.register_model_entry`."""
        if not isinstance(entry, ModelEntry):
            raise TypeError(f"expected a ModelEntry, got {type(entry).__name__}")
        self.register_models()
        with self._lock:
            self._registry.add(
                entry, plugin="", distribution="", override=overwrite, strict=True
            )
            # Kept to add again when the registry is collected anew; what this entry
            # replaced is not.
            kept = self._registry.models()
            self._own_models = [
                (own, flag) for own, flag in self._own_models if own in kept and own != entry
            ] + [(entry, overwrite)]

    def __getattr__(self, name: str) -> Any:
        """A method that went to :attr:`registry` (:data:`MOVED_METHODS`) still works
        through 0.5, with a DeprecationWarning naming its place."""
        if name in MOVED_METHODS:
            warnings.warn(f"Plugins.{name} is Plugins.{MOVED_METHODS[name]} since LlamaGym "
                          "0.5, and the old name goes in 0.6", DeprecationWarning, stacklevel=2)
            return getattr(self.registry, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def plugin_infos(self) -> list[PluginInfo]:
        infos = []
        for name, stand_in in self.manager.list_name_plugin():
            distribution, version = self._distributions.get(name, ("", ""))
            hooks = sorted(
                caller.name for caller in self.manager.get_hookcallers(stand_in) or []
            )
            plugin = self._originals.get(name, stand_in)
            module = sys.modules.get(getattr(plugin, "__module__", None) or "") or plugin
            location = getattr(module, "__file__", None) or ""
            infos.append(PluginInfo(name, distribution, version, hooks, location))
        return infos

    # -- typed facades over the hooks ----------------------------------------------
    def register_envs(self) -> None:
        if self._envs_registered:
            return
        import gymnasium

        def register(id: str, entry_point: Any, **kwargs: Any) -> None:
            if answering_plugin() in self._isolation.not_answering:
                return  # too late: the plugin was reported as not answering
            if id not in gymnasium.registry:
                gymnasium.register(id=id, entry_point=entry_point, **kwargs)

        with plugin_output_to_stderr():
            self.manager.hook.llamagym_register_envs(register=register)
        self._envs_registered = True

    def register_commands(self, cli: Any) -> None:
        with plugin_output_to_stderr():
            self.manager.hook.llamagym_register_commands(cli=cli)

    # Per-step hooks get read-only views (read_only), and each plugin's answer is
    # checked as it comes (isolation.py); what follows guards against hook wrappers.
    def system_prompt(self, agent: Any) -> str:
        text = self.manager.hook.llamagym_system_prompt(agent=agent)
        return text if isinstance(text, str) else ""

    def format_observation(self, agent: Any, observation: Any, info: Mapping[str, Any]) -> str:
        text = self.manager.hook.llamagym_format_observation(
            agent=agent, observation=read_only(observation), info=read_only(info)
        )
        return text if isinstance(text, str) else ""

    def extract_action(self, agent: Any, reply: str, legal_actions: Sequence[str]) -> int | None:
        """The index of the legal action a reply names, or ``None``: what the first
        parser with a usable answer said (see :func:`action_index_of`). Every parser
        sees the same tuple of names, which none can change."""
        return self.read_reply(agent, reply, legal_actions)[0]

    def read_reply(
        self, agent: Any, reply: str, legal_actions: Sequence[str]
    ) -> tuple[int | None, str | None]:
        """:meth:`extract_action`, and what found the action: a plugin's name, or the
        name of the task's own parser (:attr:`llamagym.Task.reply_parsers`) when the
        task's parsers answered; ``(None, None)`` when nothing found a legal action.
        The rollout asks through :meth:`llamagym.Task.read_reply`."""
        names = tuple(legal_actions)
        last_answer = self._isolation.last_answer
        last_answer.pop("llamagym_extract_action", None)
        agent_plugin.forget_own_parser()
        with legal_actions_of_call(names):
            answer = self.manager.hook.llamagym_extract_action(
                agent=agent, reply=reply, legal_actions=names
            )
        # Whatever answered, env.step never sees an illegal action.
        try:
            index = action_index_of(answer, names)
        except RefusedAnswer:
            return None, None
        if index is None:
            return None, None
        answered = last_answer.get("llamagym_extract_action")
        if answered == AGENT_METHODS:
            answered = agent_plugin.own_parser() or answered
        return index, answered

    def agent_method_failed(self, agent: Any, method: str, error: Exception) -> None:
        """Report, once per agent class and method, that a task's own method raised
        where the run goes on without its answer (:meth:`Isolation.method_failed`)."""
        self._isolation.method_failed(agent, method, error)

    def shape_reward(
        self, agent: Any, observation: Any, action: str, reward: float, info: Mapping[str, Any]
    ) -> float:
        terms = self.manager.hook.llamagym_shape_reward(
            agent=agent,
            observation=read_only(observation),
            action=action,
            reward=reward,
            info=read_only(info),
        )
        total = 0.0
        for term in terms if isinstance(terms, list) else ():
            with contextlib.suppress(RefusedAnswer):
                total += reward_term(term) or 0.0
        if not math.isfinite(total):
            # Finite terms can still overflow together; a run must never see inf.
            if not self._overflow_reported:
                self._overflow_reported = True
                self._problem(
                    "the llamagym_shape_reward terms of the installed plugins add up to "
                    f"{total}; such a step gets no shaping (reported once); keep shaping "
                    "terms to the scale of the env's rewards"
                )
            return 0.0
        return total

    def episode_end(self, agent: Any, episode: Any, run: RunContext | None = None) -> None:
        self.manager.hook.llamagym_episode_end(
            agent=agent, episode=episode, run=NO_RUN if run is None else run
        )

    def update_end(
        self,
        agent: Any,
        update: int,
        metrics: dict[str, float],
        run: RunContext | None = None,
    ) -> None:
        self.manager.hook.llamagym_update_end(
            agent=agent,
            update=update,
            metrics=read_only(metrics),
            run=NO_RUN if run is None else run,
        )


_plugins: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide plugin runtime, loaded on first use."""
    global _plugins
    if _plugins is None:
        _plugins = Plugins()
    return _plugins


def reset_plugins() -> None:
    """Forget the loaded plugins (tests, or after changing the env variables)."""
    global _plugins
    _plugins = None


__all__ = [
    "ENTRY_POINT_GROUP",
    "MOVED_METHODS",
    "PluginInfo",
    "Plugins",
    "get_plugins",
    "plugin_output_to_stderr",
    "reset_plugins",
]


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
