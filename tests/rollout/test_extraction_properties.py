"""Property test: no reply, however hostile, breaks the extraction chain.

Every reply yields a legal index or None (then the invalid-action policy applies),
never an exception; and each parser reads only a bounded window of a long reply.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamagym.agent import Agent
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.task.reply_parsers import MAX_CHARS

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


def check(reply: str, legal: list[str]) -> int | None:
    index = get_plugins().extract_action(AGENT, reply, legal)
    assert index is None or (isinstance(index, int) and 0 <= index < len(legal))
    return index


@pytest.mark.slow  # 5,000 drawn replies
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(replies)
def test_discrete_space(reply: str) -> None:
    check(reply, DISCRETE)


@pytest.mark.slow  # 5,000 drawn replies
@settings(max_examples=5000, deadline=None, suppress_health_check=list(HealthCheck))
@given(replies)
def test_text_command_space(reply: str) -> None:
    check(reply, COMMANDS)


def test_megabyte_replies_are_read_through_a_bounded_window() -> None:
    for reply in ("x" * 1_000_000, "{" * 1_000_000, '{"action": "' + "h" * 1_000_000):
        assert check(reply, DISCRETE) is None
        assert check(reply, COMMANDS) is None
    padding = " " * 1_000_000
    # JSON is read from the start of a reply, the regex fallback from its end ...
    assert check('{"action": "hit"}' + padding, DISCRETE) == 1
    assert check(padding + "Action: hit", DISCRETE) == 1
    assert check(padding + "so: go north", COMMANDS) == 0
    # ... and nothing outside those windows is looked at.
    middle = " " * MAX_CHARS + '{"action": "hit"} Action: hit' + " " * MAX_CHARS
    assert check(middle, DISCRETE) is None
