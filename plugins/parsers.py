"""The built-in action parsers: JSON first, a regex over the action names last.

The agent's own ``extract_action`` answers between them (normal priority), so a reply
is read as ``{"action": ...}`` if it holds one, then the way the agent says, then by
looking for an action name. Each parser returns only legal indices, or ``None``.
Work is bounded: replies are cut to ``MAX_CHARS`` and only the first ``MAX_OBJECTS``
JSON objects are tried, so a megabyte of garbage costs milliseconds.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Sequence
from typing import Any

from llamagym.hookspecs import hookimpl

MAX_CHARS = 8192
MAX_OBJECTS = 8
ACTION_KEYS = ("action", "command")
_decoder = json.JSONDecoder()


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
        wanted = " ".join(value.split()).lower()
        for index, name in enumerate(legal_actions):
            if name.lower() == wanted:
                return index
        if wanted.isascii() and wanted.isdigit() and len(wanted) < 6:  # not "²" or "٣"
            return resolve(int(wanted), legal_actions)
    return None


def json_objects(text: str):
    """Yield the first few JSON objects embedded in ``text``."""
    position, found = 0, 0
    while found < MAX_OBJECTS:
        position = text.find("{", position)
        if position < 0:
            return
        try:
            value, end = _decoder.raw_decode(text, position)
        except (ValueError, RecursionError):
            position += 1
            continue
        found += 1
        if isinstance(value, dict):
            yield value
        position = end


class JsonParser:
    """First parser: ``{"action": 1}``, ``{"action": "hit"}``, ``{"command": "open door"}``."""

    @hookimpl(tryfirst=True)
    def llamagym_extract_action(
        self, agent: Any, reply: str, legal_actions: Sequence[str]
    ) -> int | None:
        for obj in json_objects(reply[:MAX_CHARS]):
            for key in ACTION_KEYS:
                if key in obj:
                    index = resolve(obj[key], legal_actions)
                    if index is not None:
                        return index
        return None


@functools.lru_cache(maxsize=256)
def _name_pattern(legal_actions: tuple[str, ...]) -> re.Pattern[str]:
    # Longest names first so "go north" wins over "go"; \b keeps "hit" out of "white".
    names = sorted({name for name in legal_actions if name.strip()}, key=len, reverse=True)
    alternatives = "|".join(r"\s+".join(map(re.escape, name.split())) for name in names)
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])", re.IGNORECASE)


_LABELLED = re.compile(r"\baction\s*[:=]\s*([-\w]+)", re.IGNORECASE)


class RegexParser:
    """Fallback parser: ``Action: 1`` / ``Action: hit``, else the last action name named."""

    @hookimpl(trylast=True)
    def llamagym_extract_action(
        self, agent: Any, reply: str, legal_actions: Sequence[str]
    ) -> int | None:
        text = reply[-MAX_CHARS:]
        labelled = _LABELLED.search(text)
        if labelled:
            index = resolve(labelled.group(1), legal_actions)
            if index is not None:
                return index
        if not legal_actions:
            return None
        last = None
        for match in _name_pattern(tuple(legal_actions)).finditer(text):
            last = match
        if last is None:
            return None
        return resolve(last.group(0), legal_actions)


json_parser = JsonParser()
regex_parser = RegexParser()
