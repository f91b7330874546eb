"""Property test: no reply, however hostile, breaks the extraction chain.

Every reply yields a legal index or None (then the invalid-action policy applies),
never an exception, and the work per reply stays bounded.
"""

from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamagym.agent import Agent
from llamagym.plugin_manager import get_plugins

DISCRETE = ["stick", "hit"]
COMMANDS = ["go north", "open wooden door", "take key from table", "inventory", "look"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children),
    max_leaves=20,
)
hostile = st.sampled_from(
    [
        '{"action": 99}',
        '{"action": "9e999"}',
        '{"action": null}',
        '{"action": -1}',
        "Action: -1",
        "Action: 1e400",
        '{"command": {"action": "hit"}}',
        "[" * 10_000,
        '{"action": ' * 10_000,
        "\x00\x01\x02\u202e\ufeff",
        "hit" * 50_000,
        "",
    ]
)
replies = st.one_of(
    st.text(max_size=300),
    st.binary(max_size=300).map(lambda b: b.decode("utf-8", "replace")),
    json_values.map(lambda v: json.dumps({"action": v})),
    json_values.map(lambda v: json.dumps({"command": v})),
    st.tuples(st.text(max_size=50), st.sampled_from(DISCRETE + COMMANDS), st.text(max_size=50)).map(
        "".join
    ),
    hostile,
    hostile.map(lambda s: s * 3),
)


class AnyAgent(Agent):
    def extract_action(self, response: str):
        return response[:3]  # a sloppy user parser returning junk must not break anything


AGENT = AnyAgent()


def check(reply: str, legal: list[str]) -> None:
    started = time.perf_counter()
    index = get_plugins().extract_action(AGENT, reply, legal)
    assert index is None or (isinstance(index, int) and 0 <= index < len(legal))
    assert time.perf_counter() - started < 0.5, f"slow on a reply of {len(reply)} chars"


@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(replies)
def test_discrete_space(reply: str) -> None:
    check(reply, DISCRETE)


@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(replies)
def test_text_command_space(reply: str) -> None:
    check(reply, COMMANDS)


def test_megabyte_reply_is_fast() -> None:
    for reply in ("x" * 1_000_000, "{" * 1_000_000, '{"action": "' + "h" * 1_000_000):
        check(reply, DISCRETE)
        check(reply, COMMANDS)
