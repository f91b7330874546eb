"""PPO on the tiny model: every trainable parameter moves, and it learns a bandit."""

from __future__ import annotations

import math

import torch

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
        reference = agent.algorithm.reference_logprobs(turns)
        current = agent.algorithm.evaluate(turns).logprobs
    assert torch.allclose(reference, current, atol=1e-6)
    metrics = agent.algorithm.update(batch)
    assert metrics["kl_ref"] > 0.0
    with torch.no_grad():
        assert not torch.allclose(
            agent.algorithm.reference_logprobs(turns), agent.algorithm.evaluate(turns).logprobs
        )
