"""Failing environments and non-finite numbers: the run goes on or stops cleanly, and
nothing trained on is corrupt."""

from __future__ import annotations

import math

import pytest
import torch

from llamagym.errors import EnvFailureError, TrainingDivergedError
from llamagym.testing import BanditAgent, TwoArmedBandit, tiny_agent
from llamagym.training.loop.trainer import Trainer


class FlakyBandit(TwoArmedBandit):
    """Raises in ``step`` on every ``fail_every``-th call, in ``reset`` when told."""

    calls = 0
    made = 0
    fail_every = 3
    fail_reset = False

    def __init__(self):
        FlakyBandit.made += 1

    def reset(self, *, seed=None, options=None):
        if FlakyBandit.fail_reset:
            raise ConnectionError("simulator went away")
        return super().reset(seed=seed, options=options)

    def step(self, action):
        FlakyBandit.calls += 1
        if FlakyBandit.calls % FlakyBandit.fail_every == 0:
            raise RuntimeError("physics exploded")
        return super().step(action)


class FlakyAgent(BanditAgent):
    def make_env(self):
        return FlakyBandit()


class HugeRewardBandit(TwoArmedBandit):
    """Finite rewards whose sums overflow: the loss of any update is not finite."""

    def step(self, action):
        observation, _, terminated, truncated, info = super().step(action)
        return observation, 1.7e308 * (1 if action else -1), terminated, truncated, info


class HugeRewardAgent(BanditAgent):
    def make_env(self):
        return HugeRewardBandit()


@pytest.fixture(autouse=True)
def _reset_counters():
    FlakyBandit.calls, FlakyBandit.made, FlakyBandit.fail_every = 0, 0, 3
    FlakyBandit.fail_reset = False


def test_failing_step_drops_the_episode_and_recreates_the_env(caplog) -> None:
    agent = tiny_agent(FlakyAgent, rollout={"num_envs": 2})
    envs = [agent.make_env() for _ in range(2)]
    episodes = agent.engine.collect(envs, 12)
    assert len(episodes) == 12 - agent.engine.stats.env_failures
    assert agent.engine.stats.env_failures == FlakyBandit.calls // 3 > 0
    assert FlakyBandit.made == 2 + agent.engine.stats.env_failures  # one new env per failure
    assert all(len(e.turns) == 1 and math.isfinite(e.env_return) for e in episodes)
    assert "physics exploded" in caplog.text


def test_the_engine_owns_its_env_pool_sized_by_num_envs() -> None:
    FlakyBandit.fail_every = 10**9  # no failure: every env the pool makes is counted
    closed: list[object] = []
    agent = tiny_agent(FlakyAgent, rollout={"num_envs": 3})
    engine = agent.engine
    assert FlakyBandit.made == 0  # made on first use
    assert len(engine.play(7)) == 7
    pool = list(engine.envs)
    assert len(pool) == 3 == FlakyBandit.made == len({id(env) for env in pool})
    engine.play(4)
    assert engine.envs == pool and FlakyBandit.made == 3  # kept across collections
    for env in pool:
        env.close = lambda env=env: closed.append(env)
    engine.close()
    assert closed == pool
    engine.play(1)
    assert FlakyBandit.made == 6  # a closed pool is made again


def test_a_failed_env_is_replaced_inside_the_pool() -> None:
    agent = tiny_agent(FlakyAgent, rollout={"num_envs": 2})
    episodes = agent.engine.play(12)
    failures = agent.engine.stats.env_failures
    assert failures > 0 and len(episodes) == 12 - failures
    assert len(agent.engine.envs) == 2 and FlakyBandit.made == 2 + failures


def test_too_many_failures_in_a_row_stop_with_a_checkpoint(tmp_path) -> None:
    FlakyBandit.fail_reset = True
    agent = tiny_agent(
        FlakyAgent,
        training={"max_env_failures": 2},
        output={"dir": str(tmp_path / "run"), "quiet": True},
    )
    with pytest.raises(EnvFailureError) as raised:
        Trainer(agent, agent.session).run()
    message = str(raised.value)
    assert "simulator went away" in message and "--resume" in message
    assert list((tmp_path / "run" / "checkpoints").iterdir())


def test_non_finite_loss_skips_the_update_and_stops_after_a_few(tmp_path) -> None:
    agent = tiny_agent(
        HugeRewardAgent,
        training={"episodes": 200, "max_skipped_updates": 2},
        output={"dir": str(tmp_path / "run"), "quiet": True},
    )
    before = {n: p.detach().clone() for n, p in agent.policy.named_parameters()}
    with pytest.raises(TrainingDivergedError, match="2 updates in a row"):
        Trainer(agent, agent.session).run()
    for name, parameter in agent.policy.named_parameters():
        assert torch.equal(before[name], parameter.detach()), f"{name} was corrupted"
    assert agent.algorithm.skipped_updates > 0
