"""The env on TextWorldExpress's real games, on the JVM the session's envs share."""

from __future__ import annotations

import string
from collections.abc import Iterator

import pytest
from llamagym_textworld_express.env import MAX_ACTION_CHARS, TextWorldExpressEnv
from llamagym_textworld_express.games import GAMES

pytestmark = pytest.mark.usefixtures("shared_jvm")


@pytest.fixture(scope="module")
def coin() -> Iterator[TextWorldExpressEnv]:
    env = TextWorldExpressEnv("coin", "numLocations=4,includeDoors=0", max_episode_steps=6)
    yield env
    env.close()


def _first_steps(env: TextWorldExpressEnv, seed: int) -> list[tuple[str, list[str]]]:
    observation, info = env.reset(seed=seed)
    seen = [(observation, info["valid_actions"])]
    for _ in range(3):
        observation, _, terminated, truncated, info = env.step(info["valid_actions"][0])
        seen.append((observation, info["valid_actions"]))
        if terminated or truncated:
            break
    return seen


def test_a_seeded_reset_deals_the_same_game_on_any_env(coin: TextWorldExpressEnv) -> None:
    first = _first_steps(coin, seed=3)
    _, info = coin.reset(seed=3)
    game_seed = info["game_seed"]
    assert _first_steps(coin, seed=5) != first
    assert _first_steps(coin, seed=3) == first
    other = TextWorldExpressEnv("coin", "numLocations=4,includeDoors=0", max_episode_steps=6)
    try:
        assert _first_steps(other, seed=3) == first
        assert other.reset(seed=3)[1]["game_seed"] == game_seed
    finally:
        other.close()


def test_the_folds_hold_different_games() -> None:
    seeds, observations = {}, {}
    for fold in ("train", "dev", "test"):
        env = TextWorldExpressEnv("coin", "numLocations=4", fold=fold)
        try:
            found = [env.reset(seed=seed) for seed in range(4)]
        finally:
            env.close()
        seeds[fold] = {info["game_seed"] for _, info in found}
        observations[fold] = [observation for observation, _ in found]
        assert all(info["fold"] == fold for _, info in found)
    assert all(seed < 1000 for seed in seeds["train"])
    assert all(10_000 <= seed < 11_000 for seed in seeds["dev"])
    assert all(20_000 <= seed < 21_000 for seed in seeds["test"])
    assert observations["train"] != observations["dev"] != observations["test"]


def test_the_valid_actions_are_sorted_text_and_the_observation_is_bounded() -> None:
    env = TextWorldExpressEnv("cookingworld", GAMES["cookingworld"].default_params,
                              max_observation_length=60)
    try:
        observation, info = env.reset(seed=0)
    finally:
        env.close()
    actions = info["valid_actions"]
    assert actions == sorted(actions) and len(actions) == len(set(actions)) > 5
    assert all(0 < len(action) <= MAX_ACTION_CHARS for action in actions)
    assert len(observation) <= 60 and set(observation) <= set(string.printable)
    assert info["task"].startswith("You are hungry!")


@pytest.mark.parametrize("game", sorted(GAMES))
def test_the_gold_path_wins_and_the_rewards_add_up_to_the_score(game: str) -> None:
    env = TextWorldExpressEnv(game, GAMES[game].default_params, max_episode_steps=200)
    try:
        _, info = env.reset(seed=1)
        steps, total = 0, 0.0
        assert info["gold_path_length"] > 0 and info["score"] == 0
        while info["gold_action"] is not None:
            assert info["gold_action"] in info["valid_actions"]
            _, reward, terminated, truncated, info = env.step(info["gold_action"])
            steps, total = steps + 1, total + float(reward)
            if terminated or truncated:
                break
        assert terminated and not truncated
        assert info["won"] and not info["lost"] and info["score"] == 1.0
        assert total == pytest.approx(1.0) and steps == info["gold_path_length"]
        assert info["valid_actions"] == [] and info["gold_action"] is None
    finally:
        env.close()


def test_an_action_off_the_gold_path_ends_its_advice(coin: TextWorldExpressEnv) -> None:
    _, info = coin.reset(seed=0)
    off_path = next(a for a in info["valid_actions"] if a != info["gold_action"])
    _, reward, _, _, info = coin.step(off_path)
    assert info["gold_action"] is None and reward == 0


def test_an_episode_is_cut_at_its_step_limit(coin: TextWorldExpressEnv) -> None:
    coin.reset(seed=0)
    for step in range(1, 7):
        _, _, terminated, truncated, _ = coin.step("inventory")
        assert not terminated and truncated == (step == 6)
    with pytest.raises(RuntimeError, match="call reset"):
        coin.step("inventory")


def test_an_action_reaches_the_game_as_one_printable_line(coin: TextWorldExpressEnv) -> None:
    coin.reset(seed=0)
    observation, reward, terminated, _, info = coin.step("look\x1b[2J\n around" + " x" * 500)
    assert reward == 0 and not terminated and set(observation) <= set(string.printable)
    assert info["valid_actions"]
