"""``rollout.explore=least-tried``: at a place an episode comes back to, only the legal
actions it has taken least often there are offered, for any agent; the env is stepped
with the action chosen, wherever it stands among all the legal actions."""

from __future__ import annotations

from collections import Counter
from typing import Any

import gymnasium
import pytest

from llamagym.agent import Agent
from llamagym.testing import tiny_agent

ROOMS = ("hall", "cellar")
COMMANDS = ("look", "wait", "sing", "go down", "go up", "open chest")


class Rooms(gymnasium.Env):
    """Two rooms that never end a game (cut after ``steps`` steps): each step records
    the action it was given; ``go down`` / ``go up`` move between the rooms."""

    observation_space = gymnasium.spaces.Text(100)
    action_space = gymnasium.spaces.Text(100)

    def __init__(self, steps: int = 14):
        self.steps, self.taken = steps, []
        self.room, self.count = "hall", 0

    def legal(self) -> list[str]:
        # One command the cellar lacks, so the two places offer different actions.
        return [c for c in COMMANDS if not (self.room == "cellar" and c == "open chest")]

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.room, self.count, self.taken = "hall", 0, []
        return f"You are in the {self.room}.", {"admissible_commands": self.legal()}

    def step(self, action: str):
        assert action in self.legal(), action
        self.taken.append((self.room, action))
        if action == "go down":
            self.room = "cellar"
        elif action == "go up":
            self.room = "hall"
        self.count += 1
        observation = f"You are in the {self.room}."
        return observation, 0.0, False, self.count >= self.steps, {
            "admissible_commands": self.legal()
        }


class RoomsAgent(Agent):
    name = "rooms"
    defaults = {"rollout": {"mode": "score"}}

    def make_env(self) -> Rooms:
        return Rooms()


class Levers(gymnasium.Env):
    """A ``Discrete(3)`` env that never changes its observation; records each index."""

    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(3)

    def __init__(self) -> None:
        self.taken: list[int] = []

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: int):
        self.taken.append(int(action))
        return 0, 0.0, False, len(self.taken) % 7 == 0, {}


class LeversAgent(Agent):
    name = "levers"
    action_names = ("red", "green", "blue")

    def format_observation(self, observation: Any) -> str:
        return "Pull a lever."

    def make_env(self) -> Levers:
        return Levers()


def _check_least_tried(episode: Any, places: list[tuple[str, tuple[str, ...]]]) -> None:
    """Every offer is a subset of its place's legal actions, and only ever the least
    tried of them: after any number of choices, no action at a place was taken more
    than once more than the least taken one there."""
    counts: dict[tuple[str, tuple[str, ...]], Counter[str]] = {}
    for turn, place in zip(episode.turns, places, strict=True):
        legal = place[1]
        assert set(turn.legal_actions) <= set(legal)
        tried = counts.setdefault(place, Counter())
        fewest = min(tried[name] for name in legal)
        assert all(tried[name] == fewest for name in turn.legal_actions)
        assert sorted(turn.legal_actions) == sorted(n for n in legal if tried[n] == fewest)
        tried[turn.legal_actions[turn.action_index]] += 1
        assert max(tried[n] for n in legal) - min(tried[n] for n in legal) <= 1


@pytest.mark.parametrize("greedy", [False, True])
def test_least_tried_offers_only_legal_actions_taken_least_often_at_each_place(greedy) -> None:
    agent = tiny_agent(RoomsAgent, rollout={"num_envs": 2})
    engine = agent.evaluation_engine(2) if greedy else agent.engine
    try:
        episodes = engine.play(2, greedy=greedy)
    finally:
        engine.close()
    assert len(episodes) == 2 and all(len(e.turns) == 14 for e in episodes)
    for episode in episodes:
        # The env took exactly what each turn chose (by name, among the offered).
        chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
        room, places = "hall", []
        for action in chosen:
            legal = tuple(c for c in COMMANDS if not (room == "cellar" and c == "open chest"))
            places.append((f"You are in the {room}.", legal))
            room = {"go down": "cellar", "go up": "hall"}.get(action, room)
        _check_least_tried(episode, places)
    # A place visited for 6+ decisions offered fewer than all of its actions.
    assert any(len(turn.legal_actions) < 5 for e in episodes for turn in e.turns)


def test_explore_all_offers_every_legal_action() -> None:
    agent = tiny_agent(RoomsAgent, rollout={"num_envs": 1, "explore": "all"})
    try:
        (episode,) = agent.engine.play(1)
    finally:
        agent.engine.close()
    assert all(len(turn.legal_actions) in (5, 6) for turn in episode.turns)


def test_a_named_discrete_action_steps_the_env_with_its_own_index() -> None:
    """Offered ``green`` and ``blue`` only, a choice of ``blue`` (offered index 1) steps
    the env with 2, its index among all the legal actions, in the engine and in the
    classic act loop."""
    agent = tiny_agent(LeversAgent, rollout={"num_envs": 1})
    try:
        env = agent.engine.envs[0]
        (episode,) = agent.engine.play(1)
    finally:
        agent.engine.close()
    names = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert [LeversAgent.action_names[i] for i in env.taken] == names
    assert any(len(turn.legal_actions) < 3 for turn in episode.turns)
    assert Counter(names[:6]) == Counter({"red": 2, "green": 2, "blue": 2})

    classic = tiny_agent(LeversAgent)
    levers = Levers()
    observation, _ = levers.reset(seed=0)
    taken = [classic.act(observation) for _ in range(6)]
    for action in taken:
        levers.step(action)
    assert sorted(taken) == [0, 0, 1, 1, 2, 2]
    assert levers.taken == taken


def test_an_agent_can_name_its_own_place() -> None:
    """An agent whose text changes where its place does not (a game that echoes the last
    command) names the place: the counts are shared across the different texts."""

    class Echoing(Levers):
        def step(self, action: int):
            observation, *rest = super().step(action)
            return len(self.taken), *rest

    class EchoingAgent(LeversAgent):
        name = "echoing"

        def format_observation(self, observation: Any) -> str:
            return f"Step {observation}. Pull a lever."

        def exploration_place(self, observation: Any, info: Any) -> str:
            return "the lever room"

        def make_env(self) -> Echoing:
            return Echoing()

    for agent_class, spread in ((LeversAgent, 1), (EchoingAgent, 1)):
        agent = tiny_agent(agent_class, rollout={"num_envs": 1})
        try:
            (episode,) = agent.engine.play(1)
        finally:
            agent.engine.close()
        names = Counter(turn.legal_actions[turn.action_index] for turn in episode.turns[:6])
        assert max(names.values()) - min(names.values()) <= spread
    # Without the agent's place every text is new: nothing is ever filtered.
    plain = type("PlainEchoing", (EchoingAgent,), {
        "name": "plain-echoing", "exploration_place": lambda self, o, i: None})
    agent = tiny_agent(plain, rollout={"num_envs": 1})
    try:
        (episode,) = agent.engine.play(1)
    finally:
        agent.engine.close()
    assert all(len(turn.legal_actions) == 3 for turn in episode.turns)
