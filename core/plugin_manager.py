"""Finds plugins through entry points, keeps the agent and algorithm registries, and
wraps pluggy's untyped hook calls in typed functions.

Environment variables (entry-point names, comma separated):

* ``LLAMAGYM_DISABLE_PLUGINS=a,b`` skips those plugins;
* ``LLAMAGYM_LOAD_PLUGINS=a,b`` loads only those third-party plugins; set but empty,
  it loads none but the built-ins (those of the ``llamagym`` distribution).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from llamagym import hookspecs
from llamagym.errors import PluginError, UnknownNameError

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "llamagym"
BUILTIN_DISTRIBUTION = "llamagym"


@dataclass(frozen=True)
class Registration:
    """An agent or algorithm some plugin registered; ``entry_point`` is ``module:Attr``."""

    kind: str
    name: str
    entry_point: str
    description: str = ""
    plugin: str = ""
    distribution: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def load(self) -> Any:
        """Import the registered object, with an error that names the plugin on failure."""
        module_name, _, attribute = self.entry_point.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except Exception as error:  # a broken plugin must not look like our bug
            raise PluginError(
                f"{self.kind} {self.name!r} from plugin {self.plugin!r} "
                f"(distribution {self.distribution or 'unknown'}) failed to load "
                f"{self.entry_point!r}: {type(error).__name__}: {error}"
            ) from error


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


def _disable_hint(name: str) -> str:
    return f"disable it with LLAMAGYM_DISABLE_PLUGINS={name}"


class Plugins:
    """The plugin runtime of one process: a pluggy manager plus typed access to it."""

    def __init__(self, load_entry_points: bool = True):
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self.problems: list[str] = []
        self._failed_hooks: set[str] = set()
        self._distributions: dict[str, tuple[str, str]] = {}
        self._registries: dict[str, dict[str, Registration]] | None = None
        self._envs_registered = False
        self._models_registered = False
        from llamagym import agent_hooks

        self.register(agent_hooks, name="agent", distribution=BUILTIN_DISTRIBUTION)
        if load_entry_points:
            self._load_entry_points()
        self.manager.check_pending()

    # -- loading -----------------------------------------------------------------
    def _load_entry_points(self) -> None:
        disabled = _names_from_env("LLAMAGYM_DISABLE_PLUGINS") or set()
        allowed = _names_from_env("LLAMAGYM_LOAD_PLUGINS")
        seen: set[str] = set()
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = entry_point.dist
            dist_name = dist.metadata["Name"] if dist is not None else "unknown"
            version = dist.version if dist is not None else "unknown"
            name = entry_point.name
            if name in seen or name in disabled:
                continue  # the same distribution can be visible twice on sys.path
            builtin = dist_name == BUILTIN_DISTRIBUTION
            if allowed is not None and not builtin and name not in allowed:
                continue
            seen.add(name)
            try:
                plugin = entry_point.load()
            except Exception as error:
                self._problem(
                    f"plugin {name!r} (distribution {dist_name} {version}) failed to import: "
                    f"{type(error).__name__}: {error}; {_disable_hint(name)}"
                )
                continue
            self.register(plugin, name=name, distribution=dist_name, version=version)

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
                f"llamagym.hookspecs; {_disable_hint(name)}"
            )
            return False
        try:
            self.manager.register(plugin, name=name)
        except Exception as error:
            self._problem(
                f"plugin {name!r} (distribution {distribution or 'unknown'}) could not be "
                f"registered: {error}; {_disable_hint(name)}"
            )
            return False
        self._distributions[name] = (distribution, version)
        self._registries = None
        return True

    def unregister(self, name: str) -> None:
        self.manager.unregister(name=name)
        self._distributions.pop(name, None)
        self._registries = None

    def _problem(self, message: str) -> None:
        self.problems.append(message)
        logger.warning(message)

    # -- registries ----------------------------------------------------------------
    def _collect(self, hook_name: str, kind: str) -> dict[str, Registration]:
        registry: dict[str, Registration] = {}
        caller = getattr(self.manager.hook, hook_name)
        for impl in caller.get_hookimpls():  # registration order
            plugin_name = impl.plugin_name
            distribution = self._distributions.get(plugin_name, ("", ""))[0]

            def register(
                name: str,
                entry_point: str,
                description: str = "",
                *,
                plugin_name: str = plugin_name,
                distribution: str = distribution,
                **extra: Any,
            ) -> None:
                if name in registry:
                    first = registry[name]
                    self._problem(
                        f"{kind} name {name!r} is registered twice: by plugin "
                        f"{first.plugin!r} ({first.distribution}) and by plugin "
                        f"{plugin_name!r} ({distribution}); the first is kept. "
                        f"{_disable_hint(plugin_name)}"
                    )
                    return
                registry[name] = Registration(
                    kind, name, entry_point, description, plugin_name, distribution, extra
                )

            try:
                impl.function(register=register)
            except Exception as error:
                self._hook_failed(plugin_name, hook_name, error)
        return registry

    def _registry(self, kind: str) -> dict[str, Registration]:
        if self._registries is None:
            self._registries = {
                "agent": self._collect("llamagym_register_agents", "agent"),
                "algorithm": self._collect("llamagym_register_algorithms", "algorithm"),
            }
        return self._registries[kind]

    def agents(self) -> dict[str, Registration]:
        return dict(self._registry("agent"))

    def algorithms(self) -> dict[str, Registration]:
        return dict(self._registry("algorithm"))

    def get(self, kind: str, name: str) -> Registration:
        registry = self._registry(kind)
        if name not in registry:
            raise UnknownNameError(kind, name, list(registry))
        return registry[name]

    def plugin_infos(self) -> list[PluginInfo]:
        infos = []
        for name, plugin in self.manager.list_name_plugin():
            distribution, version = self._distributions.get(name, ("", ""))
            hooks = sorted(
                caller.name for caller in self.manager.get_hookcallers(plugin) or []
            )
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

        self._call("llamagym_register_envs", False, register=register)
        self._envs_registered = True

    def register_models(self) -> None:
        """Let plugins add model registry entries (once per process)."""
        if self._models_registered:
            return
        self._models_registered = True
        from llamagym.model_registry import register_model_entry

        self._call("llamagym_register_models", False, register=register_model_entry)

    def register_commands(self, cli: Any) -> None:
        self._call("llamagym_register_commands", False, cli=cli)

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
            f"{_disable_hint(plugin_name)}"
        )

    def _call(self, hook_name: str, first_result: bool, **kwargs: Any) -> Any:
        """Call a hook's implementations in pluggy's order, one at a time, so a plugin
        that raises is reported (once, by name) and skipped instead of ending the run.
        With ``first_result`` the first non-None answer is returned, else all of them."""
        results = []
        for impl in reversed(getattr(self.manager.hook, hook_name).get_hookimpls()):
            if impl.hookwrapper or impl.wrapper:
                continue  # per-step and observer hooks take plain implementations only
            try:
                result = impl.function(**{name: kwargs[name] for name in impl.argnames})
            except Exception as error:
                self._hook_failed(impl.plugin_name, hook_name, error)
                continue
            if result is not None:
                if first_result:
                    return result
                results.append(result)
        return None if first_result else results

    def system_prompt(self, agent: Any) -> str:
        return self._call("llamagym_system_prompt", True, agent=agent) or ""

    def format_observation(self, agent: Any, observation: Any, info: dict) -> str:
        text = self._call(
            "llamagym_format_observation", True, agent=agent, observation=observation, info=info
        )
        return "" if text is None else str(text)

    def extract_action(self, agent: Any, reply: str, legal_actions: Sequence[str]) -> int | None:
        index = self._call(
            "llamagym_extract_action", True, agent=agent, reply=reply, legal_actions=legal_actions
        )
        # A parser that answers with something out of range must never reach env.step.
        legal = isinstance(index, int) and not isinstance(index, bool)
        return index if legal and 0 <= index < len(legal_actions) else None

    def shape_reward(
        self, agent: Any, observation: Any, action: str, reward: float, info: dict
    ) -> float:
        terms = self._call(
            "llamagym_shape_reward",
            False,
            agent=agent,
            observation=observation,
            action=action,
            reward=reward,
            info=info,
        )
        return float(sum(terms))

    def episode_end(self, agent: Any, episode: Any) -> None:
        self._call("llamagym_episode_end", False, agent=agent, episode=episode)

    def update_end(self, agent: Any, update: int, metrics: dict[str, float]) -> None:
        self._call("llamagym_update_end", False, agent=agent, update=update, metrics=metrics)


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

