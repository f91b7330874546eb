"""Parser chain under hostile replies: seconds per reply, worst and median.

    python benchmarks/parsers.py            # every reply 7 times
    python benchmarks/parsers.py --quick    # every reply twice, fewer sizes

A corpus of pathological replies (JSON that never closes, nests ten thousand deep,
repeats ``{"":``, escapes without end; text that makes a careless regex backtrack over
long whitespace runs; ordinary replies for comparison), each at several sizes up to
1 MB, goes through the whole extraction chain as a run calls it
(``Plugins.extract_action``: the JSON parser, the agent's own ``extract_action``, the
regex parser) for two action sets: Blackjack's two names and 40 text commands that share
words. Per reply the median of the repeats is kept; the result gives the worst and the
median of those over the corpus, the slowest single call, and what the JSON search
cost for the worst reply (characters scanned and ``json.loads`` calls, both bounded).
The target is under 50 ms for the worst reply. Prints JSON and writes
``benchmarks/results/parsers.json`` (``parsers-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/parsers.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_result_arguments,
    log,
    refuse_dirty_tree,
    running_script_command,
    write_result,
)

TARGET_SECONDS = 0.050
SIZES = (1_024, 8_192, 65_536, 1_048_576)
QUICK_SIZES = (8_192, 1_048_576)
REPEATS, QUICK_REPEATS = 7, 2

CARDS = ("stick", "hit")
_ROOMS = ("kitchen", "cellar", "garden", "attic")
_THINGS = ("key", "lamp", "coin", "map")
COMMANDS = tuple(
    ["look", "inventory", "go north", "go south", "go east", "go west"]
    + [f"take {thing} from {room} table" for thing in _THINGS for room in _ROOMS]
    + [f"open {room} door" for room in _ROOMS]
    + [f"put {thing} in {room} chest" for thing in _THINGS for room in _ROOMS[:3]]
    + ["take key", "take lamp"]
)


def _repeat(unit: str) -> Callable[[int], str]:
    return lambda size: (unit * (size // len(unit) + 1))[:size]


def _deep_object(size: int) -> str:
    depth = max(1, (size - 1) // 6)
    return ('{"a":' * depth + "1" + "}" * depth)[:size]


def _padded(prefix: str, filler: str, suffix: str) -> Callable[[int], str]:
    def make(size: int) -> str:
        room = max(0, size - len(prefix) - len(suffix))
        return prefix + (filler * (room // len(filler) + 1))[:room] + suffix

    return make


#: name -> reply of (about) the given size.
CORPUS: dict[str, Callable[[int], str]] = {
    "repeated key opener": _repeat('{"":'),
    "deep object": _deep_object,
    "deep array in an object": _padded('{"a":', "[", ""),
    "open braces": _repeat("{"),
    "brace quote": _repeat('{"'),
    "mismatched brackets": _repeat("{]"),
    "empty objects": _repeat("{}"),
    "balanced, invalid": _repeat("{x}"),
    "unterminated string with escapes": _padded('{"action": "', "\\\"", ""),
    "escaped backslashes": _padded('{"', "\\\\", ""),
    "stray brace, then prose": _padded("{ ", "lorem ipsum ", ' {"action": "hit"}'),
    "many small objects": _repeat('{"b": [1, {"c": 2}]} '),
    "huge number": _padded('{"action": ', "1", "}"),
    "key opener and quotes": _repeat('{"action":"{\\"'),
    "labelled, then whitespace": _padded("action", " ", ""),
    "labels without value": _repeat("Action: "),
    "first word, then whitespace": _padded("go", " \t\n", "south"),
    "first words repeated": _repeat("take key from "),
    "names inside words": _repeat("whitestickhit"),
    "names everywhere": _repeat("hit stick go north "),
    "unicode noise": _repeat("\u202e\ufeff\x00ß٣²"),
    "plain reply": _padded('{"action": "hit"} ', " ", ""),
}


def measure(reply: str, legal: tuple[str, ...], repeats: int) -> list[float]:
    from llamagym.agent import Agent
    from llamagym.plugin_runtime.manager import get_plugins

    plugins, agent = get_plugins(), Agent()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        plugins.extract_action(agent, reply, legal)
        seconds.append(time.perf_counter() - started)
    return seconds


def json_work(reply: str) -> dict[str, int]:
    from llamagym.task import reply_parsers as parsers

    work = parsers.ScanWork()
    for _ in parsers.json_objects(reply[: parsers.MAX_CHARS], work):
        pass
    return {"scanned_characters": work.scanned, "json_loads_calls": work.attempts}


def run(quick: bool) -> dict[str, Any]:
    from llamagym.plugin_runtime.manager import get_plugins
    from llamagym.task import reply_parsers as parsers

    sizes, repeats = (QUICK_SIZES, QUICK_REPEATS) if quick else (SIZES, REPEATS)
    get_plugins()  # loading the plugins is not part of any reply's time
    measure("warm-up", CARDS, 1)
    rows = []
    for name, make in CORPUS.items():
        for size in sizes:
            reply = make(size)
            for label, legal in (("blackjack", CARDS), ("commands", COMMANDS)):
                seconds = measure(reply, legal, repeats)
                rows.append(
                    {
                        "reply": name,
                        "characters": len(reply),
                        "actions": label,
                        "median_seconds": statistics.median(seconds),
                        "max_seconds": max(seconds),
                    }
                )
    per_reply = [row["median_seconds"] for row in rows]
    worst = max(rows, key=lambda row: row["median_seconds"])
    worst_reply = CORPUS[worst["reply"]](worst["characters"])
    return {
        "settings": {
            "sizes": list(sizes),
            "repeats": repeats,
            "replies": len(rows),
            "action_sets": {"blackjack": len(CARDS), "commands": len(COMMANDS)},
            "agent": "llamagym.Agent (its extract_action answers nothing)",
            "bounds": {
                "MAX_CHARS": parsers.MAX_CHARS,
                "MAX_SCAN": parsers.MAX_SCAN,
                "MAX_ATTEMPTS": parsers.MAX_ATTEMPTS,
                "MAX_DEPTH": parsers.MAX_DEPTH,
                "MAX_OBJECTS": parsers.MAX_OBJECTS,
            },
        },
        "worst_seconds": worst["median_seconds"],
        "worst_reply": {k: worst[k] for k in ("reply", "characters", "actions")},
        "worst_reply_json_work": json_work(worst_reply),
        "median_seconds": statistics.median(per_reply),
        "slowest_single_call_seconds": max(row["max_seconds"] for row in rows),
        "target_seconds": TARGET_SECONDS,
        "target_met": worst["median_seconds"] < TARGET_SECONDS,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_result_arguments(parser, "a smoke run (seconds)", "recorded; parsing uses one")
    args = parser.parse_args(argv)
    refuse_dirty_tree("parsers", args.quick, args.allow_dirty)
    data = run(args.quick)
    path = write_result("parsers", data, args, running_script_command(argv))
    print(json.dumps(json.loads(path.read_text()), indent=2))
    log(
        "parsers",
        f"worst {data['worst_seconds'] * 1000:.2f} ms ({data['worst_reply']['reply']}, "
        f"{data['worst_reply']['characters']} chars), median "
        f"{data['median_seconds'] * 1000:.3f} ms per reply; wrote {path}",
    )
    return 0 if data["target_met"] or args.quick else 1  # a smoke run only has to run


if __name__ == "__main__":
    sys.exit(main())
