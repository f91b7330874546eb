"""The extraction chain: JSON first, the agent's own parser, a regex last."""

from __future__ import annotations

import pytest

from llamagym.agent import Agent
from llamagym.errors import LlamaGymError
from llamagym.plugin_runtime.manager import get_plugins

CARDS = ["stick", "hit"]
COMMANDS = ["go north", "go", "open red door", "take key"]


class CardAgent(Agent):
    action_names = CARDS

    def extract_action(self, response: str):
        return 0 if "stay" in response.lower() else None


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"action": 1}', 1),
        ('{"action": "hit"}', 1),
        ('{"action": "STICK"}', 0),
        ('Sure! {"action": 0} is my move', 0),
        ('{"action": 99}', None),  # out of range: not legal
        ('{"action": "9e999"}', None),
        ('{"action": null}', None),
        ('{"action": true}', None),
        ('{"action": 1.5}', None),
        ('{"action": [1]}', None),
        ('{"action": "hit"', 1),  # truncated JSON: the regex still finds the name
        # The action named twice: the first value, the one the policy chose after the
        # reply prefix (json.loads alone keeps the last).
        ('{"sum": 8, "action": "hit", "action": "stick"}', 1),
        ('{"action": "stick", "action": "hit"}', 0),
        # The action's value went on past the name, so it is no legal JSON value (and
        # the reply may not parse): the first word after the key, the policy's choice,
        # not the last name in the reply.
        ('{"sum": 10, "action": "hit no 2, stick"}', 1),
        ('{"sum": 8, "action": "hit hit hit hit', 1),
        ("{'action': 'stick'} or hit", 0),
        ("Action: 1", 1),
        ("Action: -1", None),
        ("Action: 1.5", None),
        ("Action: 12.5", None),
        ("action=stick", 0),
        ("I think I should hit now.", 1),
        ("I stay.", 0),  # the agent's own parser
        ("white", None),  # 'hit' inside a word is not the action
        ("hit? no, stick", 0),  # the last action named wins
        ("garbage \x00\x1b[31m ✓", None),
        ("", None),
        ("x" * 1_000_000, None),
        ("x" * 1_000_000 + " hit", 1),
        ('{"action": ' * 5000, None),  # deeply nested, truncated
    ],
)
def test_discrete_replies(reply: str, expected: int | None) -> None:
    plugins = get_plugins()
    assert plugins.extract_action(CardAgent(), reply, CARDS) == expected


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ('{"command": "take key"}', 3),
        ('{"command": "Open  Red Door"}', 2),
        ("I will go north now", 0),  # the longest matching name wins over "go"
        ("go", 1),
        ("open the door", None),
    ],
)
def test_text_command_replies(reply: str, expected: int | None) -> None:
    assert get_plugins().extract_action(Agent(), reply, COMMANDS) == expected


def test_json_before_agent_before_regex() -> None:
    # JSON says hit, the agent's parser would say stick, the regex would say stick.
    reply = 'I stay and stick... {"action": "hit"}'
    assert get_plugins().extract_action(CardAgent(), reply, CARDS) == 1
    # Without JSON the agent's own parser beats the regex.
    assert get_plugins().extract_action(CardAgent(), "stay, do not hit", CARDS) == 0


def test_an_agent_reads_replies_with_the_parsers_it_names_in_order() -> None:
    reply = '{"command": "hit"} stay'
    assert CardAgent().read_reply(reply, CARDS) == (1, "json")
    assert CardAgent().read_reply("I stay", CARDS) == (0, "extract_action")
    assert CardAgent().read_reply("hit me", CARDS) == (1, "regex")
    assert CardAgent().read_reply("no idea", CARDS) == (None, None)

    class NoJson(CardAgent):
        reply_parsers = ("extract_action", "regex")

    # Without JSON the agent's parser reads it first; the regex, the last name named.
    assert NoJson().read_reply(reply, CARDS) == (0, "extract_action")
    assert NoJson().read_reply('{"command": "hit"} stick', CARDS) == (0, "regex")

    class Own(CardAgent):
        reply_parsers = ("extract_action",)

    assert Own().read_reply('{"action": "hit"}', CARDS) == (None, None)


@pytest.mark.parametrize("parsers", [("json", "jsn"), "json", ("regex", 3)])
def test_an_unknown_parser_is_refused_when_the_class_is_made(parsers) -> None:
    with pytest.raises(LlamaGymError) as refused:
        class Typo(CardAgent):
            reply_parsers = parsers
    message = str(refused.value)
    assert message.startswith("Typo.reply_parsers is ")
    assert message.endswith("from 'json', 'extract_action', 'regex'")


def test_an_extract_action_that_raises_is_reported_once_and_the_regex_reads_on() -> None:
    class Broken(CardAgent):
        def extract_action(self, response: str):
            raise KeyError("no such card")

    agent, plugins = Broken(), get_plugins()
    assert agent.read_reply("I hit", CARDS) == (1, "regex")
    assert agent.read_reply("stick", CARDS) == (0, "regex")
    said = [p for p in plugins.problems if p.startswith("Broken.extract_action raised")]
    assert len(said) == 1 and "KeyError" in said[0] and "next parser" in said[0]


def test_disabling_a_former_parser_plugin_says_what_to_do_instead(monkeypatch) -> None:
    from llamagym.plugin_runtime import manager as plugin_manager

    monkeypatch.setenv("LLAMAGYM_DISABLE_PLUGINS", "llamagym:json-action")
    plugin_manager.reset_plugins()
    try:
        [said] = [p for p in get_plugins().problems if "json-action" in p]
        assert "no plugin since LlamaGym 0.5.1" in said
        assert "reply_parsers = ('extract_action', 'regex')" in said
        # The agent's parsers read as before: nothing was turned off.
        assert CardAgent().read_reply('{"action": "hit"}', CARDS) == (1, "json")
    finally:
        monkeypatch.delenv("LLAMAGYM_DISABLE_PLUGINS")
        plugin_manager.reset_plugins()
