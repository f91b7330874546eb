"""What a per-step hook is handed, and what it may answer.

* Per-step hooks receive read-only views (:func:`read_only`): the legal actions as a
  tuple, ``info`` and ``metrics`` as read-only mappings, arrays as read-only views, so
  no plugin changes what another plugin, the engine or the env sees.
* Each answer is checked before it is used (:func:`checked_answer`): an action must be
  an index or a name of the legal actions (:func:`action_index_of`), a prompt or an
  observation text a string, a reward term a finite number (:func:`reward_term`).
  An answer that is none of these raises :class:`RefusedAnswer`, saying why;
  :mod:`llamagym.plugin_runtime.isolation` reports it once per plugin and counts it as ``None``,
  so the next plugin is asked.

Only the standard library is imported: these rules are pure functions of the answer.
"""

from __future__ import annotations

import math
import numbers
import reprlib
import sys
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

_READ_ONLY_DEPTH = 8
EXTRACT_ACTION = "llamagym_extract_action"
SHAPE_REWARD = "llamagym_shape_reward"


class RefusedAnswer(ValueError):
    """A per-step hook answered with something that cannot be used; says why."""


def action_index_of(value: Any, legal_actions: Sequence[str]) -> int | None:
    """The index into ``legal_actions`` that an action answer names.

    ``None`` stays ``None`` (no answer). Accepted: an integer (Python or numpy) in range,
    an integral float (``1.0``), or an action name (case-insensitive, surrounding
    whitespace ignored). Anything else (a bool, ``1.5``, an index out of range, an
    unknown name, another type) raises :class:`RefusedAnswer` saying why. The one rule
    for what ``llamagym_extract_action`` may return, and for what an agent's
    ``extract_action`` may return (:meth:`llamagym.Agent.action_index`).
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise RefusedAnswer("a bool is not an action index")
    if isinstance(value, str):
        wanted = value.strip().lower()
        for index, name in enumerate(legal_actions):
            if name.lower() == wanted:
                return index
        raise RefusedAnswer("not the name of a legal action")
    if isinstance(value, numbers.Integral):
        index = int(value)
    elif isinstance(value, numbers.Real):
        number = float(value)
        if not math.isfinite(number) or not number.is_integer():
            raise RefusedAnswer("not a whole number")
        index = int(number)
    else:
        raise RefusedAnswer("neither an index nor an action name")
    if not 0 <= index < len(legal_actions):
        raise RefusedAnswer(f"out of range for {len(legal_actions)} legal actions")
    return index


def reward_term(value: Any) -> float | None:
    """A reward-shaping answer as a float: ``None`` stays ``None``; a finite real number
    (not a bool) is accepted; anything else raises :class:`RefusedAnswer`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RefusedAnswer("not a real number")
    term = float(value)
    if not math.isfinite(term):
        raise RefusedAnswer("not finite")
    return term


def _text_answer(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise RefusedAnswer("not a str")


def read_only(value: Any, _depth: int = 0) -> Any:
    """A view of ``value`` that a hook cannot change: mappings become read-only
    mappings, lists and tuples tuples, sets frozensets, numpy arrays read-only views,
    each nested value likewise (to a depth of 8); other objects are handed as they are.
    Nothing is copied that is already immutable."""
    if value is None or isinstance(value, (str, bytes, int, float, complex)):
        return value
    if _depth >= _READ_ONLY_DEPTH:
        return value
    depth = _depth + 1
    if isinstance(value, Mapping):
        return MappingProxyType({key: read_only(item, depth) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        items = [read_only(item, depth) for item in value]
        if isinstance(value, tuple) and all(a is b for a, b in zip(items, value, strict=True)):
            return value  # already immutable all the way down (a namedtuple keeps its type)
        make = getattr(type(value), "_make", None) if isinstance(value, tuple) else None
        return tuple(items) if make is None else make(items)
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    if isinstance(value, bytearray):
        return bytes(value)
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        view = value.view()
        view.flags.writeable = False
        return view
    return value


# What each per-step hook's answer must be; a refused one counts as None.
_ANSWER_CHECKS: dict[str, Callable[[Any, Sequence[str] | None], Any]] = {
    "llamagym_system_prompt": lambda value, legal: _text_answer(value),
    "llamagym_format_observation": lambda value, legal: _text_answer(value),
    SHAPE_REWARD: lambda value, legal: reward_term(value),
}


def checked_answer(hook_name: str, value: Any, legal: Sequence[str] | None) -> Any:
    """``value`` as the hook's callers use it, or :class:`RefusedAnswer`. ``legal``:
    the legal actions of the ``llamagym_extract_action`` call, if that is the hook."""
    if hook_name == EXTRACT_ACTION:
        if legal is None:  # called outside Plugins.extract_action: the caller checks
            return value
        return action_index_of(value, legal)
    check = _ANSWER_CHECKS.get(hook_name)
    return value if check is None else check(value, legal)


def expected_answer(hook_name: str, legal: Sequence[str] | None) -> tuple[str, str]:
    """For a refused answer's report: what the hook should have answered, and what
    happens instead."""
    if hook_name == EXTRACT_ACTION:
        shown = reprlib.repr(tuple(legal or ()))
        return (
            f"an index into or a name of the legal actions {shown}",
            "the next parser is asked",
        )
    if hook_name == SHAPE_REWARD:
        return "a finite number or None", "it counts as None"
    return "a str or None", "the next plugin is asked"


__all__ = [
    "RefusedAnswer",
    "action_index_of",
    "checked_answer",
    "expected_answer",
    "read_only",
    "reward_term",
]
