"""What plugins are handed and what they answer: read-only views, checked answers,
bounded parser work, registration hooks with a time limit, and listings whose JSON
stays clean whatever plugin code prints."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
import types
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Any

import gymnasium
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llamagym import hookimpl
from llamagym.agent import Agent
from llamagym.devtools.fake_model import ScriptedLLM, load_tiny_tokenizer
from llamagym.plugin_runtime import manager as plugin_manager
from llamagym.plugin_runtime.hook_values import (
    RefusedAnswer,
    action_index_of,
    read_only,
    reward_term,
)
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.task import reply_parsers as parsers
from llamagym.testing import temporary_plugin, tiny_agent

CARDS = ("stick", "hit")  # sorting the names would swap them
COMMANDS = (("look", "go north", "take key"), ("inventory", "go south"), ("open door", "look"))


# -- environments that record what env.step was given ----------------------------------
class CardEnv(gymnasium.Env):
    """Three steps per episode; every action index is recorded."""

    observation_space = gymnasium.spaces.Discrete(3)
    action_space = gymnasium.spaces.Discrete(2)

    def __init__(self) -> None:
        self.stepped: list[Any] = []
        self.t = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.t = 0
        return 0, {}

    def step(self, action: Any):
        self.stepped.append(action)
        self.t += 1
        return self.t, 1.0, self.t >= 3, False, {"t": self.t}


class CommandEnv(gymnasium.Env):
    """A text game whose legal commands change each step (``info["admissible_commands"]``);
    every command stepped is recorded beside the commands legal at that moment."""

    def __init__(self) -> None:
        self.stepped: list[tuple[Any, tuple[str, ...]]] = []
        self.t = 0

    def _info(self) -> dict[str, Any]:
        return {"admissible_commands": list(COMMANDS[self.t]), "nested": {"seen": [self.t]}}

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.t = 0
        return np.zeros(3), self._info()

    def step(self, action: Any):
        self.stepped.append((action, COMMANDS[self.t]))
        self.t += 1
        done = self.t >= len(COMMANDS)
        info = {} if done else self._info()
        return np.full(3, float(self.t)), 0.5, done, False, info


class CardAgent(Agent):
    name = "cards"
    action_names = CARDS

    def make_env(self) -> CardEnv:
        return CardEnv()


class CommandAgent(Agent):
    name = "commands"

    def make_env(self) -> CommandEnv:
        return CommandEnv()


def play(
    agent: Agent, replies: list[str], episodes: int = 2, num_envs: int = 2
) -> tuple[list, list]:
    """Episodes of ``agent`` through the real engine with a scripted model, and every
    env made for them (each records what it was stepped with)."""
    envs: list[Any] = []
    original = agent.make_env

    def make_env() -> Any:
        envs.append(original())
        return envs[-1]

    agent.make_env = make_env  # type: ignore[method-assign]
    try:
        llm = ScriptedLLM(replies, cycle=True, tokenizer=load_tiny_tokenizer())
        found = llm.play(agent, episodes, num_envs=num_envs, max_turns=200)
    finally:
        del agent.make_env
    return found, envs


_agents: dict[tuple[type, str], Agent] = {}


def agent_for(agent_class: type[Agent], policy: str = "fallback") -> Agent:
    key = (agent_class, policy)
    if key not in _agents:
        _agents[key] = tiny_agent(
            agent_class,
            rollout={
                "mode": "generate",
                "num_envs": 2,
                "reward_shaping": True,
                "invalid_action": {"policy": policy, "max_reprompts": 1},
            },
        )
    return _agents[key]


def problems_about(name: str) -> list[str]:
    return [p for p in get_plugins().problems if f"'{name}'" in p]


# -- finding: a parser that changes its arguments --------------------------------------
def test_a_parser_cannot_reorder_or_extend_the_legal_actions() -> None:
    class Sorter:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, reply, legal_actions):
            legal_actions.sort()  # would make index 0 "hit" for the engine too
            return None

    class Appender:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, reply, legal_actions):
            legal_actions.append("jump off the table")
            return len(legal_actions) - 1

    agent = agent_for(CardAgent)
    with temporary_plugin(Sorter(), "sorter"), temporary_plugin(Appender(), "appender"):
        episodes, envs = play(agent, ['{"action": "hit"}'])
    turns = [turn for episode in episodes for turn in episode.turns]
    assert len(turns) == 6
    assert all(turn.legal_actions == list(CARDS) for turn in turns)
    assert all(turn.legal_actions[turn.action_index] == "hit" for turn in turns)
    assert [action for env in envs for action in env.stepped] == [1] * 6  # "hit" each time
    assert CardAgent.action_names == CARDS
    for name in ("sorter", "appender"):
        [problem] = problems_about(name)
        assert "raised in llamagym_extract_action" in problem


# -- finding: answers of reasonable types count, others are refused by name -------------
@pytest.mark.parametrize(
    "answer",
    [1, np.int64(1), np.int32(1), np.uint8(1), 1.0, np.float32(1.0), "hit", "HIT", " Hit "],
)
def test_reasonable_parser_answers_are_accepted(answer: Any) -> None:
    class Parser:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, reply):
            return answer

    with temporary_plugin(Parser(), "reasonable") as plugins:
        before = len(plugins.problems)
        assert plugins.extract_action(CardAgent(), "stick", CARDS) == 1
        assert type(plugins.extract_action(CardAgent(), "stick", CARDS)) is int
        assert len(plugins.problems) == before
        assert "reasonable" in {p["name"] for p in plugins.participants()}


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (True, "bool"),
        (1.5, "whole number"),
        (math.nan, "whole number"),
        (2, "out of range"),
        (-1, "out of range"),
        (np.int64(7), "out of range"),
        ("jump", "not the name"),
        ("1", "not the name"),
        ([1], "neither"),
        (b"hit", "neither"),
        (Decimal(1), "neither"),
        (object(), "neither"),
    ],
)
def test_unusable_parser_answers_are_refused_once_and_the_next_parser_answers(
    answer: Any, why: str
) -> None:
    class Parser:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, reply, legal_actions):
            return answer

    name = f"unusable-{why.replace(' ', '-')}-{type(answer).__name__}"
    with temporary_plugin(Parser(), name) as plugins:
        for _ in range(3):
            # The regex parser, asked next, finds "stick" in the reply.
            assert plugins.extract_action(CardAgent(), "I stick", CARDS) == 0
        assert name not in {p["name"] for p in plugins.participants()}
    [problem] = problems_about(name)
    assert "llamagym_extract_action" in problem and why in problem
    assert type(answer).__name__ in problem and "next parser" in problem
    assert f"LLAMAGYM_DISABLE_PLUGINS={name}" in problem


def test_the_agents_own_answers_follow_the_same_rule() -> None:
    agent = CardAgent()
    for value, expected in [
        (np.int64(1), 1), (1.0, 1), ("HIT ", 1), (Fraction(2, 2), 1),
        (True, None), (1.5, None), (5, None), ("jump", None), ([0], None), (None, None),
    ]:
        assert agent.action_index(value, CARDS) == expected, value
    with pytest.raises(RefusedAnswer, match="out of range"):
        action_index_of(2, CARDS)


def test_prompt_and_reward_answers_are_checked_with_the_plugin_named_once() -> None:
    class Sloppy:
        @hookimpl(tryfirst=True)
        def llamagym_system_prompt(self, agent):
            return 42

        @hookimpl(tryfirst=True)
        def llamagym_format_observation(self, agent, observation, info):
            return b"bytes are not text"

        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            return {"hit": math.inf, "stick": "0.5"}.get(action, True)

    class Fine:
        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            return np.float32(0.25)

    agent = CardAgent()
    with temporary_plugin(Sloppy(), "sloppy-text"), temporary_plugin(Fine(), "fine") as plugins:
        for _ in range(2):
            assert plugins.system_prompt(agent) == agent.get_system_prompt()
            assert plugins.format_observation(agent, 3, {}) == "3"
            for action in ("hit", "stick", "other"):
                assert plugins.shape_reward(agent, 0, action, 1.0, {}) == 0.25
    problems = problems_about("sloppy-text")
    assert len(problems) == 3
    assert any("llamagym_system_prompt" in p and "42 (int)" in p for p in problems)
    assert any("llamagym_format_observation" in p and "bytes" in p for p in problems)
    assert any("llamagym_shape_reward" in p and "finite number" in p for p in problems)
    assert reward_term(np.float64(-1.5)) == -1.5 and reward_term(None) is None
    for bad in (math.nan, -math.inf, True, "1", [1.0]):
        with pytest.raises(RefusedAnswer):
            reward_term(bad)


def test_a_hook_wrapper_cannot_swap_in_an_unusable_answer() -> None:
    class Wrapper:
        @hookimpl(wrapper=True)
        def llamagym_extract_action(self, agent, reply, legal_actions):
            index = yield
            return "jump" if reply == "swap" else index

    with temporary_plugin(Wrapper(), "swapping-wrapper") as plugins:
        assert plugins.extract_action(CardAgent(), "swap: hit", CARDS) == 1
        assert plugins.extract_action(CardAgent(), "swap", CARDS) is None
    [problem] = problems_about("swapping-wrapper")
    assert "'jump'" in problem


# -- read-only views ----------------------------------------------------------------------
def test_hooks_get_read_only_views_of_info_and_observations() -> None:
    seen: list[Any] = []

    class Meddler:
        @hookimpl(tryfirst=True)
        def llamagym_format_observation(self, agent, observation, info):
            seen.append((observation, info))
            info["admissible_commands"].append("jump")

        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            info.clear()

    agent = agent_for(CommandAgent)
    with temporary_plugin(Meddler(), "meddler"):
        episodes, envs = play(agent, ['{"command": "look"}', "go south", "nothing"], episodes=1)
    [episode] = episodes
    assert [turn.legal_actions for turn in episode.turns] == [list(c) for c in COMMANDS]
    [env] = [env for env in envs if env.stepped]
    assert all(action in legal for action, legal in env.stepped)
    observation, info = seen[0]
    assert isinstance(info["admissible_commands"], tuple)
    assert dict(info["nested"]) == {"seen": (0,)}
    assert not observation.flags.writeable
    with pytest.raises(ValueError):
        observation[0] = 1.0
    [observation_problem] = [p for p in problems_about("meddler") if "format_observation" in p]
    assert "AttributeError" in observation_problem


def test_read_only_keeps_immutable_values_as_they_are() -> None:
    point = types.SimpleNamespace(x=1)
    observation = (np.int64(14), 10, True)
    assert read_only(observation) is observation
    assert read_only("text") == "text" and read_only(point) is point
    view = read_only({"a": [1, {2, 3}], "b": bytearray(b"x")})
    assert view == {"a": (1, frozenset({2, 3})), "b": b"x"}
    with pytest.raises(TypeError):
        view["c"] = 1  # type: ignore[index]


# -- the property: whatever a parser does, nothing else is affected ----------------------
MUTATIONS = ("none", "sort", "reverse", "append", "clear", "setitem", "pop", "del", "raise")
ANSWERS = st.one_of(
    st.none(),
    st.integers(-3, 5),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 1.0, 2.0, -0.0]),
    st.booleans(),
    st.text(max_size=12),
    st.sampled_from(["hit", "HIT", " stick ", "look", "go north", "take key", "jump", "1"]),
    st.integers(-3, 5).map(np.int64),
    st.integers(0, 5).map(np.uint8),
    st.floats(-3, 5).map(np.float32),
    st.lists(st.integers(0, 2), max_size=2),
    st.binary(max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.sampled_from([Fraction(1, 2), Fraction(1), Decimal(1), complex(1, 0), object(), 10**30]),
)
REPLIES = st.lists(
    st.sampled_from(
        ['{"action": "hit"}', '{"action": 0}', "stick", '{"command": "look"}', "go north",
         "take key", "nothing at all", '{"action": 99}', "Action: 1"]
    ),
    min_size=1,
    max_size=4,
)


def mutate(sequence: Any, how: str) -> None:
    """What a careless plugin does to an argument (a list would really change)."""
    if how == "sort":
        sequence.sort()
    elif how == "reverse":
        sequence.reverse()
    elif how == "append":
        sequence.append("jump off the table")
    elif how == "clear":
        sequence.clear()
    elif how == "setitem":
        sequence[0] = "jump off the table"
    elif how == "pop":
        sequence.pop()
    elif how == "del":
        del sequence[0]
    elif how == "raise":
        raise RuntimeError("a parser that fails")


class Hostile:
    """A parser (and prompt and shaping plugin) that does what ``behaviour`` says and
    writes down what it was handed before it did so."""

    def __init__(self) -> None:
        self.behaviour: dict[str, Any] = {}
        self.seen: list[tuple[str, ...]] = []

    def act(self, legal_actions: Any) -> Any:
        self.seen.append(tuple(legal_actions))
        mutate(legal_actions, self.behaviour["mutation"])
        return self.behaviour["answer"]

    @hookimpl(tryfirst=True)
    def llamagym_extract_action(self, agent, reply, legal_actions):
        return self.act(legal_actions)

    @hookimpl(tryfirst=True)
    def llamagym_format_observation(self, agent, observation, info):
        commands = info.get("admissible_commands")
        if commands is not None:
            mutate(commands, self.behaviour["mutation"])
        return self.behaviour["answer"]

    @hookimpl
    def llamagym_shape_reward(self, agent, observation, action, reward, info):
        mutate(info.get("admissible_commands", []), self.behaviour["mutation"])
        return self.behaviour["answer"]


class NormalPriority(Hostile):
    @hookimpl
    def llamagym_extract_action(self, agent, reply, legal_actions):
        return self.act(legal_actions)


class Witness:
    """Around every extraction: the names are the same before and after the parsers."""

    def __init__(self) -> None:
        self.changed: list[tuple] = []

    @hookimpl(wrapper=True)
    def llamagym_extract_action(self, agent, reply, legal_actions):
        before = tuple(legal_actions)
        index = yield
        if tuple(legal_actions) != before:
            self.changed.append((before, tuple(legal_actions)))
        return index


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    agent_class=st.sampled_from([CardAgent, CommandAgent]),
    policy=st.sampled_from(["fallback", "random", "reprompt", "end_episode"]),
    first=st.fixed_dictionaries({"mutation": st.sampled_from(MUTATIONS), "answer": ANSWERS}),
    second=st.fixed_dictionaries({"mutation": st.sampled_from(MUTATIONS), "answer": ANSWERS}),
    replies=REPLIES,
)
def test_no_parser_changes_what_others_see_or_gets_an_illegal_action_to_the_env(
    agent_class: type[Agent], policy: str, first: dict, second: dict, replies: list[str]
) -> None:
    agent = agent_for(agent_class, policy)
    hostile, normal, witness = Hostile(), NormalPriority(), Witness()
    hostile.behaviour, normal.behaviour = first, second
    with (
        temporary_plugin(hostile, "hostile-first"),
        temporary_plugin(normal, "hostile-normal"),
        temporary_plugin(witness, "witness"),
    ):
        episodes, [env] = play(agent, replies, num_envs=1)

    legal_lists = {CARDS} if agent_class is CardAgent else set(COMMANDS)
    assert witness.changed == []
    assert all(seen in legal_lists for seen in hostile.seen + normal.seen)
    turns = [turn for episode in episodes for turn in episode.turns]
    assert turns and all(tuple(turn.legal_actions) in legal_lists for turn in turns)
    # Failed attempts before a re-prompt have no action; every other turn a legal one.
    assert all(episode.turns[-1].action_index is not None for episode in episodes)
    acted = [turn for turn in turns if turn.action_index is not None]
    assert all(0 <= turn.action_index < len(turn.legal_actions) for turn in acted)
    assert all(math.isfinite(turn.reward) for turn in turns)
    if agent_class is CardAgent:
        assert all(type(action) is int and 0 <= action < len(CARDS) for action in env.stepped)
        stepped = list(env.stepped)
    else:
        assert all(action in legal for action, legal in env.stepped)
        stepped = [action for action, _ in env.stepped]
    # The env was stepped, in order, with exactly the actions the turns record.
    recorded = []
    for episode in episodes:
        acted = [turn for turn in episode.turns if turn.action_index is not None]
        if episode.info.get("ended_by_invalid_reply"):
            acted = acted[:-1]  # chosen, but the env was not stepped
        recorded += [agent.env_action(turn.action_index, turn.legal_actions) for turn in acted]
    assert stepped == recorded


# -- parsers: bounded work ---------------------------------------------------------------
PATHOLOGICAL = {
    "repeated key openers": '{"":' * 2048,
    "deep object": '{"a":' * 10_000 + "1" + "}" * 10_000,
    "deep array in an object": '{"a":' + "[" * 10_000,
    "braces": "{" * 1_000_000,
    "brace quote": '{"' * 500_000,
    "mismatched": "{]" * 500_000,
    "empty objects": "{}" * 500_000,
    "unterminated strings": '{"\\' * 300_000,
    "escapes": '{"' + "\\\\" * 500_000,
    "balanced but invalid": "{x}" * 300_000,
    "stray brace then text": "{ " + "a" * 1_000_000,
    "many small objects": '{"b": 1} ' * 100_000,
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_the_json_search_stays_within_its_bounds(name: str) -> None:
    reply = PATHOLOGICAL[name]
    work = parsers.ScanWork()
    found = list(parsers.json_objects(reply[: parsers.MAX_CHARS], work))
    assert work.scanned <= parsers.MAX_SCAN
    assert work.attempts <= parsers.MAX_ATTEMPTS
    assert len(found) <= parsers.MAX_OBJECTS


def test_json_loads_is_called_only_on_balanced_shallow_candidates(monkeypatch) -> None:
    calls: list[str] = []
    real = json.loads

    def counting(text: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(text)
        return real(text, *args, **kwargs)

    monkeypatch.setattr(parsers.json, "loads", counting)
    for reply in PATHOLOGICAL.values():
        calls.clear()
        get_plugins().extract_action(CardAgent(), reply, CARDS)
        assert len(calls) <= parsers.MAX_ATTEMPTS
        assert sum(map(len, calls)) <= parsers.MAX_SCAN
        assert all(text.startswith("{") and text.endswith("}") for text in calls)


def test_the_bounded_search_still_finds_what_it_should() -> None:
    cases = {
        '{"action": "hit"}': 1,
        'I think { maybe. {"action": 0}': 0,
        '{"note": "a } in a string", "action": "hit"}': 1,
        '{"a": {"b": [1, {"c": 2}]}, "action": 1}': 1,
        '{"x": 1} {"y": 2} {"action": "stick"}': 0,
        '{"action": "hit"' + "}" * 3: 1,
        '{"a":' * (parsers.MAX_DEPTH + 1) + '1' + "}" * (parsers.MAX_DEPTH + 1) + " stick": 0,
    }
    for reply, expected in cases.items():
        assert get_plugins().extract_action(Agent(), reply, CARDS) == expected, reply


def test_the_regex_parser_reads_whitespace_runs_as_one_space() -> None:
    plugins = get_plugins()
    names = ("go north", "go", "open red door")
    assert plugins.extract_action(Agent(), "then   go\n\tnorth", names) == 0
    assert plugins.extract_action(Agent(), "go" + " " * 8000 + "south", names) == 1
    assert plugins.extract_action(Agent(), "ACTION :  open red door", names) == 2
    assert plugins.extract_action(Agent(), "action:\n1", names) == 1
    assert plugins.extract_action(Agent(), "Open  RED door!", names) == 2
    assert plugins.extract_action(Agent(), "x", ("  ",)) is None
    assert r"\s" not in parsers._name_pattern(names).pattern  # plain words only


# -- registration hooks with a time limit ------------------------------------------------
def test_a_registration_hook_that_hangs_is_skipped_after_the_time_limit() -> None:
    release = threading.Event()

    def hanging(register):
        register("early-agent", "llamagym.testing:BanditAgent")
        release.wait(60)
        register("late-agent", "llamagym.testing:BanditAgent")

    def models(register):
        release.wait(60)

    plugin = types.SimpleNamespace(
        llamagym_register_agents=hookimpl(hanging), llamagym_register_models=hookimpl(models)
    )
    plugins = get_plugins()
    limit = plugins.registration_timeout
    plugins.registration_timeout = 0.3
    try:
        with temporary_plugin(plugin, "hangs"):
            started = time.perf_counter()
            agents = plugins.registry.agents()
            plugins.registry.algorithms()
            entries = plugins.registry.models()
            elapsed = time.perf_counter() - started
            release.set()
            time.sleep(0.05)
            assert "blackjack" in agents and "tiny" in {entry.name for entry in entries}
            assert "early-agent" not in agents and "late-agent" not in plugins.registry.agents()
    finally:
        plugins.registration_timeout = limit
        release.set()
    assert elapsed < 2.0  # one wait, then the plugin is not asked again
    [problem] = problems_about("hangs")
    assert "did not answer llamagym_register_agents within 0.3 s" in problem
    assert "LLAMAGYM_PLUGIN_TIMEOUT" in problem and "LLAMAGYM_DISABLE_PLUGINS=hangs" in problem


def test_the_time_limit_comes_from_the_environment(monkeypatch) -> None:
    # Past a week (1e15 once overflowed the thread's wait: a traceback) or below 0, the
    # default holds and the problem is said.
    refused = ("soon", "nan", "-1", "1e15", "inf")
    for value, expected in [("2.5", 2.5), ("0", None), ("", 5.0), *((v, 5.0) for v in refused)]:
        monkeypatch.setenv("LLAMAGYM_PLUGIN_TIMEOUT", value)
        plugins = plugin_manager.Plugins(load_entry_points=False)
        assert plugins.registration_timeout == expected, value
        assert bool(plugins.problems) == (value in refused), value


# -- listings stay machine-readable -------------------------------------------------------
def noisy_distribution(root: Path) -> dict[str, str]:
    """A distribution on ``PYTHONPATH`` whose plugins print at import and in every
    registration hook, register nonsense, and hang."""
    dist_info = root / "llamagym_noisy-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llamagym-noisy\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(
        "[llamagym]\nnoisy = llamagym_noisy_module\nhanging = llamagym_hanging_module\n"
    )
    (root / "llamagym_noisy_module.py").write_text(
        "from llamagym import hookimpl\n"
        "print('imported, on stdout')\n\n"
        "@hookimpl\n"
        "def llamagym_register_agents(register):\n"
        "    print('registering agents, on stdout')\n"
        "    register(None, 123)\n\n"
        "@hookimpl\n"
        "def llamagym_register_models(register):\n"
        "    print('registering models, on stdout')\n\n"
        "@hookimpl\n"
        "def llamagym_register_commands(cli):\n"
        "    print('adding commands, on stdout')\n"
    )
    (root / "llamagym_hanging_module.py").write_text(
        "import time\nfrom llamagym import hookimpl\n\n"
        "@hookimpl\n"
        "def llamagym_register_agents(register):\n"
        "    time.sleep(600)\n\n"
        "@hookimpl\n"
        "def llamagym_register_models(register):\n"
        "    time.sleep(600)\n"
    )
    return {
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        "LLAMAGYM_PLUGIN_TIMEOUT": "1",
    }


def test_listings_stay_clean_with_noisy_and_hanging_plugins_installed(tmp_path) -> None:
    env = {**os.environ, **noisy_distribution(tmp_path)}
    for command in (["plugins"], ["models", "--json"], ["list"]):
        started = time.perf_counter()
        result = subprocess.run(
            [sys.executable, "-m", "llamagym.cli", *command],
            capture_output=True, text=True, timeout=120, env=env,
        )
        elapsed = time.perf_counter() - started
        assert result.returncode == 0, result.stderr
        assert "on stdout" not in result.stdout and "on stdout" in result.stderr
        assert elapsed < 30  # not the hour the hanging plugin asks for
        if command[0] == "list":
            assert "blackjack" in result.stdout
            assert "register(None, 123)" in result.stderr
            assert "'hanging'" in result.stderr and "did not answer" in result.stderr
        else:
            listing = json.loads(result.stdout)
            names = {row["name"] for row in listing}
            assert ("noisy" in names) if command == ["plugins"] else ("tiny" in names)


def test_the_plugins_json_parses_with_a_plugin_printing_in_process(monkeypatch) -> None:
    class Loud:
        @hookimpl
        def llamagym_register_models(self, register):
            print("registering models, on stdout")

    class EntryPoint:
        name, group = "loud", "llamagym"
        dist = types.SimpleNamespace(metadata={"Name": "llamagym-loud"}, version="1.0")

        def load(self) -> Loud:
            print("imported, on stdout")
            return Loud()

    real = plugin_manager.importlib.metadata.entry_points

    def entry_points(group: str) -> list:
        return list(real(group=group)) + ([EntryPoint()] if group == "llamagym" else [])

    monkeypatch.setattr(plugin_manager.importlib.metadata, "entry_points", entry_points)
    plugin_manager.reset_plugins()
    try:
        from llamagym.cli.app import app

        for command in (["plugins"], ["models", "--json"]):
            result = CliRunner().invoke(app, command)
            assert result.exit_code == 0, result.output
            rows = json.loads(result.stdout)
            assert rows and "on stdout" not in result.stdout
            if command == ["plugins"]:
                assert "loud" in {row["name"] for row in rows}
    finally:
        monkeypatch.undo()
        plugin_manager.reset_plugins()


class HugeShaping:
    @hookimpl
    def llamagym_shape_reward(self, agent, observation, action, reward, info):
        return 8.98846567431158e307  # finite alone; two of them overflow


def test_shaping_terms_that_overflow_together_give_no_shaping() -> None:
    from llamagym.plugin_runtime.manager import get_plugins

    plugins = get_plugins()
    assert plugins.register(HugeShaping(), name="huge-a", distribution="(test)")
    assert plugins.register(HugeShaping(), name="huge-b", distribution="(test)")
    try:
        assert plugins.shape_reward(None, 0, "hit", 1.0, {}) == 0.0
        assert plugins.shape_reward(None, 0, "hit", 1.0, {}) == 0.0
        reported = [p for p in plugins.problems if "add up to inf" in p]
        assert len(reported) == 1 and "scale of the env's rewards" in reported[0]
    finally:
        plugins.unregister("huge-a")
        plugins.unregister("huge-b")
