"""Finds plugins through entry points, keeps the registry of what they register (agents,
algorithms, models: :mod:`llamagym.specs`), and calls pluggy's untyped hooks through
typed functions.

Each plugin is registered with pluggy through a stand-in whose hook functions call the
plugin's own: when one raises, the plugin is reported once (by name and distribution)
and its answer counts as ``None``, so one broken plugin never ends a run. Hooks are then
called the way pluggy calls them, so ``tryfirst`` / ``trylast`` and hook wrappers apply.

Environment variables (entry-point names, comma separated; ``DIST:NAME`` names the entry
point ``NAME`` of distribution ``DIST`` only):

* ``LLAMAGYM_DISABLE_PLUGINS=a,b`` skips those plugins; built-in ones too
  (``json-action``, ``regex-action``, ``algorithms``, ``models``,
  ``tensorboard-logger``, ``wandb-logger``). ``llamagym:json-action`` skips only the
  built-in, so a third-party plugin of that name loads in its place.
* ``LLAMAGYM_LOAD_PLUGINS=a,b`` loads only those third-party plugins; set but empty,
  it loads none but the built-ins (those of the ``llamagym`` distribution).
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.metadata
import itertools
import logging
import os
import reprlib
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import pluggy

from llamagym import __version__, agent_hooks, hookspecs
from llamagym.specs import (
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

# The plugin whose hook implementation is running: registration callbacks credit it.
_answering: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llamagym_answering", default=None
)


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


class _Isolated:
    """What pluggy holds in place of a plugin: its hook functions, each isolated."""

    def __init__(self, plugin: Any):
        self._llamagym_plugin = plugin

    def __repr__(self) -> str:
        return f"<isolated {self._llamagym_plugin!r}>"


class Plugins:
    """The plugin runtime of one process: a pluggy manager, the registry of what the
    plugins registered, and typed access to both."""

    def __init__(self, load_entry_points: bool = True):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.problems: list[str] = []
        self._failed_hooks: set[str] = set()
        self._distributions: dict[str, tuple[str, str]] = {}
        self._originals: dict[str, Any] = {}
        self._order: dict[str, int] = {}
        self._counter = itertools.count()
        self._participants: dict[str, tuple[str, str, set[str]]] = {}
        self._lock = threading.RLock()
        self._own_models: list[tuple[ModelEntry, bool]] = []
        self._forget_registrations()
        self._envs_registered = False
        self.register(
            agent_hooks, name="agent", distribution=BUILTIN_DISTRIBUTION, version=__version__
        )
        if load_entry_points:
            self._load_entry_points()
        self.manager.check_pending()

    # -- loading -----------------------------------------------------------------
    def _load_entry_points(self) -> None:
        disabled = _names_from_env("LLAMAGYM_DISABLE_PLUGINS") or set()
        allowed = _names_from_env("LLAMAGYM_LOAD_PLUGINS")
        found = []
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else "unknown"
            version = dist.version if dist is not None else "unknown"
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
        """Register a plugin object; a misspelt hook is reported and the plugin skipped."""
        unknown = [
            attr
            for attr in dir(plugin)
            if attr.startswith("llamagym_") and attr not in hookspecs.all_hook_names()
        ]
        if unknown:
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) implements "
                f"unknown hook(s) {', '.join(unknown)}: check the spelling against "
                f"llamagym.hookspecs; {disable_hint(name)}"
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
            self.manager.register(self._isolate(plugin, name), name=name)
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
        self._forget_registrations()

    def _problem(self, message: str) -> None:
        if message in self.problems:
            return
        self.problems.append(message)
        logger.warning(message)

    # -- isolation -----------------------------------------------------------------
    def _isolate(self, plugin: Any, name: str) -> _Isolated:
        """A stand-in for ``plugin`` whose hook functions, marked with the same
        ``@hookimpl`` options, call the plugin's and survive its exceptions."""
        stand_in = _Isolated(plugin)
        for attr in dir(plugin):
            options = self.manager.parse_hookimpl_opts(plugin, attr)
            if options is None:
                continue
            function = getattr(plugin, attr)
            hook_name = options.get("specname") or attr
            if options.get("wrapper") or options.get("hookwrapper"):
                isolated = self._isolated_wrapper(function, name, hook_name)
            else:
                isolated = self._isolated_call(function, name, hook_name)
            setattr(stand_in, attr, hookspecs.hookimpl(**options)(isolated))
        return stand_in

    def _isolated_call(
        self, function: Callable[..., Any], plugin_name: str, hook_name: str
    ) -> Callable[..., Any]:
        failed, answered = self._hook_failed, self._answered
        per_step = hook_name in hookspecs.PER_STEP_HOOKS

        @functools.wraps(function)
        def isolated(*args: Any, **kwargs: Any) -> Any:
            token = _answering.set(plugin_name)
            try:
                result = function(*args, **kwargs)
            except Exception as error:
                failed(plugin_name, hook_name, error)
                return None
            finally:
                _answering.reset(token)
            if per_step and result is not None:
                answered(plugin_name, hook_name)
            return result

        return isolated

    def _isolated_wrapper(
        self, function: Callable[..., Any], plugin_name: str, hook_name: str
    ) -> Callable[..., Any]:
        """A generator that drives the plugin's wrapper (either style). A wrapper that
        raises is reported and the call's outcome passes through unchanged."""
        failed = self._hook_failed

        @functools.wraps(function)
        def isolated(*args: Any, **kwargs: Any) -> Any:
            try:
                inner = function(*args, **kwargs)
                next(inner)
            except Exception as error:  # includes a wrapper that never yields
                failed(plugin_name, hook_name, error)
                return (yield)
            try:
                outcome = yield
            except BaseException as error:  # what the implementations raised
                try:
                    inner.throw(error)
                except StopIteration as stop:
                    return stop.value
                inner.close()
                raise
            try:
                inner.send(outcome)
            except StopIteration as stop:
                return stop.value
            except Exception as error:
                failed(plugin_name, hook_name, error)
                return outcome
            inner.close()
            failed(plugin_name, hook_name, RuntimeError("the wrapper yielded twice"))
            return outcome

        return isolated

    def _hook_failed(self, plugin_name: str, hook_name: str, error: Exception) -> None:
        """Report, once per plugin and hook, that a plugin raised inside a hook."""
        key = f"{plugin_name}:{hook_name}"
        if key in self._failed_hooks:
            return
        self._failed_hooks.add(key)
        distribution = self._distributions.get(plugin_name, ("", ""))[0] or "unknown"
        self._problem(
            f"plugin {plugin_name!r} (distribution {distribution}) raised in {hook_name}: "
            f"{type(error).__name__}: {error}; its answer is skipped; "
            f"{disable_hint(plugin_name)}"
        )

    # -- who took part --------------------------------------------------------------
    def _answered(self, plugin_name: str, hook_name: str) -> None:
        record = self._participants.get(plugin_name)
        if record is None:
            distribution, version = self._distributions.get(plugin_name, ("", ""))
            record = self._participants[plugin_name] = (distribution, version, set())
        record[2].add(hook_name)

    def participants(self) -> list[dict[str, Any]]:
        """Every plugin that answered a per-step hook (not ``None``) in this process since
        start or :meth:`reset_participants`: name, distribution, version and hooks."""
        return [
            {"name": name, "distribution": distribution, "version": version,
             "hooks": sorted(hooks)}
            for name, (distribution, version, hooks) in sorted(self._participants.items())
        ]

    def reset_participants(self) -> None:
        self._participants = {}

    # -- the registry ----------------------------------------------------------------
    def _forget_registrations(self) -> None:
        """Drop what the plugins registered; it is collected again on the next read."""
        self.registry = Registry(self._problem)
        self._specs_collected = False
        self._models_collected = False

    def _collect(self, hook_name: str, spec_class: type[Spec]) -> None:
        """Call a registration hook and add what each plugin registered, in the order
        the plugins were registered (built-ins first)."""
        pending: list[tuple[str, Spec, bool]] = []
        open_ = [True]

        def register(*args: Any, **kwargs: Any) -> None:
            plugin = _answering.get() or "unknown"
            try:
                if not open_[0]:
                    raise TypeError(f"called after {hook_name} returned")
                spec, override = _registration(spec_class, args, kwargs)
            except (TypeError, ValueError) as error:
                distribution = self._distributions.get(plugin, ("", ""))[0] or "unknown"
                self._problem(
                    f"plugin {plugin!r} (distribution {distribution}) made a registration "
                    f"in {hook_name} that cannot be used, {_call_text(args, kwargs)}: "
                    f"{error}; {disable_hint(plugin)}"
                )
                return
            pending.append((plugin, spec, override))

        getattr(self.manager.hook, hook_name)(register=register)
        open_[0] = False
        pending.sort(key=lambda item: self._order.get(item[0], float("inf")))
        for plugin, spec, override in pending:
            distribution = self._distributions.get(plugin, ("", ""))[0]
            self.registry.add(spec, plugin=plugin, distribution=distribution, override=override)

    def _specs(self) -> Registry:
        with self._lock:
            if not self._specs_collected:
                self._specs_collected = True
                self._collect("llamagym_register_agents", AgentSpec)
                self._collect("llamagym_register_algorithms", AlgorithmSpec)
            return self.registry

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
                    self.registry.add(
                        entry, plugin="", distribution="", override=overwrite, strict=True
                    )
                except ValueError as error:
                    self._problem(f"{error}; the entry of register_model_entry() is skipped")

    def agents(self) -> dict[str, AgentSpec]:
        return self._specs().agents()

    def algorithms(self) -> dict[str, AlgorithmSpec]:
        return self._specs().algorithms()

    def models(self) -> list[ModelEntry]:
        """Every model entry, the built-ins first."""
        self.register_models()
        return self.registry.models()

    def model(self, name_or_hub_id: str) -> ModelEntry | None:
        """The entry whose short name or Hub id matches (case-insensitive), if any."""
        self.register_models()
        return self.registry.model(name_or_hub_id)

    def add_model(self, entry: ModelEntry, *, overwrite: bool = False) -> None:
        """Add a model entry from Python code; a clash raises ``ValueError`` unless
        ``overwrite``. See :func:`llamagym.models.registry.register_model_entry`."""
        if not isinstance(entry, ModelEntry):
            raise TypeError(f"expected a ModelEntry, got {type(entry).__name__}")
        self.register_models()
        with self._lock:
            self.registry.add(
                entry, plugin="", distribution="", override=overwrite, strict=True
            )
            # Kept to add again when the registry is collected anew; what this entry
            # replaced is not.
            kept = self.registry.models()
            self._own_models = [
                (own, flag) for own, flag in self._own_models if own in kept and own != entry
            ] + [(entry, overwrite)]

    @overload
    def get(self, kind: Literal["agent"], name: str) -> AgentSpec: ...
    @overload
    def get(self, kind: Literal["algorithm"], name: str) -> AlgorithmSpec: ...
    @overload
    def get(self, kind: Literal["model"], name: str) -> ModelEntry: ...
    @overload
    def get(self, kind: str, name: str) -> Spec: ...

    def get(self, kind: str, name: str) -> Spec:
        """The spec of ``kind`` (``agent``, ``algorithm`` or ``model``) called ``name``;
        :class:`~llamagym.errors.UnknownNameError` lists the known ones otherwise."""
        if kind == "model":
            self.register_models()
            return self.registry.get(kind, name)
        return self._specs().get(kind, name)

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
            if id not in gymnasium.registry:
                gymnasium.register(id=id, entry_point=entry_point, **kwargs)

        self.manager.hook.llamagym_register_envs(register=register)
        self._envs_registered = True

    def register_commands(self, cli: Any) -> None:
        self.manager.hook.llamagym_register_commands(cli=cli)

    def system_prompt(self, agent: Any) -> str:
        return self.manager.hook.llamagym_system_prompt(agent=agent) or ""

    def format_observation(self, agent: Any, observation: Any, info: dict) -> str:
        text = self.manager.hook.llamagym_format_observation(
            agent=agent, observation=observation, info=info
        )
        return "" if text is None else str(text)

    def extract_action(self, agent: Any, reply: str, legal_actions: Sequence[str]) -> int | None:
        index = self.manager.hook.llamagym_extract_action(
            agent=agent, reply=reply, legal_actions=legal_actions
        )
        # A parser that answers with something out of range must never reach env.step.
        legal = isinstance(index, int) and not isinstance(index, bool)
        return index if legal and 0 <= index < len(legal_actions) else None

    def shape_reward(
        self, agent: Any, observation: Any, action: str, reward: float, info: dict
    ) -> float:
        terms = self.manager.hook.llamagym_shape_reward(
            agent=agent, observation=observation, action=action, reward=reward, info=info
        )
        return float(sum(terms))

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
            agent=agent, update=update, metrics=metrics, run=NO_RUN if run is None else run
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
    "BUILTIN_DISTRIBUTION",
    "ENTRY_POINT_GROUP",
    "PluginInfo",
    "Plugins",
    "get_plugins",
    "reset_plugins",
]
