"""TextWorld's published game sets (``agent.preset``), their held-out test pool
(``agent.pool=test``) and the two ways of acting on them: ranking the admissible
commands, or writing a command for the game's own parser (``agent.parser=game``).

Each preset's first game is generated once into the session's temporary LlamaGym cache
(a few seconds for w2-o3-q4)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("textworld")

from llamagym_textworld.agent import PRESETS, TEST_POOL_OFFSET, TextWorldAgent, written_command
from llamagym_textworld.env import (
    INTERPRETER_VERBS,
    MAX_COMMAND_CHARS,
    REFUSED_FEEDBACK,
    typed_command,
)
from llamagym_textworld.games import game_hash, list_games

from llamagym.errors import LlamaGymError
from llamagym.testing import tiny_agent

SMALL = {"preset": "w2-o3-q4", "games": 1}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _agent(**options) -> TextWorldAgent:
    rollout = options.pop("rollout", {})
    return tiny_agent(TextWorldAgent, agent={**SMALL, **options},
                      rollout={"num_envs": 1, "max_new_tokens": 8, **rollout})


def test_a_preset_sets_the_published_parameters_and_an_option_beside_it_wins() -> None:
    options = _agent().options
    assert (options.world_size, options.nb_objects, options.quest_min_length,
            options.quest_max_length, options.max_episode_steps) == (2, 3, 4, 4, 12)
    assert _agent(preset="w4-o6-q8").options.max_episode_steps == 24
    assert _agent(max_episode_steps=30).options.max_episode_steps == 30
    assert set(PRESETS) == {"w2-o3-q4", "w4-o6-q8"}
    with pytest.raises(Exception, match="preset"):
        _agent(preset="w9-o9-q9")


def test_a_preset_makes_the_same_games_from_the_same_seeds(tmp_path, monkeypatch) -> None:
    first = _agent().game_files()
    assert len(first) == 1
    (record,) = [g for g in list_games() if g.path == first[0]]
    assert (record.world_size, record.nb_objects, record.seed) == (2, 3, 0)
    assert len(record.walkthrough) == 4  # a quest of four commands
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path))  # made again, from nothing
    again = _agent().game_files()
    assert again[0] != first[0] and game_hash(again[0]) == game_hash(first[0])


def test_the_test_pool_holds_other_games_than_any_training_pool() -> None:
    train, test = _agent().game_files(), _agent(pool="test").game_files()
    seeds = {g.path: g.seed for g in list_games()}
    assert seeds[train[0]] == 0 and seeds[test[0]] == TEST_POOL_OFFSET
    assert game_hash(train[0]) != game_hash(test[0])


@pytest.mark.parametrize(("reply", "command"), [
    ('{"command": "open box"}', "open box"),
    ('{"command": "take Henderson\'s cane', "take Henderson's cane"),  # stopped mid-way
    ("Command: go north.\nbecause", "go north"),
    ("   ", ""),
])
def test_a_written_command_is_read_from_the_reply(reply: str, command: str) -> None:
    assert written_command(reply) == command


@pytest.mark.parametrize(("action", "typed"), [
    ("open  the\nbox", "open the box"),  # one line: the interpreter reads only the first
    ("take\x11 box", "take box"),  # a control character crashed the interpreter
    ("\\help", "help"),  # a backslash line is the interpreter's own command
    ("caf\u00e9", "caf"),
    ("go " * 1000, ("go " * 1000)[:MAX_COMMAND_CHARS].strip()),
])
def test_a_command_reaches_the_interpreter_as_a_player_types_it(action, typed) -> None:
    assert typed_command(action) == typed


def test_the_games_parser_judges_a_written_command_and_an_unknown_one_costs_a_step(
    tmp_path, monkeypatch,
) -> None:
    agent = _agent(parser="game", rollout={"mode": "generate"})
    env = agent.make_env()
    observation, info = env.reset(seed=0)
    assert agent.legal_actions(observation, info) is None  # nothing names the commands
    assert "Valid commands" not in agent.format_observation(observation, info)
    assert agent.named_actions(observation, info) == info["admissible_commands"]

    text, reward, terminated, truncated, after = env.step(agent.extract_action("dance wildly"))
    assert "not a verb" in text and reward == 0 and not (terminated or truncated)
    assert after["episode_step"] == 1
    assert after["admissible_commands"] == info["admissible_commands"]

    # What a model writes is data: a control character (which crashed the interpreter)
    # or one beyond ASCII reaches it as a space; the command is still a step.
    text, *_, after = env.step("take\x11 box\u00e9 " + "go " * 1000)
    assert after["episode_step"] == 2 and text

    monkeypatch.chdir(tmp_path)  # where the interpreter would write a saved game
    for verb in sorted(INTERPRETER_VERBS):
        text, _, terminated, _, after = env.step(verb + " now")
        assert text == REFUSED_FEEDBACK and not terminated
        if after["episode_step"] >= 12:
            break
    assert list(tmp_path.iterdir()) == []
    env.close()

    # The walkthrough, written out as commands, wins through the same path.
    env = agent.make_env()
    observation, info = env.reset(seed=0)
    for command in info["walkthrough"]:
        reply = '{"command": "' + command + '"}'
        observation, reward, terminated, truncated, info = env.step(agent.extract_action(reply))
    assert info["won"] and terminated
    env.close()


def test_a_run_writes_its_commands_for_the_game(tmp_path) -> None:
    agent = _agent(parser="game", max_episode_steps=3, rollout={"mode": "generate"})
    env = agent.make_env()
    (episode,) = agent.engine.collect([env], 1, seeds=[0])
    env.close()
    assert episode.length == 3  # no quest of four commands ends in three
    for turn in episode.turns:
        assert turn.valid and not turn.legal_actions and turn.action_index is None
        assert turn.env_action == written_command(turn.reply)
    with pytest.raises(LlamaGymError, match="rollout.mode=generate"):
        _agent(parser="game", rollout={"mode": "score"}).make_env()


def test_the_baselines_play_the_admissible_commands_with_the_games_parser() -> None:
    from llamagym.rollout.evaluation import evaluate_baseline

    agent = _agent(parser="game", rollout={"mode": "generate"})
    result = evaluate_baseline(agent, "walkthrough", 2, seed=0)
    assert result.outcomes["won"] == 1.0


def test_the_published_sets_are_in_the_options_docs() -> None:
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "agent.preset=w2-o3-q4" in readme and "agent.parser=game" in readme
    assert "agent.pool=test" in readme
