"""PPO on the tiny model: every trainable parameter moves, and it learns a bandit."""

from __future__ import annotations

import math

import torch

from llamagym.schedule import Schedule
from llamagym.testing import BanditAgent, action_probabilities, tiny_agent


def collect_and_update(agent, episodes: int):
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    batch = agent.engine.collect(envs, episodes, group_size=agent.algorithm.group_size)
    return agent.algorithm.update(batch)


def test_every_trainable_parameter_changes_and_loss_is_finite() -> None:
    for mode in ("score", "generate"):
        agent = tiny_agent(rollout={"mode": mode, "max_new_tokens": 4})
        before = {n: p.detach().clone() for n, p in agent.policy.named_parameters()}
        metrics = collect_and_update(agent, 16)
        assert math.isfinite(metrics["policy_loss"]) and math.isfinite(metrics["value_loss"])
        unchanged = [
            name
            for name, parameter in agent.policy.named_parameters()
            if parameter.requires_grad and torch.equal(before[name], parameter.detach())
        ]
        assert unchanged == [], f"{mode} mode left parameters unchanged: {unchanged}"


def test_rollout_and_update_share_the_annealed_temperature() -> None:
    """With final_temperature, the rollout samples at the scheduled temperature and the
    update's first step sees the same policy (ratio 1: the log-probs agree)."""
    agent = tiny_agent(
        rollout={"mode": "score", "temperature": 1.0, "final_temperature": 0.25},
        algorithm={"epochs": 1, "episodes_per_update": 8, "minibatch_size": 8},
    )
    schedule = Schedule(agent.config.rollout)
    schedule.set_progress(0.5)
    assert schedule.temperature() == 0.625
    schedule.set_progress(2.0)
    assert schedule.progress == 1.0 and schedule.temperature() == 0.25  # clamped to the budget
    agent.engine.schedule.set_progress(1.0)
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    batch = agent.engine.collect(envs, 8)
    turns = [turn for episode in batch for turn in episode.turns]
    assert {turn.temperature for turn in turns} == {0.25}  # what the learner reads
    with torch.no_grad():
        scores, _ = agent.policy.score(
            [t.prompt_tokens for t in turns], [t.candidates for t in turns]
        )
        sharp = (scores / 0.25).log_softmax(-1)
        fresh = agent.algorithm.scoring.evaluate(turns).logprobs[:, 0]
    chosen = torch.tensor([t.action_index for t in turns])
    recorded = torch.tensor([t.logprobs[0] for t in turns])
    assert torch.allclose(recorded, sharp[torch.arange(len(turns)), chosen], atol=1e-5)
    assert torch.allclose(fresh, recorded, atol=1e-5)
    assert not torch.allclose(recorded, scores.log_softmax(-1)[torch.arange(len(turns)), chosen])


def test_ppo_learns_the_better_lever_within_ten_updates() -> None:
    agent = tiny_agent(
        BanditAgent,
        rollout={"num_envs": 32},
        algorithm={"episodes_per_update": 64, "minibatch_size": 64, "epochs": 4, "lr": 3e-3},
    )
    assert action_probabilities(agent, 0)[1] < 0.9
    updates = 0
    while updates < 10 and action_probabilities(agent, 0)[1] <= 0.9:
        collect_and_update(agent, 64)
        updates += 1
    assert action_probabilities(agent, 0)[1] > 0.9, f"not learnt after {updates} updates"


def test_kl_reference_starts_equal_and_drifts_after_updates() -> None:
    agent = tiny_agent(algorithm={"kl_coef": 0.1, "episodes_per_update": 16})
    envs = [agent.make_env() for _ in range(8)]
    batch = agent.engine.collect(envs, 16)
    turns = [turn for episode in batch for turn in episode.turns]
    with torch.no_grad():
        reference = agent.algorithm.scoring.reference_logprobs(turns)
        current = agent.algorithm.scoring.evaluate(turns).logprobs
    assert torch.allclose(reference, current, atol=1e-6)
    metrics = agent.algorithm.update(batch)
    assert metrics["kl_ref"] > 0.0
    with torch.no_grad():
        assert not torch.allclose(
            agent.algorithm.scoring.reference_logprobs(turns),
            agent.algorithm.scoring.evaluate(turns).logprobs,
        )
