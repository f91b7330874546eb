"""Showing text that came from outside (a model's reply, an env's observation, a field of
a run file) without letting it act.

A terminal obeys control characters: ESC sequences move the cursor, clear the screen,
set the window title or write the clipboard (OSC 52). :func:`printable` shows each of
them as its Python escape (``\\x1b``), so the text is read, not executed. Markdown obeys
fences, table bars, links and HTML: :func:`code_block` puts text in a fence longer than
any run of backticks it holds, :func:`markdown_line` keeps text on one line and escapes
what would make it a link, an image, HTML or a new table cell, and :func:`table_code`
puts it in a code span that neither ends early nor leaves its cell.
Rich markup is never applied to such text: print it as a ``rich.text.Text``, or put it
through :func:`shown` inside a line that has markup of its own.

Top level: a utility below every floor (it uses the standard library only), since
each floor shows text that came from outside.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rich.markup import escape

#: Kept as they are where text is laid out on several lines.
LAYOUT = "\n\t"

_BACKTICKS = re.compile(r"`+")
_MARKDOWN_SYNTAX = re.compile(r"([\\`\[\]<>|])")


def printable(text: object, keep: str = LAYOUT) -> str:
    """``text`` with every character that is not printable (C0 and C1 controls, DEL, ESC,
    bidirectional overrides, line and paragraph separators...) written as its Python
    escape, except those in ``keep``."""
    text = str(text)
    if text.isprintable() or all(c.isprintable() or c in keep for c in text):
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


class PrintableFormatter(logging.Formatter):
    """Log lines as :func:`printable` text: a warning that quotes an observation, a
    reply, a file or a model name cannot drive the terminal it is printed on. The CLI's
    log handlers format every record through it."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


def shown(text: object) -> str:
    """``text`` on one line for a rich print whose markup is its own: control characters
    escaped, and brackets taken as text, not as markup."""
    return escape(printable(text, keep=""))


def cut(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, marked `` ...`` where it was cut: an env's
    observation kept to the length an agent's option allows."""
    return text if len(text) <= limit else text[:limit].rstrip() + " ..."


def clipped(value: object, width: int = 80) -> str:
    """``repr(value)`` cut to ``width`` characters with its length said, for an error
    line that quotes what was given: a 5,000-character option stays one short line."""
    text = repr(value)
    if len(text) <= width:
        return text
    length = len(value) if isinstance(value, str) else len(text)
    return f"{text[: width - 3]}... ({length:,} characters)"


def code_block(text: str, info: str = "") -> list[str]:
    """``text`` as the lines of a fenced Markdown code block that nothing in it can close:
    the fence is one backtick longer than the longest run of backticks in the text."""
    longest = max((len(run) for run in _BACKTICKS.findall(text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, printable(text), fence]


def markdown_line(text: object) -> str:
    """``text`` for one line of Markdown (a heading, a table cell): control characters
    escaped, and the characters that would start a link or an image, HTML, a code span
    or a new table cell escaped with a backslash."""
    return _MARKDOWN_SYNTAX.sub(r"\\\1", printable(text, keep=""))


def table_code(text: object) -> str:
    """``text`` as a code span in a Markdown table cell: delimited by more backticks than
    any run it holds, its bars escaped (GitHub's tables split cells at a bar even inside
    a code span)."""
    line = printable(text, keep="")
    longest = max((len(run) for run in _BACKTICKS.findall(line)), default=0)
    ticks = "`" * (longest + 1)
    padded = f" {line} " if line.startswith("`") or line.endswith("`") else line
    return ticks + padded.replace("|", "\\|") + ticks


def outcome_names(results: Sequence[Mapping[str, Any]]) -> list[str]:
    """The outcomes the agent names, in its order (the order of the ``outcomes`` dicts)."""
    names: list[str] = []
    for result in results:
        names += [name for name in result.get("outcomes") or {} if name not in names]
    return names


def outcome_shares(result: Mapping[str, Any], names: Sequence[str]) -> str:
    outcomes = result.get("outcomes") or {}
    if not outcomes:
        return "n/a"
    return " / ".join(f"{outcomes.get(name, 0):.1%}" for name in names)
