"""PPO over turns: clipped surrogate on the action/response tokens, a value head on the
policy's hidden state, GAE across turns, optional KL to the reference policy (the same
weights with the LoRA adapter switched off) and an enforced target-KL early stop.
"""

from __future__ import annotations

import random

import torch
from pydantic import Field

from llamagym.algorithm import Algorithm, AlgorithmConfig, masked_mean, rollout_metrics
from llamagym.credit import CreditRule, gae, turn_returns
from llamagym.trajectory import Episode


class PPOConfig(AlgorithmConfig):
    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    episodes_per_update: int = Field(64, ge=1, description="Episodes collected per update.")
    epochs: int = Field(4, ge=1, description="Passes over each batch.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    clip_range: float = Field(0.2, gt=0, description="PPO ratio clip epsilon.")
    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    entropy_coef: float = Field(0.01, ge=0, description="Weight of the entropy bonus.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of KL to the reference policy.")
    target_kl: float | None = Field(
        None, gt=0, description="Stop the update's epochs when KL(rollout||new) > 1.5x this."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across turns.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    credit: CreditRule = Field("gae", description="Credit rule across turns.")
    normalize_advantages: bool = Field(True, description="Per-batch advantage normalisation.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")


class PPO(Algorithm):
    Config = PPOConfig
    credit_rules = ("gae", "discounted", "equal", "terminal")

    def __init__(self, policy, config: PPOConfig, rollout):
        super().__init__(policy, config, rollout)
        self.optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=config.lr)
        self.early_stops = 0
        self._shuffle = random.Random(0)

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
        turns, advantages, returns = [], [], []
        for episode in episodes:
            rewards = [turn.reward for turn in episode.turns]
            values = [turn.value for turn in episode.turns]
            if config.credit == "gae":
                episode_advantages, episode_returns = gae(
                    rewards, values, config.gamma, config.gae_lambda
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

        sums = {"policy_loss": 0.0, "value_loss": 0.0, "entropy": 0.0, "kl_ref": 0.0,
                "approx_kl": 0.0, "clip_fraction": 0.0}
        steps, stopped, epochs_run = 0, False, 0
        order = list(range(len(turns)))
        for _ in range(config.epochs):
            self._shuffle.shuffle(order)
            epoch_kl, epoch_steps = 0.0, 0
            for start in range(0, len(order), config.minibatch_size):
                index = order[start : start + config.minibatch_size]
                batch = [turns[i] for i in index]
                new = self.evaluate(batch)
                old = self.old_logprobs(batch, new.logprobs.shape[1])
                log_ratio = (new.logprobs - old) * new.mask
                ratio = log_ratio.exp()
                advantage = advantages_t[index][:, None]
                surrogate = torch.max(
                    -advantage * ratio,
                    -advantage * ratio.clamp(1 - config.clip_range, 1 + config.clip_range),
                )
                policy_loss = masked_mean(surrogate, new.mask)
                value_loss = 0.5 * (new.values - returns_t[index]).pow(2).mean()
                entropy = masked_mean(new.entropy, new.mask)
                loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
                kl_ref = torch.zeros((), device=device)
                if config.kl_coef > 0:
                    with torch.no_grad():
                        reference = self.reference_logprobs(batch)
                    delta = (reference - new.logprobs) * new.mask
                    kl_ref = masked_mean(delta.exp() - 1 - delta, new.mask)
                    loss = loss + config.kl_coef * kl_ref
                self.step(self.optimizer, loss, config.max_grad_norm)
                with torch.no_grad():
                    approx_kl = masked_mean((ratio - 1) - log_ratio, new.mask).item()
                    clipped = ((ratio - 1).abs() > config.clip_range).float()
                    sums["clip_fraction"] += masked_mean(clipped, new.mask).item()
                sums["policy_loss"] += policy_loss.item()
                sums["value_loss"] += value_loss.item()
                sums["entropy"] += entropy.item()
                sums["kl_ref"] += kl_ref.item()
                sums["approx_kl"] += approx_kl
                epoch_kl += approx_kl
                epoch_steps += 1
                steps += 1
            epochs_run += 1
            if config.target_kl is not None and epoch_kl / epoch_steps > 1.5 * config.target_kl:
                self.early_stops += 1
                stopped = True
                break
        self.updates += 1
        metrics = {key: value / max(1, steps) for key, value in sums.items()}
        metrics.update(rollout_metrics(episodes))
        metrics.update(
            epochs_run=float(epochs_run),
            target_kl_stop=float(stopped),
            target_kl_stops=float(self.early_stops),
            skipped_steps=float(self.skipped_updates),
            value_mean=float(returns_t.mean()),
        )
        return metrics

    def reference_logprobs(self, turns) -> torch.Tensor:
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            scores, _ = self.policy.score(prompts, [t.candidates for t in turns], reference=True)
            log_policy = (scores / self.rollout.temperature).log_softmax(-1)
            chosen = torch.tensor([t.action_index for t in turns], device=self.policy.device)
            return log_policy.gather(-1, chosen[:, None])
        replies = [turn.action_tokens for turn in turns]
        return self.policy.evaluate_replies(prompts, replies, reference=True).logprobs

