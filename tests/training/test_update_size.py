"""Updates that fit the budget: a time budget that would hold fewer than
``training.min_updates`` updates at the first one's cost gets fewer episodes per update;
the choice is said, kept in config.yaml and by a resumed run, and a size the user set is
never changed."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace
from typing import Any

import gymnasium
import yaml

from llamagym import Agent, hookimpl
from llamagym.testing import temporary_plugin
from llamagym.training.loop.update_size import (
    MIN_EPISODES,
    first_collection_enough,
    fitted_episodes,
)
from llamagym.training.records.run_files import read_metrics

FAST = ["--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
        "--set", "algorithm.minibatch_size=8", "--set", "algorithm.epochs=1"]
STEP_SECONDS = 0.05


class Slow(gymnasium.Env):
    """One-step episodes that take their time."""

    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: int):
        time.sleep(STEP_SECONDS)
        return 0, float(action), True, False, {}


class SlowAgent(Agent):
    name = "slow"
    action_names = ("zero", "one")
    defaults = {"rollout": {"mode": "score"}, "algorithm": {"episodes_per_update": 32}}

    def format_observation(self, observation: Any) -> str:
        return "Pick one."

    def make_env(self) -> Slow:
        return Slow()

    baselines = {"one": lambda *_: "one"}


class SlowPlugin:
    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register("slow", f"{__name__}:SlowAgent")


def test_the_size_that_fits_is_fewer_never_more() -> None:
    # 64 episodes in 120 s; the 480 s left hold 4 more such updates: 14 need 18 episodes
    # each (21, from the whole 600 s, would make 13 updates in all).
    assert fitted_episodes(64, 120.0, 600.0, 15) == 18
    assert fitted_episodes(64, 30.0, 600.0, 15) is None  # 20 updates fit already
    assert fitted_episodes(64, 600.0, 600.0, 15) == MIN_EPISODES  # never below the floor
    assert fitted_episodes(64, 120.0, 600.0, 15, group_size=8) == 16  # whole groups
    assert fitted_episodes(64, 120.0, 600.0, 1) is None  # one update: nothing to fit
    assert fitted_episodes(4, 120.0, 600.0, 15) is None  # nothing smaller is allowed
    # A first update cut to 16 episodes (30 s) sizes the rest of a 64-episode default.
    assert fitted_episodes(16, 30.0, 600.0, 15, wanted=64) == 21
    assert fitted_episodes(16, 5.0, 600.0, 15, wanted=64) is None  # 64 fit: kept


def test_a_first_collection_ends_at_its_share_of_the_budget() -> None:
    class Run:  # what first_collection_enough reads of an agent
        config = SimpleNamespace(training=SimpleNamespace(min_updates=15, backend="native"))
        resolved = SimpleNamespace(sources={})

    now = [0.0]
    enough = first_collection_enough(Run(), 600.0, resumed=False, clock=lambda: now[0])
    assert enough is not None
    now[0] = 39.0  # 600 s hold 15 updates of 40 s
    assert not enough(32)
    now[0] = 40.0
    assert not enough(MIN_EPISODES - 1) and enough(MIN_EPISODES)
    assert first_collection_enough(Run(), 600.0, resumed=True) is None
    assert first_collection_enough(Run(), None, resumed=False) is None
    Run.resolved.sources["algorithm.episodes_per_update"] = "--set"
    assert first_collection_enough(Run(), 600.0, resumed=False) is None


def test_a_short_budget_gets_smaller_updates_kept_by_config_and_resume(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    with temporary_plugin(SlowPlugin(), "slow-plugin"):
        code, _, err = cli("run", "slow", "--minutes", "0.15", "-o", run_dir, *FAST)
        assert code == 0, err
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
        fitted = config["algorithm"]["episodes_per_update"]
        assert MIN_EPISODES <= fitted < 32
        assert "fitted to the time budget" in (run_dir / "config.yaml").read_text()
        assert f"update size: {fitted} episodes per update, not 32" in " ".join(err.split())
        updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
        # The first update ended at its share of the 9 s (0.6 s), with what had finished.
        assert len(updates) >= 2 and MIN_EPISODES <= updates[0]["episodes"] < 32
        assert all(r["episodes"] == fitted for r in updates[1:])

        # A resumed run keeps the size its checkpoint holds, and says nothing of it.
        code, _, err = cli("run", "slow", "--minutes", "0.3", "--resume", run_dir, *FAST)
        assert code == 0, err
        assert "update size:" not in err
        later = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
        assert len(later) > len(updates)
        assert all(r["episodes"] == fitted for r in later[len(updates):])


def test_a_size_the_user_set_is_kept(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    with temporary_plugin(SlowPlugin(), "slow-plugin"):
        code, _, err = cli("run", "slow", "--minutes", "0.1", "-o", run_dir, *FAST,
                           "--set", "algorithm.episodes_per_update=32")
    assert code == 0, err
    assert "update size:" not in err
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and all(r["episodes"] == 32 for r in updates)


def test_a_warm_start_counts_in_the_time_budget_and_says_when_it_takes_most(tmp_path,
                                                                           cli) -> None:
    # 120 baseline episodes of 0.05 s each: 6 s of the 9 s budget, before update 1.
    run_dir = tmp_path / "run"
    with temporary_plugin(SlowPlugin(), "slow-plugin"):
        code, _, err = cli("run", "slow", "--minutes", "0.15", "-o", run_dir, *FAST,
                           "--warm-start", "one",
                           "--set", "algorithm.warm_start.baseline_episodes=120",
                           "--set", "algorithm.warm_start.demonstration_epochs=1")
    assert code == 0, err
    said = " ".join(err.split())
    assert "warm start: it took" in said and "of the 0.15 min budget" in said
    assert "--set algorithm.warm_start.demonstration_epochs=..., now 1" in said
    updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert updates and updates[0]["seconds"] >= 120 * STEP_SECONDS  # the clock ran
    # The run ends within its budget (and the update it was in), warm start included.
    assert updates[-1]["seconds"] < 9.0 + 4.0


def _stopped_after(said: str) -> int:
    """The batches a warm start's 'stopped after N of M batches' warning names."""
    return int(re.search(r"warm start: stopped after (\d+) of \d+ batches", said).group(1))


def test_a_warm_start_stops_at_half_the_budget_and_a_resume_takes_as_many_batches(
        tmp_path, cli) -> None:
    # A thousand passes over the demonstrations cannot fit in 6 s: the warm start ends at
    # 3 s, RL gets the rest, and the resumed run trains on the same batches again before
    # its checkpoint loads (so its weights and KL reference are the unbroken run's).
    run_dir = tmp_path / "run"
    warm = ["--warm-start", "one", "--set", "algorithm.warm_start.baseline_episodes=8",
            "--set", "algorithm.warm_start.demonstration_epochs=1000",
            "--set", "algorithm.warm_start.batch_size=1"]
    with temporary_plugin(SlowPlugin(), "slow-plugin"):
        code, _, err = cli("run", "slow", "--minutes", "0.1", "-o", run_dir, *FAST, *warm)
        assert code == 0, err
        said = " ".join(err.split())
        assert "at the share of the time budget a warm start may take" in said
        batches = _stopped_after(said)
        assert 0 < batches < 8 * 1000
        updates = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]
        assert updates and updates[-1]["seconds"] < 6.0 + 3.0
        code, _, err = cli("run", "slow", "--minutes", "0.2", "--resume", run_dir, *FAST)
    assert code == 0, err
    said = " ".join(err.split())
    assert "as the run it continues did" in said and _stopped_after(said) == batches
