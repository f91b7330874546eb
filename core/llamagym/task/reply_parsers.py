"""The parsers a task reads a reply with (:attr:`llamagym.Task.reply_parsers`): JSON,
the agent's own ``extract_action``, then a regex over the action names.

So a reply is read as ``{"action": ...}`` if it holds one, then the way the agent says,
then by looking for an action name. Each parser is ``(reply, legal_actions) -> index``
and returns only legal indices, or ``None``; :data:`PARSERS` names them.

Work is bounded, whatever the reply: each parser reads at most ``MAX_CHARS`` characters
of it. The JSON parser looks for candidate objects itself: from at most ``MAX_STARTS``
opening braces, stepping over at most ``MAX_SCAN`` characters in all, giving up on a
candidate nested deeper than ``MAX_DEPTH``; only a balanced candidate reaches
``json.loads``, at most ``MAX_ATTEMPTS`` times, and at most ``MAX_OBJECTS`` objects are
read. The regex parser collapses whitespace first, so its patterns are plain words that
never backtrack over a run of spaces. ``python benchmarks/parsers.py`` measures the
worst reply it knows.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MAX_CHARS = 8192  # characters of a reply each parser reads
MAX_OBJECTS = 8  # JSON values read from one reply
MAX_ATTEMPTS = 32  # json.loads calls for one reply
MAX_DEPTH = 16  # nesting of objects and arrays a candidate may have
MAX_SCAN = 2 * MAX_CHARS  # characters the candidate search steps over for one reply
MAX_STARTS = 256  # places where an object might open that are looked at, per reply
ACTION_KEYS = ("action", "command")

# What a candidate object is scanned for: a whole JSON string (linear: the loop's two
# parts never match the same character), a bracket, or a quote whose string does not end.
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[{}\[\]]|"', re.DOTALL)


def _normal(text: str) -> str:
    """Lower case, runs of whitespace as one space, none at the ends."""
    return " ".join(text.split()).lower()


def resolve(value: Any, legal_actions: Sequence[str]) -> int | None:
    """An action index for a parsed value: an in-range integer or a legal name."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    if isinstance(value, int):
        return value if 0 <= value < len(legal_actions) else None
    if isinstance(value, str):
        wanted = _normal(value[:MAX_CHARS])
        for index, name in enumerate(legal_actions):
            if _normal(name) == wanted:
                return index
        if wanted.isascii() and wanted.isdigit() and len(wanted) < 6:  # not "²" or "٣"
            return resolve(int(wanted), legal_actions)
    return None


@dataclass
class ScanWork:
    """What reading one reply's JSON cost: opening braces looked at (never more than
    ``MAX_STARTS``), characters stepped over from them (never more than ``MAX_SCAN``)
    and ``json.loads`` calls (never more than ``MAX_ATTEMPTS``)."""

    starts: int = 0
    scanned: int = 0
    attempts: int = 0

    def left(self) -> bool:
        return (
            self.starts < MAX_STARTS
            and self.scanned < MAX_SCAN
            and self.attempts < MAX_ATTEMPTS
        )


def _candidate_end(text: str, start: int, stop: int) -> tuple[int | None, int]:
    """Where the object opening at ``text[start]`` closes (exclusive), or ``None`` when
    it does not close before ``stop`` or nests deeper than ``MAX_DEPTH``; and how far
    the scan went."""
    depth = 0
    for found in _TOKENS.finditer(text, start, stop):
        token = found.group()
        if token[0] == '"':
            if len(token) == 1:  # the string runs past stop
                return None, stop
            continue
        if token in "{[":
            depth += 1
            if depth > MAX_DEPTH:
                return None, found.end()
        else:
            depth -= 1
            if depth == 0:
                return (found.end() if token == "}" else None), found.end()
    return None, stop


def _first_of_each_key(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's keys with the first value each is given. A reply that names its
    action twice (``{"action": "hit", "action": "stick"}``, which a sampled reply can
    write after its prefix ``{"action": "``) plays the first: the value right after the
    prefix, the token whose probability the policy trains. ``json.loads`` alone keeps
    the last."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        obj.setdefault(key, value)
    return obj


def json_objects(text: str, work: ScanWork | None = None) -> Iterator[dict]:
    """Yield the JSON objects embedded in ``text``, within the bounds above; ``work``
    receives what the search cost."""
    work = ScanWork() if work is None else work
    position, found = 0, 0
    while found < MAX_OBJECTS and work.left():
        start = text.find("{", position)
        if start < 0:
            return
        work.starts += 1
        stop = min(len(text), start + MAX_SCAN - work.scanned)
        end, reached = _candidate_end(text, start, stop)
        work.scanned += reached - start
        if end is None:
            position = start + 1
            continue
        work.attempts += 1
        try:
            value = json.loads(text[start:end], object_pairs_hook=_first_of_each_key)
        except (ValueError, RecursionError):
            position = start + 1
            continue
        found += 1
        if isinstance(value, dict):
            yield value
        position = end


def json_action(reply: str, legal_actions: Sequence[str]) -> int | None:
    """``{"action": 1}``, ``{"action": "hit"}``, ``{"command": "open door"}``: the first
    object whose action key names a legal action."""
    for obj in json_objects(reply[:MAX_CHARS]):
        for key in ACTION_KEYS:
            if key in obj:
                index = resolve(obj[key], legal_actions)
                if index is not None:
                    return index
    return None


@functools.lru_cache(maxsize=256)
def _name_pattern(legal_actions: tuple[str, ...]) -> re.Pattern[str]:
    # Read on normalised text (see _normal): each name is a literal, longest first so
    # "go north" wins over "go"; the lookarounds keep "hit" out of "white".
    names = sorted({_normal(name) for name in legal_actions} - {""}, key=len, reverse=True)
    alternatives = "|".join(map(re.escape, names))
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])")


# "Action: hit", "action=1", and the key of JSON that did not parse or named no legal
# value ('"action": "hit no 2, stick"'): the first word after the label, whole (not the
# 1 of 1.5).
_LABELLED = re.compile(r"""\baction["']? ?[:=] ?["']?([-\w]+)(?![-\w]|\.\d)""")


def named_action(reply: str, legal_actions: Sequence[str]) -> int | None:
    """``Action: 1`` / ``Action: hit`` / ``"action": "hit ...`` (the first word after an
    action label), else the last action name the reply names."""
    text = _normal(reply[-MAX_CHARS:])
    labelled = _LABELLED.search(text)
    if labelled:
        index = resolve(labelled.group(1), legal_actions)
        if index is not None:
            return index
    if not any(name.strip() for name in legal_actions):
        return None
    last = None
    for match in _name_pattern(tuple(legal_actions)).finditer(text):
        last = match
    if last is None:
        return None
    return resolve(last.group(0), legal_actions)


#: The agent's own parser in :attr:`llamagym.Task.reply_parsers`: its ``extract_action``.
OWN = "extract_action"
#: The other parsers a task can name, by name.
PARSERS: dict[str, Callable[[str, Sequence[str]], int | None]] = {
    "json": json_action,
    "regex": named_action,
}
#: What a task reads its replies with unless it says otherwise.
DEFAULT_PARSERS: tuple[str, ...] = ("json", OWN, "regex")
