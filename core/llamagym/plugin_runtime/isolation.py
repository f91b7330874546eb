"""What pluggy holds in place of each plugin: a stand-in whose hook functions call the
plugin's own, so that no plugin's failure or answer can end or corrupt a run.

:meth:`Isolation.stand_in` marks each of the stand-in's functions with the plugin's own
``@hookimpl`` options, so pluggy calls them the way it would call the plugin's:
``tryfirst`` / ``trylast`` and hook wrappers apply. The stand-in's functions:

* survive the plugin's exceptions: a plugin that raises inside a hook is reported once
  per hook (by name and distribution) and its answer counts as ``None``;
* check each per-step answer (:mod:`llamagym.plugin_runtime.hook_values`): one that
  cannot be used is reported once per plugin and hook and counts as ``None``, so the next
  plugin is asked; a hook wrapper that replaces a first-result hook's answer with one that
  cannot be used is reported, and the call's outcome passes through unchanged;
* run each registration hook in a worker thread with a time limit
  (``LLAMAGYM_PLUGIN_TIMEOUT`` seconds, default 5; ``0``: none): a plugin that does not
  answer in time is reported and skipped from then on;
* record which plugin's answer was taken (:meth:`Isolation.participants`), so the run
  directory says which plugins took part.

Reports go to the one ``report`` callback :class:`~llamagym.plugin_runtime.manager.Plugins`
hands in: its list of problems.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import os
import reprlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import pluggy

from llamagym.config import MAX_WAIT_SECONDS
from llamagym.display import clipped
from llamagym.plugin_runtime import hookspecs
from llamagym.plugin_runtime.hook_values import RefusedAnswer, checked_answer, expected_answer
from llamagym.plugin_runtime.registry import disable_hint

#: Hooks called once to fill the registry; each plugin's call has a time limit.
REGISTRATION_HOOKS: tuple[str, ...] = (
    "llamagym_register_agents",
    "llamagym_register_algorithms",
    "llamagym_register_envs",
    "llamagym_register_models",
    "llamagym_register_commands",
)
TIMEOUT_VARIABLE = "LLAMAGYM_PLUGIN_TIMEOUT"
DEFAULT_TIMEOUT_SECONDS = 5.0
#: The built-in plugin through which an Agent's own methods answer the per-step hooks.
AGENT_METHODS = "agent"

# The plugin whose hook implementation is running: registration callbacks credit it.
_answering: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "llamagym_answering", default=None
)
# The legal actions of the extract_action call in progress, as handed to the plugins.
_legal_actions: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar(
    "llamagym_legal_actions", default=None
)


def answering_plugin() -> str | None:
    """The plugin whose hook implementation is running in this context, if any."""
    return _answering.get()


@contextlib.contextmanager
def legal_actions_of_call(names: tuple[str, ...]) -> Iterator[None]:
    """While an ``llamagym_extract_action`` call runs: the legal actions handed to the
    plugins, against which each plugin's answer is checked."""
    token = _legal_actions.set(names)
    try:
        yield
    finally:
        _legal_actions.reset(token)


def timeout_from_env() -> tuple[float | None, str | None]:
    """Seconds each registration hook may take (``None``: no limit), and a problem
    line when the variable is not a number."""
    text = os.environ.get(TIMEOUT_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_SECONDS, None
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds <= MAX_WAIT_SECONDS:
        return DEFAULT_TIMEOUT_SECONDS, (
            f"{TIMEOUT_VARIABLE}={clipped(text, 40)} is not a number of seconds from 0 (no "
            f"limit) to {MAX_WAIT_SECONDS:,} (a week); {DEFAULT_TIMEOUT_SECONDS:g} is used"
        )
    return (seconds or None), None


def _named(argnames: Sequence[str], args: tuple) -> dict[str, Any]:
    """The arguments pluggy passed to an implementation, by name."""
    return dict(zip(argnames, args, strict=False))


class _Isolated:
    """What pluggy holds in place of a plugin: its hook functions, each isolated."""

    def __init__(self, plugin: Any):
        self._llamagym_plugin = plugin

    def __repr__(self) -> str:
        return f"<isolated {self._llamagym_plugin!r}>"


class Isolation:
    """The stand-ins of one plugin runtime, and what they report and record.

    ``distributions`` maps each plugin's name to its ``(distribution, version)``, and is
    read as the runtime changes it; ``registered_by`` names the plugin that registered an
    agent's class (its methods' answers are credited to that plugin), or ``None``.
    """

    def __init__(
        self,
        manager: pluggy.PluginManager,
        report: Callable[[str], None],
        distributions: Mapping[str, tuple[str, str]],
        registered_by: Callable[[Any], str | None],
    ):
        self._manager = manager
        self._report = report
        self._distributions = distributions
        self._registered_by = registered_by
        self.registration_timeout, timeout_problem = timeout_from_env()
        if timeout_problem is not None:
            report(timeout_problem)
        #: plugins that did not answer a registration hook in time: never asked again
        self.not_answering: set[str] = set()
        #: hook name -> the plugin whose answer was taken last (per-step hooks)
        self.last_answer: dict[str, str] = {}
        self._failed_hooks: set[str] = set()
        self._refused_answers: set[str] = set()
        self._participants: dict[str, tuple[str, str, set[str]]] = {}

    def distribution_of(self, plugin_name: str) -> str:
        """The distribution that installed ``plugin_name``, for a message; "unknown"."""
        return self._distributions.get(plugin_name, ("", ""))[0] or "unknown"

    # -- the stand-in --------------------------------------------------------------
    def stand_in(self, plugin: Any, name: str) -> _Isolated:
        """A stand-in for ``plugin`` whose hook functions, marked with the same
        ``@hookimpl`` options, call the plugin's and survive its exceptions."""
        stand_in = _Isolated(plugin)
        for attr in dir(plugin):
            options = self._manager.parse_hookimpl_opts(plugin, attr)
            if options is None:
                continue
            function = getattr(plugin, attr)
            hook_name = options.get("specname") or attr
            # The names pluggy passes, in order: the positional arguments we receive.
            argnames = pluggy.HookImpl(plugin, name, function, options).argnames
            if options.get("wrapper") or options.get("hookwrapper"):
                isolated = self._isolated_wrapper(function, name, hook_name, argnames)
            elif hook_name in REGISTRATION_HOOKS:
                isolated = self._timed_call(function, name, hook_name)
            else:
                isolated = self._isolated_call(function, name, hook_name, argnames)
            setattr(stand_in, attr, hookspecs.hookimpl(**options)(isolated))
        return stand_in

    def _isolated_call(
        self,
        function: Callable[..., Any],
        plugin_name: str,
        hook_name: str,
        argnames: Sequence[str] = (),
    ) -> Callable[..., Any]:
        failed, answered, checked = self._hook_failed, self._answered, self._checked
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
                named = _named(argnames, args)
                result = checked(plugin_name, hook_name, result, named)
                if result is not None:
                    answered(plugin_name, hook_name, named.get("agent"))
            return result

        return isolated

    def _timed_call(
        self, function: Callable[..., Any], plugin_name: str, hook_name: str
    ) -> Callable[..., Any]:
        """A registration hook of one plugin, run in a worker thread that is waited for
        ``registration_timeout`` seconds at most; a plugin that has not answered by then
        is reported and not asked again (what it registers later is ignored)."""

        @functools.wraps(function)
        def isolated(*args: Any, **kwargs: Any) -> Any:
            if plugin_name in self.not_answering:
                return None
            limit = self.registration_timeout
            outcome: dict[str, Any] = {}

            def call() -> None:
                token = _answering.set(plugin_name)
                try:
                    outcome["result"] = function(*args, **kwargs)
                except BaseException as error:  # handed to the calling thread
                    outcome["error"] = error
                finally:
                    _answering.reset(token)

            if limit is None:
                call()
            else:
                worker = threading.Thread(
                    target=call, name=f"llamagym plugin {plugin_name}", daemon=True
                )
                worker.start()
                worker.join(limit)
                if worker.is_alive():
                    self._not_answering_in_time(plugin_name, hook_name, limit)
                    return None
            error = outcome.get("error")
            if error is None:
                return outcome.get("result")
            if not isinstance(error, Exception):
                raise error  # KeyboardInterrupt, SystemExit
            self._hook_failed(plugin_name, hook_name, error)
            return None

        return isolated

    def _isolated_wrapper(
        self,
        function: Callable[..., Any],
        plugin_name: str,
        hook_name: str,
        argnames: Sequence[str] = (),
    ) -> Callable[..., Any]:
        """A generator that drives the plugin's wrapper (either style). A wrapper that
        raises, or replaces the answer of a first-result hook with one that cannot be
        used, is reported and the call's outcome passes through unchanged."""
        failed = self._hook_failed
        # shape_reward's outcome is the list of every plugin's term: checked by the caller.
        checks = hook_name in hookspecs.PER_STEP_HOOKS and hook_name != "llamagym_shape_reward"

        def check(value: Any, unchanged: Any, args: tuple) -> Any:
            if not checks or value is None or value is unchanged:
                return value
            answer = self._checked(plugin_name, hook_name, value, _named(argnames, args))
            return unchanged if answer is None else answer

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
            old_style = isinstance(outcome, pluggy.Result)
            before = outcome.get_result() if old_style and outcome.exception is None else None
            try:
                inner.send(outcome)
            except StopIteration as stop:
                if not old_style:
                    return check(stop.value, outcome, args)
                if outcome.exception is None:  # the wrapper may have forced a result
                    after = outcome.get_result()
                    if after is not before:
                        outcome.force_result(check(after, before, args))
                return stop.value
            except Exception as error:
                failed(plugin_name, hook_name, error)
                return outcome
            inner.close()
            failed(plugin_name, hook_name, RuntimeError("the wrapper yielded twice"))
            return outcome

        return isolated

    # -- what the stand-ins report ---------------------------------------------------
    def _hook_failed(self, plugin_name: str, hook_name: str, error: Exception) -> None:
        """Report, once per plugin and hook, that a plugin raised inside a hook."""
        key = f"{plugin_name}:{hook_name}"
        if key in self._failed_hooks:
            return
        self._failed_hooks.add(key)
        distribution = self.distribution_of(plugin_name)
        self._report(
            f"plugin {plugin_name!r} (distribution {distribution}) raised in {hook_name}: "
            f"{type(error).__name__}: {error}; its answer is skipped; "
            f"{disable_hint(plugin_name)}"
        )

    def method_failed(self, agent: Any, method: str, error: Exception) -> None:
        """Report, once per agent class and method, that a task's own method raised
        where the run goes on without its answer (its ``extract_action``: the next of
        its parsers reads the reply)."""
        cls = type(agent)
        key = f"{cls.__module__}.{cls.__qualname__}.{method}"
        if key in self._failed_hooks:
            return
        self._failed_hooks.add(key)
        self._report(
            f"{cls.__name__}.{method} raised {type(error).__name__}: "
            f"{clipped(str(error), 200)}; its answer is skipped and the next parser "
            f"reads the reply (reported once)"
        )

    def _not_answering_in_time(self, plugin_name: str, hook_name: str, limit: float) -> None:
        self.not_answering.add(plugin_name)
        distribution = self.distribution_of(plugin_name)
        self._report(
            f"plugin {plugin_name!r} (distribution {distribution}) did not answer "
            f"{hook_name} within {limit:g} s and is skipped ({TIMEOUT_VARIABLE} sets the "
            f"limit); {disable_hint(plugin_name)}"
        )

    def _checked(
        self, plugin_name: str, hook_name: str, value: Any, given: Mapping[str, Any]
    ) -> Any:
        """A plugin's per-step answer as its callers use it; one that cannot be used is
        reported once per plugin and hook, and counts as ``None``."""
        legal = _legal_actions.get()
        if legal is None:
            legal = given.get("legal_actions")
        try:
            return checked_answer(hook_name, value, legal)
        except RefusedAnswer as refusal:
            self._answer_refused(plugin_name, hook_name, value, refusal, legal)
            return None

    def _answer_refused(
        self,
        plugin_name: str,
        hook_name: str,
        value: Any,
        refusal: RefusedAnswer,
        legal: Sequence[str] | None,
    ) -> None:
        key = f"{plugin_name}:{hook_name}"
        if key in self._refused_answers:
            return
        self._refused_answers.add(key)
        distribution = self.distribution_of(plugin_name)
        wanted, after = expected_answer(hook_name, legal)
        self._report(
            f"plugin {plugin_name!r} (distribution {distribution}) returned "
            f"{reprlib.repr(value)} ({type(value).__name__}) from {hook_name}: {refusal}; "
            f"expected {wanted}; its answer is skipped and {after} (reported once); "
            f"{disable_hint(plugin_name)}"
        )

    # -- who took part --------------------------------------------------------------
    def _answered(self, plugin_name: str, hook_name: str, agent: Any = None) -> None:
        self.last_answer[hook_name] = plugin_name
        if plugin_name == AGENT_METHODS and agent is not None:
            # The agent's own methods answered: credit the plugin that registered it.
            plugin_name = self._registered_by(agent) or plugin_name
        record = self._participants.get(plugin_name)
        if record is None:
            distribution, version = self._distributions.get(plugin_name, ("", ""))
            record = self._participants[plugin_name] = (distribution, version, set())
        record[2].add(hook_name)

    def participants(self) -> list[dict[str, Any]]:
        """Every plugin that answered a per-step hook (not ``None``) since this runtime
        started or :meth:`reset_participants`: name, distribution, version and hooks."""
        return [
            {"name": name, "distribution": distribution, "version": version,
             "hooks": sorted(hooks)}
            for name, (distribution, version, hooks) in sorted(self._participants.items())
        ]

    def reset_participants(self) -> None:
        self._participants = {}


__all__ = [
    "AGENT_METHODS",
    "DEFAULT_TIMEOUT_SECONDS",
    "REGISTRATION_HOOKS",
    "TIMEOUT_VARIABLE",
    "Isolation",
    "answering_plugin",
    "legal_actions_of_call",
    "timeout_from_env",
]
