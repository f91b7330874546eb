"""Stopping a run on time and on signals between env steps and minibatches: the time
budget cuts a collection short (its batch dropped, the checkpoint the last update's),
a stop request ends an update at a minibatch boundary, and speeds print readably."""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from llamagym import hookimpl
from llamagym.algorithms.algorithm import Algorithm
from llamagym.testing import temporary_plugin
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.checkpoint.state import decode_state
from llamagym.training.loop import run_state, update_metrics
from llamagym.training.loop import trainer as training
from llamagym.training.loop.progress import format_stats
from llamagym.training.records.report import format_speed
from llamagym.training.records.run_files import read_metrics

# Blackjack on the tiny model, 8 episodes per update, single-threaded: bit-for-bit
# repeatable. No learning-rate annealing: with a time budget the schedule would read
# the wall clock, and two runs could not be compared exactly.
FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=2", "--set", "algorithm.anneal_lr=false",
]
TIMING = {"seconds", "env_steps_per_second"}


def updates_of(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in record.items() if k not in TIMING}
        for record in read_metrics(run_dir / "metrics.jsonl")
        if record["kind"] == "update"
    ]


def saved_state(checkpoint: Path) -> dict:
    from safetensors.torch import load_file

    meta = checkpoints.read_meta(checkpoint)
    tensors = load_file(str(checkpoint / checkpoints.STATE_TENSORS))
    return decode_state(meta["state"], tensors)


def test_speeds_below_ten_keep_their_decimals() -> None:
    assert format_speed(0.42) == "0.42 steps/s"
    assert format_speed(5.3) == "5.3 steps/s"
    assert format_speed(543) == "543 steps/s"
    assert format_speed(12_345.6) == "12,346 steps/s"
    assert format_speed(0) == "0.00 steps/s"
    assert "0.42 steps/s" in format_stats({"env_steps_per_second": 0.42})


def test_time_budget_stops_inside_the_first_collection(tmp_path, caplog) -> None:
    """A collection far longer than the budget: the run stops inside it, drops the
    episodes it finished, checkpoints the untrained state and still evaluates."""
    from llamagym.testing import BanditAgent, tiny_agent

    wanted = 1_000_000  # one-step episodes, 4 at a time: hours on the tiny model
    agent = tiny_agent(
        BanditAgent,
        training={"threads": 1, "episodes": None, "minutes": 0.01, "eval_episodes": 8},
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": wanted, "minibatch_size": 8, "epochs": 1},
        output={"dir": str(tmp_path), "quiet": True},
    )
    initial_engine = agent.engine.state_dict()
    initial_weights = {k: v.clone() for k, v in checkpoints.trainable_state(agent.policy).items()}
    with caplog.at_level(logging.WARNING, logger="llamagym"):
        summary = training.Trainer(agent, agent.session).run()

    assert summary.interrupted is None  # a budget end, not a signal
    assert summary.updates == 0 and summary.episodes == 0 and summary.env_steps == 0
    assert 0 < summary.dropped_episodes < wanted
    assert f"its {summary.dropped_episodes} finished episode(s) (of {wanted})" in caplog.text
    assert "time budget used up during the collection of update 1" in caplog.text
    # The checkpoint is the state before any update: untrained weights, and the
    # engine's random streams as they were before the dropped collection drew from them.
    assert summary.checkpoint == tmp_path / "checkpoints" / "update-000000"
    meta = checkpoints.read_meta(summary.checkpoint)
    assert meta["counters"]["updates"] == 0 and meta["counters"]["episodes"] == 0
    engine = saved_state(summary.checkpoint)["engine"]
    assert engine["rng"] == initial_engine["rng"]
    assert torch.equal(engine["generator"], initial_engine["generator"])
    saved = saved_weights(summary.checkpoint)
    assert saved.keys() == initial_weights.keys()
    assert all(torch.equal(saved[name], initial_weights[name]) for name in initial_weights)
    # The evaluation ran, as at any budget end; no update was recorded.
    assert summary.evaluation is not None and summary.evaluation.episodes == 8
    kinds = [r["kind"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert kinds == ["evaluation"]


class FakeClock:
    """Stands in for the ``time`` module where the training loop reads the clock
    (llamagym.training.loop.trainer, run_state and update_metrics): real time plus a jump."""

    def __init__(self) -> None:
        self.offset = 0.0

    def perf_counter(self) -> float:
        return time.perf_counter() + self.offset

    @classmethod
    def installed(cls, monkeypatch) -> FakeClock:
        clock = cls()
        for module in (training, run_state, update_metrics):
            monkeypatch.setattr(module, "time", clock)
        return clock


class AtEpisode:
    """Calls ``action`` when the ``episode``-th episode that finishes while update
    ``update`` collects has ended."""

    def __init__(self, update: int, episode: int, action):
        self.update, self.episode, self.action = update, episode, action
        self.updates_done = self.episodes_seen = 0

    @hookimpl
    def llamagym_update_end(self, agent, update, metrics):
        self.updates_done = update

    @hookimpl
    def llamagym_episode_end(self, agent, episode):
        if self.updates_done == self.update - 1:
            self.episodes_seen += 1
            if self.episodes_seen == self.episode:
                self.action()


def test_run_stopped_by_the_deadline_mid_collection_resumes_like_the_unbroken_run(
    tmp_path, monkeypatch, cli
) -> None:
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    budget = ["--episodes", "32", "--minutes", "1000"]  # 4 updates, well within the time
    code, out, _ = cli("run", "blackjack", *budget, *FAST, "-o", unbroken)
    assert code == 0, out

    # The same run, whose time budget runs out after 3 episodes of update 3's batch.
    clock = FakeClock.installed(monkeypatch)
    with temporary_plugin(AtEpisode(3, 3, lambda: setattr(clock, "offset", 1e9)), "deadline"):
        code, out, err = cli("run", "blackjack", *budget, *FAST, "-o", broken)
    assert code == 0, out + err
    assert "trained 16 episodes" in out and "2 updates" in out
    assert [p.name for p in checkpoints.list_checkpoints(broken)] == ["update-000002"]
    assert updates_of(broken) == updates_of(unbroken)[:2]

    # Continued from its directory, it computes what the unbroken run computed: the
    # dropped collection's random draws were undone before the checkpoint.
    clock.offset = 0.0
    code, out, _ = cli("run", "blackjack", "--resume", broken, "--quiet")
    assert code == 0, out
    assert updates_of(broken) == updates_of(unbroken)
    kinds = [r["kind"] for r in read_metrics(broken / "metrics.jsonl")]
    assert kinds == ["update", "update", "resume", "update", "update"]
    final_unbroken = saved_weights(checkpoints.find_checkpoint(unbroken))
    final_resumed = saved_weights(checkpoints.find_checkpoint(broken))
    assert all(torch.equal(final_unbroken[k], final_resumed[k]) for k in final_unbroken)


def saved_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint / checkpoints.WEIGHTS))


class AfterSteps:
    """Wraps ``Algorithm.apply_gradients``: calls ``action`` after optimizer step ``after``
    of update ``update`` (counted from 1), like `kill` or the deadline during an update."""

    def __init__(self, update: int, after: int, action):
        self.update, self.after, self.action = update, after, action
        self.updates_done = 0
        self.steps = 0

    @hookimpl
    def llamagym_update_end(self, agent, update, metrics):
        self.updates_done = update

    def wrap(self, step):
        def counted(algorithm, *args, **kwargs):
            result = step(algorithm, *args, **kwargs)
            if self.updates_done == self.update - 1:
                self.steps += 1
                if self.steps == self.after:
                    self.action()
            return result

        return counted


def bandit_run(algorithm: str, tmp_path: Path, **training_settings):
    """16 one-turn episodes per update in minibatches of 4 over 3 epochs: 12 steps (GRPO
    keeps the turns of groups without signal for the entropy bonus, so it has all 16)."""
    from llamagym.testing import BanditAgent, tiny_agent

    return tiny_agent(
        BanditAgent,
        training={"threads": 1, "eval_episodes": 8, **training_settings},
        rollout={"num_envs": 4},
        algorithm={"name": algorithm, "episodes_per_update": 16, "minibatch_size": 4,
                   "epochs": 3, "anneal_lr": False, "entropy_coef": 0.01},
        output={"dir": str(tmp_path), "quiet": True},
    )


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_sigterm_during_an_update_ends_it_at_a_minibatch_boundary(
    algorithm, tmp_path, monkeypatch
) -> None:
    agent = bandit_run(algorithm, tmp_path, episodes=64)
    terminate = AfterSteps(update=2, after=2, action=lambda: os.kill(os.getpid(), signal.SIGTERM))
    monkeypatch.setattr(Algorithm, "apply_gradients", terminate.wrap(Algorithm.apply_gradients))
    previous_handler = signal.getsignal(signal.SIGTERM)
    with temporary_plugin(terminate, "terminate"):
        summary = training.Trainer(agent, agent.session).run()

    assert summary.interrupted == "SIGTERM"
    assert summary.updates == 2 and summary.evaluation is None
    assert summary.checkpoint == tmp_path / "checkpoints" / "update-000002"
    assert signal.getsignal(signal.SIGTERM) is previous_handler
    first, second = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "update"]
    assert first["update_interrupted"] == 0.0 and first["policy_steps"] == 12.0
    # Two steps taken, the third never started; the first epoch did not finish.
    assert second["update_interrupted"] == 1.0 and second["policy_steps"] == 2.0
    assert second["epochs_run"] == 1.0
    # The checkpoint holds the weights after exactly those two steps.
    saved = saved_weights(summary.checkpoint)
    current = checkpoints.trainable_state(agent.policy)
    assert saved.keys() == current.keys()
    assert all(torch.equal(saved[k], current[k]) for k in saved)
    assert checkpoints.read_meta(summary.checkpoint)["counters"]["episodes"] == 32


def test_the_time_budget_ends_the_first_update_at_a_minibatch_boundary(
    tmp_path, monkeypatch
) -> None:
    """A long update does not overrun the budget: it stops after the step in which time
    ran out, keeps those steps' weights, and the run then evaluates as usual."""
    agent = bandit_run("ppo", tmp_path, episodes=64, minutes=1000)
    clock = FakeClock.installed(monkeypatch)
    deadline = AfterSteps(update=1, after=3, action=lambda: setattr(clock, "offset", 1e9))
    monkeypatch.setattr(Algorithm, "apply_gradients", deadline.wrap(Algorithm.apply_gradients))
    with temporary_plugin(deadline, "deadline"):
        summary = training.Trainer(agent, agent.session).run()

    assert summary.interrupted is None and summary.updates == 1 and summary.episodes == 16
    assert summary.evaluation is not None and summary.evaluation.episodes == 8
    [update] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "update"]
    # 12 steps were due (16 turns in minibatches of 4, 3 epochs); the fourth never started.
    assert update["update_interrupted"] == 1.0 and update["policy_steps"] == 3.0
    assert summary.checkpoint is not None
    saved = saved_weights(summary.checkpoint)
    current = checkpoints.trainable_state(agent.policy)
    assert saved.keys() == current.keys()
    assert all(torch.equal(saved[k], current[k]) for k in saved)


def test_algorithm_without_a_stop_check_runs_every_step() -> None:
    """Outside a trainer an update runs to its end; a run's Control stops it."""
    from llamagym.schedule import Control
    from llamagym.testing import BanditAgent, tiny_agent

    agent = tiny_agent(BanditAgent, algorithm={"episodes_per_update": 8, "minibatch_size": 4,
                                               "epochs": 2})
    batch = agent.engine.collect([agent.make_env() for _ in range(4)], 8)
    metrics = agent.algorithm.update(batch)
    assert metrics["update_interrupted"] == 0.0 and metrics["policy_steps"] == 4.0
    seen: list[tuple[int, int]] = []
    run = agent.start_run(Control(on_epoch=lambda epoch, epochs: seen.append((epoch, epochs))))
    metrics = run.algorithm.update(batch)
    assert metrics["update_interrupted"] == 0.0 and metrics["policy_steps"] == 4.0
    assert seen == [(1, 2), (2, 2)]
    run = agent.start_run(Control(should_stop=lambda: True))
    metrics = run.algorithm.update(batch)
    assert metrics["update_interrupted"] == 1.0 and metrics["policy_steps"] == 0.0


def test_collect_stops_when_asked_and_returns_the_finished_episodes() -> None:
    from llamagym.testing import BanditAgent, tiny_agent

    agent = tiny_agent(BanditAgent)
    envs = [agent.make_env() for _ in range(4)]
    calls = []

    def stop_after_three_steps() -> bool:
        calls.append(1)
        return len(calls) >= 3

    batch = agent.engine.collect(envs, 100, should_stop=stop_after_three_steps)
    assert len(calls) == 3
    assert len(batch) == 12  # one-step episodes, 4 envs, 3 steps
    assert len({episode.seed for episode in batch}) == 12
    assert np.isfinite([episode.env_return for episode in batch]).all()




@pytest.mark.parametrize("stop", ["time budget", "SIGINT"])
def test_a_long_generation_stops_between_tokens(stop, tmp_path, monkeypatch, caplog) -> None:
    """Replies of 4,096 tokens that never end early: the budget or a signal ends the
    generation between tokens, and the run stops as it does between env steps (the
    cut batch dropped, the checkpoint the last completed update's)."""
    import threading

    from llamagym.models import generation
    from llamagym.testing import BanditAgent, tiny_agent

    budget = 0.02 if stop == "time budget" else 1000  # minutes
    agent = tiny_agent(
        BanditAgent,
        training={"threads": 1, "episodes": None, "minutes": budget, "eval_episodes": 0},
        rollout={"num_envs": 2, "mode": "generate", "max_new_tokens": 4096},
        algorithm={"episodes_per_update": 4, "minibatch_size": 4, "epochs": 1},
        output={"dir": str(tmp_path), "quiet": True},
    )
    # No reply closes its JSON object or says the end-of-turn token: each runs 4,096 tokens.
    monkeypatch.setattr(generation, "closes_json", lambda text: False)
    agent.policy.eos_id = len(agent.policy.tokenizer) + 1000
    trainer = training.Trainer(agent, agent.session)
    if stop == "SIGINT":
        interrupt = threading.Timer(1.2, os.kill, (os.getpid(), signal.SIGINT))
        interrupt.start()
    with caplog.at_level(logging.WARNING, logger="llamagym"):
        summary = trainer.run()
    # On the run's own clock, within a few seconds of the budget (or of the signal),
    # with the first generation cut before its 4,096 tokens (2 rows).
    assert summary.seconds < 1.2 + 5
    assert agent.policy.head_positions < 2 * 4096
    assert summary.updates == 0 and summary.episodes == 0 and summary.dropped_episodes == 0
    assert summary.interrupted == (None if stop == "time budget" else "SIGINT")
    used_up = "time budget used up" if stop == "time budget" else "SIGINT received"
    assert f"{used_up} during the collection of update 1" in caplog.text
    assert summary.checkpoint == tmp_path / "checkpoints" / "update-000000"
    assert not [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "update"]


def test_signal_during_a_collection_drops_the_batch_and_skips_the_evaluation(tmp_path) -> None:
    from llamagym.testing import BanditAgent, tiny_agent

    agent = tiny_agent(
        BanditAgent,
        training={"threads": 1, "episodes": 64, "eval_episodes": 8},
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": 16, "minibatch_size": 8, "epochs": 1},
        output={"dir": str(tmp_path), "quiet": True},
    )
    with temporary_plugin(AtEpisode(2, 5, lambda: os.kill(os.getpid(), signal.SIGINT)), "ctrl-c"):
        summary = training.Trainer(agent, agent.session).run()
    assert summary.interrupted == "SIGINT" and summary.evaluation is None
    assert summary.updates == 1 and summary.episodes == 16
    assert summary.dropped_episodes == 8  # two 4-env steps of one-step episodes
    assert summary.checkpoint == tmp_path / "checkpoints" / "update-000001"
    assert [r["kind"] for r in read_metrics(tmp_path / "metrics.jsonl")] == ["update"]


@pytest.mark.parametrize(("lr", "warned"), [(3.0, True), (1e-6, False)])
def test_a_first_update_that_moves_the_policy_far_is_one_warning(
    tmp_path, cli, caplog, lr: float, warned: bool
) -> None:
    code, _, _ = cli(
        "run", "blackjack", "--episodes", "16", "--output", tmp_path / "run", *FAST,
        "--set", f"algorithm.lr={lr}", "--set", "algorithm.anneal_lr=false",
    )
    assert code == 0
    first = updates_of(tmp_path / "run")[0]
    lines = [r.getMessage() for r in caplog.records if "moved the policy far" in r.getMessage()]
    assert (first["approx_kl"] > update_metrics.SANE_UPDATE_KL) == warned
    assert len(lines) == (1 if warned else 0)
    if warned:
        assert f"lower algorithm.lr (now {lr:g})" in lines[0] and "target_kl=0.02" in lines[0]
