"""``llamagym serve``: an agent's env over OpenEnv, as the agent plays it in process."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from llamagym_openenv.client import LEGAL, OpenEnvEnv, OpenEnvError

from llamagym.cli.run_commands import resolve_run_config


def _actions(seed: int, step: int) -> str:
    """A fixed plan per seed: hit ``seed % 3`` times, then stick."""
    return "hit" if step < seed % 3 else "stick"


def in_process(seed: int) -> list[tuple[Any, ...]]:
    """The seeded Blackjack episode in process: (text, legal actions, reward, done)."""
    agent_class, resolved = resolve_run_config("blackjack", None, [], {})
    agent = agent_class(config=resolved)
    env = agent.make_env()
    observation, info = env.reset(seed=seed)
    trace = [(agent.plugins.format_observation(agent, observation, info),
              list(agent.legal_actions(observation, info)), 0.0, False)]
    step, done = 0, False
    while not done:
        index = list(agent.action_names).index(_actions(seed, step))
        observation, reward, terminated, truncated, info = env.step(index)
        done = terminated or truncated
        legal = None if done else list(agent.legal_actions(observation, info))
        trace.append((agent.plugins.format_observation(agent, observation, info), legal,
                      float(reward), done))
        step += 1
    env.close()
    return trace


def through(url: str, seed: int, env: OpenEnvEnv | None = None) -> list[tuple[Any, ...]]:
    """The same episode through an OpenEnv server."""
    own = env is None
    env = env or OpenEnvEnv(url)
    try:
        text, info = env.reset(seed=seed)
        trace = [(text, info[LEGAL], 0.0, False)]
        step, done = 0, False
        while not done:
            text, reward, terminated, truncated, info = env.step(_actions(seed, step))
            done = terminated or truncated
            trace.append((text, info[LEGAL], reward, done))
            step += 1
        return trace
    finally:
        if own:
            env.close()


def test_the_first_line_says_where_and_that_only_this_machine_can_connect(blackjack_server):
    line = blackjack_server.first_line
    assert line.startswith("llamagym serve blackjack: OpenEnv server on ws://127.0.0.1:")
    assert "loopback only" in line and "at most 16 sessions" in line


def test_a_seeded_episode_is_the_same_through_the_server_and_in_process(blackjack_server):
    env = OpenEnvEnv(blackjack_server.url)
    try:
        for seed in range(12):  # one session, many resets
            remote = through(blackjack_server.url, seed, env)
            assert remote == in_process(seed), f"seed {seed}"
    finally:
        env.close()
    # a different seed is a different deal somewhere in 12 (not one fixed hand)
    assert len({through(blackjack_server.url, s)[0][0] for s in range(12)}) > 1


def test_eight_sessions_at_once_each_play_their_own_episodes(blackjack_server):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def play(worker: int) -> None:
        try:
            env = OpenEnvEnv(blackjack_server.url)
            try:
                results[worker] = [through("", 8 * k + worker, env) for k in range(4)]
            finally:
                env.close()
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=play, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    for worker in range(8):
        for k, trace in enumerate(results[worker]):
            assert trace == in_process(8 * k + worker)


def test_max_sessions_refuses_the_third_client_and_frees_a_closed_slot(serve_in_thread):
    with serve_in_thread("blackjack", max_sessions=2) as url:
        first, second, third = OpenEnvEnv(url), OpenEnvEnv(url), OpenEnvEnv(url)
        try:
            first.reset(seed=1)
            second.reset(seed=2)
            with pytest.raises(OpenEnvError, match="is full and refused a session") as refused:
                third.reset(seed=3)
            assert "--max-sessions" in str(refused.value) and "\n" not in str(refused.value)
            first.close()
            deadline = time.monotonic() + 10
            while True:  # the closed session's slot comes free
                try:
                    third.reset(seed=3)
                    break
                except OpenEnvError:
                    assert time.monotonic() < deadline, "a closed session kept its slot"
                    time.sleep(0.2)
        finally:
            for env in (first, second, third):
                env.close()


def test_an_illegal_action_is_refused_in_one_line_and_the_next_episode_plays(blackjack_server):
    env = OpenEnvEnv(blackjack_server.url)
    try:
        env.reset(seed=0)
        with pytest.raises(OpenEnvError, match="refused a step.*not a legal action"):
            env.step("split")
        assert through("", 0, env) == in_process(0)  # a new session, a fresh episode
    finally:
        env.close()


def test_a_step_without_a_reset_or_after_the_end_is_refused_saying_which(blackjack_server):
    env = OpenEnvEnv(blackjack_server.url)
    try:
        with pytest.raises(OpenEnvError, match="refused a step.*this session has no episode"):
            env.step("stick")  # what a client sees that lost its session to a restart
        env.reset(seed=0)
        _, _, terminated, _, _ = env.step("stick")  # Blackjack: standing ends the hand
        assert terminated
        with pytest.raises(OpenEnvError, match="refused a step.*the episode is over"):
            env.step("stick")
    finally:
        env.close()


def test_serve_refuses_an_unknown_agent_and_a_busy_port_in_one_line(blackjack_server, llamagym):
    unknown = subprocess.run([*llamagym, "serve", "no-such-agent", "--port", "0"],
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2
    assert "unknown agent 'no-such-agent'" in unknown.stderr
    port = blackjack_server.url.rsplit(":", 1)[1]
    busy = subprocess.run([*llamagym, "serve", "blackjack", "--port", port],
                          capture_output=True, text=True, timeout=60)
    assert busy.returncode == 2, busy.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in busy.stderr
    assert len(busy.stderr.strip().splitlines()) == 1, busy.stderr


def test_another_agent_serves_too_cartpole_with_its_text(serve):
    with serve("cartpole", "--max-sessions", "2") as served:
        env = OpenEnvEnv(served.url)
        try:
            text, info = env.reset(seed=3)
            assert "pole angle=" in text and info[LEGAL] == ["LEFT", "RIGHT"]
            _, reward, terminated, truncated, _ = env.step("LEFT")
            assert reward == 1.0 and not truncated
        finally:
            env.close()
    assert served.process.poll() is not None  # stopped when the block ended


@pytest.mark.parametrize("agent_name", ["textworld", "babyai", "textarena-tower-of-hanoi"])
def test_the_text_games_serve_their_seeded_first_turn_as_in_process(serve_in_thread,
                                                                     agent_name):
    pytest.importorskip(f"llamagym_{agent_name.split('-')[0]}")
    agent_class, resolved = resolve_run_config(agent_name, None, [], {})
    agent = agent_class(config=resolved)
    local = agent.make_env()
    observation, info = local.reset(seed=5)
    expected = (agent.plugins.format_observation(agent, observation, info),
                [str(name) for name in agent.legal_actions(observation, info)])
    local.close()
    with serve_in_thread(agent_name, max_sessions=2) as url:
        env = OpenEnvEnv(url)
        try:
            text, info = env.reset(seed=5)
            assert (text, info[LEGAL]) == expected
            _, reward, _, _, _ = env.step(info[LEGAL][0])
            assert isinstance(reward, float)
        finally:
            env.close()


USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"


@pytest.mark.skipif(not USAGE.is_file(), reason="the repository's docs are not beside this")
def test_the_trl_environment_class_in_the_docs_plays_a_served_episode(blackjack_server):
    from transformers.utils import get_json_schema

    block = next(code for code in re.findall(r"```python\n(.*?)```", USAGE.read_text(),
                                              re.DOTALL) if "class ServedGame" in code)
    namespace: dict[str, Any] = {}
    exec(block.replace("ws://127.0.0.1:8000", blackjack_server.url), namespace)  # our doc
    game = namespace["ServedGame"]()
    try:
        first = game.reset(seed=0)
        assert first.endswith("\nLegal actions: stick, hit") and not game.done
        while not game.done:
            game.act("stick")
        assert game.reward == sum(step[2] for step in in_process(0))  # seed 0: sticks
    finally:
        game.env.close()
    # TRL makes each public method a tool from its docstring, as transformers reads it.
    tool = get_json_schema(namespace["ServedGame"].act)["function"]
    assert tool["name"] == "act" and tool["parameters"]["required"] == ["action"]
