"""PPO over turns: clipped surrogate on the action/response tokens, a value head on the
policy's hidden state, GAE across turns, optional KL to the reference policy (the same
weights with the LoRA adapter switched off) with a fixed or adaptive weight, an enforced
target-KL early stop, and the optional SFT warm-start (``llamagym.plugins.sft``).
"""

from __future__ import annotations

import torch
from pydantic import Field, field_validator

from llamagym.algorithm import (
    Algorithm,
    Stateful,
    check_adaptive_kl,
    clipped_surrogate,
    masked_mean,
    minibatches,
    passes_target_kl,
    reference_kl,
    rollout_metrics,
)
from llamagym.config import RolloutSettings
from llamagym.credit import CREDIT_RULES, CreditRule, gae, turn_returns
from llamagym.plugins.sft import SFTWarmStartConfig, kl_and_warm_start
from llamagym.policy import Policy
from llamagym.trajectory import Episode


class PPOConfig(SFTWarmStartConfig):
    credit_rules = CREDIT_RULES

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    anneal_lr: bool = Field(True, description="Decay the learning rate linearly over the run.")
    episodes_per_update: int = Field(64, ge=1, description="Episodes collected per update.")
    epochs: int = Field(4, ge=1, description="Passes over each batch.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    clip_range: float = Field(0.2, gt=0, description="PPO ratio clip epsilon.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL to the reference policy.")
    adaptive_kl_target: float | None = Field(
        None, gt=0, description="Adapt kl_coef so KL to the reference stays near this."
    )
    adaptive_kl_horizon: int = Field(
        10_000, ge=1, description="Samples over which the adaptive kl_coef moves <= 20%."
    )
    target_kl: float | None = Field(
        None, gt=0, description="Stop the update's epochs when KL(rollout||new) > 1.5x this."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across turns.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    credit: CreditRule = Field("gae", description="Credit rule across turns.")
    normalize_advantages: bool = Field(True, description="Per-batch advantage normalisation.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")

    _adaptive_needs_coef = field_validator("adaptive_kl_target")(check_adaptive_kl)


class PPO(Algorithm):
    Config = PPOConfig
    credit_rules = PPOConfig.credit_rules

    def __init__(self, policy: Policy, config: PPOConfig, rollout: RolloutSettings):
        super().__init__(policy, config, rollout)
        self.optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=config.lr)
        self.kl, self.warm_start = kl_and_warm_start(self, config)

    def stateful_parts(self) -> dict[str, Stateful | None]:
        return {"kl_controller": self.kl, "warm_start": self.warm_start}

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
        lr = self.annealed_lr(config.lr, config.anneal_lr)
        # 1. Advantages and value targets per turn, under the credit rule.
        turns, advantages, returns = [], [], []
        for episode in episodes:
            rewards = [turn.reward for turn in episode.turns]
            values = [turn.value for turn in episode.turns]
            if config.credit == "gae":
                # A truncated episode's last state had a future: its value stands in
                # for the unseen next state's (one step of bootstrap, no extra forward).
                last_value = values[-1] if episode.truncated and values else 0.0
                episode_advantages, episode_returns = gae(
                    rewards, values, config.gamma, config.gae_lambda, last_value
                )
            else:
                episode_returns = turn_returns(rewards, config.credit, config.gamma)
                episode_advantages = [r - v for r, v in zip(episode_returns, values, strict=True)]
            turns += episode.turns
            advantages += episode_advantages
            returns += episode_returns
        device = self.policy.device
        advantages_t = torch.tensor(advantages, device=device)
        returns_t = torch.tensor(returns, device=device)
        if config.normalize_advantages and len(turns) > 1:
            advantages_t = (advantages_t - advantages_t.mean()) / (advantages_t.std() + 1e-8)

        # 2. The reference never moves during the update: score it once.
        reference = None
        if self.kl.coef > 0:
            reference = self.reference_logprob_lists(turns, config.minibatch_size)

        # 3. Clipped-surrogate epochs over minibatches of turns, stopped by target-KL.
        sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "kl_ref": 0.0,
                "approx_kl": 0.0, "clip_fraction": 0.0}
        steps, epochs_run, stopped, interrupted = 0, 0, False, False
        order = list(range(len(turns)))
        steps_per_epoch = self.minibatch_count(len(turns), config.minibatch_size)
        for epoch in range(config.epochs):
            epochs_run += 1
            self.epoch_started(epoch + 1, config.epochs)
            self.rng.shuffle(order)
            for index in minibatches(order, config.minibatch_size, steps_per_epoch):
                if self.stop_requested():
                    interrupted = True  # asked to stop: the steps taken so far stand
                    break
                batch = [turns[i] for i in index]
                new = self.evaluate(batch)
                width = new.logprobs.shape[1]
                surrogate = clipped_surrogate(
                    new, self.old_logprobs(batch, width), advantages_t[index], config.clip_range
                )
                if passes_target_kl(surrogate.approx_kl, config.target_kl):
                    stopped = True  # this step would move further from the rollout policy
                    break
                value_loss = 0.5 * (new.values - returns_t[index]).pow(2).mean()
                entropy = masked_mean(new.entropy, new.mask)
                loss = (
                    surrogate.loss + config.value_coef * value_loss - config.entropy_coef * entropy
                )
                kl_ref = torch.zeros((), device=device)
                if reference is not None:
                    reference_t = self.padded([reference[i] for i in index], width)
                    kl_ref = reference_kl(new.logprobs, reference_t, new.mask)
                    loss = loss + self.kl.coef * kl_ref
                self.step(self.optimizer, loss, config.max_grad_norm)
                steps += 1
                sums["policy_loss"] += surrogate.loss.item()
                sums["value_loss"] += value_loss.item()
                sums["entropy"] += entropy.item()
                sums["kl_ref"] += kl_ref.item()
                sums["approx_kl"] += surrogate.approx_kl
                sums["clip_fraction"] += surrogate.clip_fraction
            if stopped:
                self.target_kl_stops += 1
                break
            if interrupted:
                break
        metrics = {key: value / max(1, steps) for key, value in sums.items()}
        if reference is not None:
            self.kl.update(metrics["kl_ref"], len(turns))
        self.updates += 1

        # 4. Optional supervised steps on the best episodes seen so far.
        if self.warm_start is not None:
            metrics.update(self.warm_start.after_update(episodes))
        metrics.update(rollout_metrics(episodes))
        metrics.update(
            policy_steps=float(steps),
            epochs_run=float(epochs_run),
            target_kl_stop=float(stopped),
            update_interrupted=float(interrupted or bool(metrics.get("update_interrupted"))),
            target_kl_stops=float(self.target_kl_stops),
            kl_coef=self.kl.coef,
            skipped_steps=float(self.skipped_updates),
            value_mean=float(returns_t.mean()),
            lr=lr,
        )
        return metrics
