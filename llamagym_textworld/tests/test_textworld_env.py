"""Tests for the TextWorld env side: game generation, the Gymnasium adapter, baselines.

Every test generates its own tiny game under ``tmp_path`` (through ``LLAMAGYM_CACHE``),
so nothing depends on the user's cache; a game takes about half a second to build.
"""

from __future__ import annotations

import json
import random
import sys
from importlib import metadata
from pathlib import Path

import gymnasium as gym
import pytest
from gymnasium.utils.env_checker import check_env

pytest.importorskip("textworld")

from llamagym_textworld.baselines import (
    RandomAdmissiblePolicy,
    WalkthroughPolicy,
    play_episode,
)
from llamagym_textworld.env import TextWorldEnv, clean_feedback
from llamagym_textworld.games import (
    GAME_RECORD,
    MissingDependencyError,
    game_hash,
    list_games,
    make_game,
    make_games,
)

# Small enough to build fast, big enough that seed 0 and 1 both have a 2-step quest.
TINY = {"world_size": 2, "nb_objects": 3, "quest_length": 2}
INFO_KEYS = {
    "objective",
    "admissible_commands",
    "score",
    "max_score",
    "won",
    "lost",
    "walkthrough",
}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLAMAGYM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "textworld"


@pytest.fixture
def game_file(cache: Path) -> Path:
    return make_game(seed=0, **TINY)


def _check_info(info: dict) -> None:
    assert info.keys() >= INFO_KEYS
    assert isinstance(info["objective"], str) and info["objective"]
    assert isinstance(info["admissible_commands"], list)
    assert info["admissible_commands"] == sorted(info["admissible_commands"])
    assert all(isinstance(c, str) for c in info["admissible_commands"])
    assert isinstance(info["walkthrough"], list) and info["walkthrough"]
    assert info["max_score"] >= 1


# ---------------------------------------------------------------- generation


def test_generation_is_deterministic_and_cached(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = make_game(seed=0, **TINY)
    assert first.is_file() and first.suffix == ".z8"
    assert first.parent.parent == cache
    assert first.with_suffix(".json").is_file()
    mtime = first.stat().st_mtime_ns

    # A cache hit must not touch the generator at all: make it explode if called.
    import textworld.generator

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("cached game was regenerated")

    with monkeypatch.context() as m:
        m.setattr(textworld.generator, "make_game", boom)
        m.setattr(textworld.generator, "compile_game", boom)
        again = make_game(seed=0, **TINY)
    assert again == first
    assert first.stat().st_mtime_ns == mtime

    # Same parameters and seed in a fresh cache: the same game, byte for byte in its
    # description and in the story file apart from Inform's compile-date serial.
    other = make_game(seed=0, cache_dir=tmp_path / "other", **TINY)
    assert other != first
    assert game_hash(other) == game_hash(first)
    assert other.with_suffix(".json").read_bytes() == first.with_suffix(".json").read_bytes()

    different = make_game(seed=1, cache_dir=tmp_path / "other", **TINY)
    assert game_hash(different) != game_hash(first)


def test_list_games_reads_records_and_skips_partial_folders(cache: Path) -> None:
    path = make_game(seed=0, **TINY)
    (cache / ".w2-o3-q2-2-s9-tw0.tmp").mkdir()  # an interrupted generation
    (cache / "no-record").mkdir()  # a folder without our record file
    (cache / "broken").mkdir()
    (cache / "broken" / GAME_RECORD).write_text("{not json", encoding="utf-8")

    infos = list_games()
    assert [g.path for g in infos] == [path]
    info = infos[0]
    record = json.loads((path.parent / GAME_RECORD).read_text(encoding="utf-8"))
    assert (info.world_size, info.nb_objects, info.seed) == (2, 3, 0)
    assert (info.quest_min_length, info.quest_max_length) == (2, 2)
    assert info.game_hash == game_hash(path) == record["game_hash"]
    assert info.walkthrough and info.max_score >= 1
    assert info.textworld_version == metadata.version("textworld")
    # The atomic write left no temporary folder of its own behind.
    hidden = sorted(p.name for p in cache.iterdir() if p.name.startswith("."))
    assert hidden == [".w2-o3-q2-2-s9-tw0.tmp"]


def test_make_games_with_a_quest_length_range(cache: Path) -> None:
    paths = make_games(2, first_seed=5, world_size=2, nb_objects=3, quest_length=(1, 2))
    assert len(paths) == 2 and len(set(paths)) == 2
    seeds = sorted(g.seed for g in list_games())
    assert seeds == [5, 6]
    assert all(len(g.walkthrough) >= 1 for g in list_games())


def test_missing_textworld_raises_a_helpful_error(
    game_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # what games.py looks up
    with pytest.raises(MissingDependencyError, match="pip install"):
        make_game(seed=0, **TINY)

    monkeypatch.setitem(sys.modules, "textworld", None)  # makes `import textworld` fail
    with pytest.raises(MissingDependencyError, match="llamagym-textworld\\[textworld\\]"):
        TextWorldEnv(game_file)


# ---------------------------------------------------------------- environment


def test_walkthrough_wins_with_total_reward_max_score(game_file: Path) -> None:
    env = TextWorldEnv(game_file)
    obs, info = env.reset(seed=0)
    assert obs in env.observation_space
    _check_info(info)
    assert info["admissible_commands"]
    assert info["score"] == 0 and not info["won"] and not info["lost"]
    assert info["episode_step"] == 0

    total = 0.0
    walkthrough = list(info["walkthrough"])
    for i, command in enumerate(walkthrough):
        assert command in info["admissible_commands"]
        obs, reward, terminated, truncated, info = env.step(command)
        assert obs in env.observation_space
        _check_info(info)
        total += float(reward)
        last = i == len(walkthrough) - 1
        assert terminated is last and truncated is False
    assert info["won"] is True and info["lost"] is False
    assert info["score"] == info["max_score"]
    assert total == info["max_score"]
    with pytest.raises(RuntimeError):
        env.step("look")  # the episode is over
    env.close()
    env.close()  # idempotent


def test_win_bonus_and_step_penalty(game_file: Path) -> None:
    env = TextWorldEnv(game_file, win_bonus=10.0, step_penalty=0.25)
    result = play_episode(env, WalkthroughPolicy(), seed=0)
    assert result.won and not result.truncated
    expected = result.max_score + 10.0 - 0.25 * result.steps
    assert result.total_reward == pytest.approx(expected)
    env.close()


def test_progress_reward_follows_the_games_own_plan(game_file: Path) -> None:
    """Seed 0's quest: take the cloak from the display, drop it. A walkthrough move earns
    the progress reward, a detour earns nothing, undoing a move loses what it earned, and
    the win pays the last plan step on top of the score."""
    env = TextWorldEnv(game_file, progress_reward=0.5)
    _, info = env.reset(seed=0)
    assert info["walkthrough"] == ["take cloak from display", "drop cloak"]
    assert info["progress"] == 0 and len(info["policy_commands"]) == 2
    steps = []
    for command in ["look", "take cloak from display", "insert cloak into display",
                    "take cloak from display", "drop cloak"]:
        _, reward, terminated, _, info = env.step(command)
        steps.append((reward, info["progress"]))
    assert steps == [
        (0.0, 0),   # a detour: the plan is as long as before
        (0.5, 1),   # a walkthrough move
        (-0.5, -1),  # undone: the cloak is back, the plan one command longer
        (0.5, 1),
        (1.5, 1),   # the win: the score's 1 and the last step of the plan
    ]
    assert terminated and info["won"]
    env.close()
    # Off by default: the rewards are the score's alone.
    plain = TextWorldEnv(game_file)
    result = play_episode(plain, WalkthroughPolicy(), seed=0)
    assert result.total_reward == result.max_score
    plain.close()


def test_info_names_the_room_the_player_is_in(game_file: Path) -> None:
    """``room`` is where the player stands: a command that moves nobody keeps it."""
    env = TextWorldEnv(game_file)
    _, info = env.reset(seed=0)
    room = info["room"]
    assert room and isinstance(room, str)
    _, _, _, _, info = env.step("look")
    assert info["room"] == room
    _, _, _, _, info = env.step("take cloak from display")
    assert info["room"] == room and info["admissible_commands"] != []
    env.close()


def test_truncation_at_max_episode_steps(game_file: Path) -> None:
    env = TextWorldEnv(game_file, max_episode_steps=3)
    env.reset(seed=0)
    flags = [env.step("look")[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]
    with pytest.raises(RuntimeError):
        env.step("look")
    # A new episode starts afresh.
    _, info = env.reset()
    assert info["episode_step"] == 0
    assert env.step("look")[3] is False
    env.close()


def test_observations_are_cleaned_and_commands_normalised(game_file: Path) -> None:
    env = TextWorldEnv(game_file)
    env.reset(seed=0)
    obs, reward, *_ = env.step("inventory")
    assert obs == "You are carrying nothing."
    assert reward == 0.0
    # A newline inside an action must not split it into two parser commands.
    obs, *_ = env.step("  examine\n  the\tfloor ")
    assert "\n>" not in obs and obs

    raw = TextWorldEnv(game_file, clean_observations=False)
    raw.reset(seed=0)
    raw_obs, *_ = raw.step("inventory")
    assert "\n>" in raw_obs  # the interpreter's prompt and status line
    assert clean_feedback(raw_obs) == "You are carrying nothing."
    env.close()
    raw.close()


def test_seeded_reset_picks_games_reproducibly(cache: Path) -> None:
    files = make_games(2, first_seed=0, **TINY)
    env = TextWorldEnv(files)
    picked = []
    for seed in range(12):
        _, a = env.reset(seed=seed)
        _, b = env.reset(seed=seed)
        assert a["game_file"] == b["game_file"]
        picked.append(a["game_file"])
    assert set(picked) == {str(f) for f in files}

    for index, path in enumerate(files):
        _, info = env.reset(options={"game_index": index})
        assert info["game_file"] == str(path)
        assert info["walkthrough"] == list(list_games()[index].walkthrough)
        # The walkthrough still wins after switching games on the same interpreter.
        result = play_episode(env, WalkthroughPolicy(), options={"game_index": index})
        assert result.won and result.total_reward == result.max_score
    with pytest.raises(IndexError):
        env.reset(options={"game_index": 2})
    env.close()


# Without a spec the checker cannot re-make the env per render mode and says so; the
# gymnasium.make half of this test covers those checks.
@pytest.mark.filterwarnings("ignore:.*not having a spec")
def test_check_env_passes(game_file: Path) -> None:
    env = TextWorldEnv(game_file, render_mode="ansi")
    check_env(env)
    env.close()

    # Through gymnasium.make the checker also exercises every render mode and close().
    env_id = "llamagym-test/TextWorld-v0"
    gym.register(env_id, entry_point=TextWorldEnv)
    try:
        made = gym.make(env_id, game_files=[str(game_file)], disable_env_checker=True)
        check_env(made.unwrapped)
        made.close()
    finally:
        del gym.registry[env_id]


def test_render_ansi(game_file: Path) -> None:
    env = TextWorldEnv(game_file, render_mode="ansi")
    env.reset(seed=0)
    env.step("inventory")
    assert env.render() == "> inventory\nYou are carrying nothing.\n"
    env.close()


# ---------------------------------------------------------------- baselines


def test_random_baseline_plays_only_admissible_commands(game_file: Path) -> None:
    env = TextWorldEnv(game_file, max_episode_steps=30)
    for seed in (0, 1):
        policy = RandomAdmissiblePolicy(seed=seed)
        obs, info = env.reset(seed=seed)
        done = False
        while not done:
            command = policy(obs, info)
            assert command in info["admissible_commands"]
            obs, _, terminated, truncated, info = env.step(command)
            done = terminated or truncated

    # Same seed, same moves; the policy's RNG is its own, not the global one.
    a = play_episode(env, RandomAdmissiblePolicy(seed=3), seed=0)
    random.seed(12345)
    b = play_episode(env, RandomAdmissiblePolicy(seed=3), seed=0)
    assert a.commands == b.commands
    assert RandomAdmissiblePolicy(0)("", {"admissible_commands": []}) == "look"
    env.close()


def test_walkthrough_policy_restarts_each_episode(game_file: Path) -> None:
    env = TextWorldEnv(game_file)
    policy = WalkthroughPolicy()
    # Two episodes in a row without calling policy.reset(): episode_step == 0 restarts it.
    for _ in range(2):
        obs, info = env.reset(seed=0)
        done = False
        while not done:
            obs, _, terminated, truncated, info = env.step(policy(obs, info))
            done = terminated or truncated
        assert info["won"]

    # Moved off the walkthrough, replanning from TextWorld's current policy still wins.
    obs, info = env.reset(seed=0)
    detours = [
        c
        for verb in ("go ", "open ", "close ", "take ")
        for c in info["admissible_commands"]
        if c.startswith(verb) and c not in info["walkthrough"]
    ]
    assert detours
    obs, _, _, _, info = env.step(detours[0])
    replanner = WalkthroughPolicy(replan=True)
    done = False
    while not done:
        obs, _, terminated, truncated, info = env.step(replanner(obs, info))
        done = terminated or truncated
    assert info["won"]
    env.close()
