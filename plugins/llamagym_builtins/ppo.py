"""PPO over turns: clipped surrogate on the action/response tokens, a value head on the
policy's hidden state, GAE across turns, optional KL to the reference policy (the same
weights with the LoRA adapter switched off) with a fixed or adaptive weight, an enforced
target-KL early stop, and the optional SFT warm-start (``llamagym_builtins.sft``). The
epochs are the shared clipped-policy-gradient loop (``Algorithm.optimise``) with the
value loss as an extra term.
"""

from __future__ import annotations

import torch
from pydantic import Field

from llamagym.algorithms.algorithm import Algorithm, AlgorithmContext
from llamagym.algorithms.credit import CREDIT_RULES, gae, turn_returns
from llamagym.algorithms.kl_control import KLController
from llamagym.algorithms.losses import LossTerm, entropy_bonus, reference_penalty
from llamagym.models.policy import Evaluation
from llamagym.rollout.trajectory import Episode
from llamagym.schedule import LearningRate
from llamagym_builtins.clipped_config import ClippedConfig
from llamagym_builtins.sft import WarmStart


class PPOConfig(ClippedConfig):
    credit_rules = CREDIT_RULES

    value_coef: float = Field(0.5, ge=0, description="Weight of the value loss.")
    gae_lambda: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    normalize_advantages: bool = Field(True, description="Per-batch advantage normalisation.")


class PPO(Algorithm):
    Config = PPOConfig
    credit_rules = PPOConfig.credit_rules
    config: PPOConfig

    learning_rate: LearningRate
    kl: KLController

    def __init__(self, context: AlgorithmContext):
        super().__init__(context)
        config, policy = self.config, self.policy
        self.optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=config.lr)
        self.learning_rate = LearningRate(
            context.schedule, config.lr, config.anneal_lr, config.warmup_steps
        )
        self.kl = KLController.from_config(config)
        self.sft = WarmStart.create(self, config.warm_start)

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
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

        # 2. Clipped-surrogate epochs. The loss: the surrogate, the value head regressed
        #    on the returns, the entropy bonus and the KL to the reference.
        def value_loss(index: list[int], new: Evaluation) -> torch.Tensor:
            return 0.5 * (new.values - returns_t[index]).pow(2).mean()

        terms = [
            LossTerm("value_loss", config.value_coef, value_loss),
            entropy_bonus(config.entropy_coef),
            reference_penalty(self.scoring, self.kl.coef),
        ]
        result = self.optimise(turns, advantages_t, terms)
        # 3. Optional supervised steps on the best episodes seen so far; the metrics.
        metrics = self.finish_update(episodes, result)
        # The rate of the update's last step (the warmup's share of the scheduled one).
        lr = self.learning_rate.at(self.optimizer_steps)
        metrics.update(value_mean=float(returns_t.mean()), lr=lr)
        return metrics
