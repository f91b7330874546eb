"""Evaluation: the trained agent and its baselines on the same episode seeds."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from llamagym.rollout.trajectory import Episode

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes never reuse training seeds


@dataclass
class EvalResult:
    name: str
    episodes: int
    mean: float
    ci95: float
    invalid_rate: float = 0.0
    outcomes: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarise(name: str, returns: Sequence[float], invalid_rate: float = 0.0) -> EvalResult:
    values = np.asarray(returns, dtype=float)
    n = len(values)
    mean = float(values.mean()) if n else float("nan")
    ci95 = float(1.96 * values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    outcomes = {}
    if n and set(np.unique(values)).issubset({-1.0, 0.0, 1.0, 1.5}):
        outcomes = {
            "win": float((values > 0).mean()),
            "draw": float((values == 0).mean()),
            "loss": float((values < 0).mean()),
        }
    return EvalResult(name, n, mean, ci95, invalid_rate, outcomes)


def evaluation_seeds(seed: int, episodes: int) -> list[int]:
    return [EVAL_SEED_OFFSET + seed * 100_003 + k for k in range(episodes)]


def evaluate_agent(
    agent: Any,
    episodes: int,
    seed: int = 0,
    greedy: bool = True,
    examples: list[Episode] | None = None,
) -> EvalResult:
    """Run the agent's policy (greedy by default) on ``episodes`` seeded episodes, with
    an engine of its own: these episodes reach no training observer (``episode_end``)
    and leave the training engine's random streams where they were. ``examples``, when
    given, receives the episodes played (in seed order), e.g. for transcripts."""
    import torch

    engine = agent.evaluation_engine()
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    policy = agent.policy
    was_training = policy.training
    policy.eval()
    try:
        with torch.no_grad(), engine.greedy_memo():
            finished: list[Episode] = engine.collect(
                envs, episodes, greedy=greedy, seeds=evaluation_seeds(seed, episodes)
            )
    finally:
        policy.train(was_training)
        for env in envs:
            env.close()
    turns = sum(len(e.turns) for e in finished)
    invalid = sum(e.invalid_replies for e in finished) / max(1, turns)
    if examples is not None:
        examples += finished
    return summarise("agent", [e.env_return for e in finished], invalid)


@dataclass
class BaselineStep:
    """One decision of a baseline: what it saw, what it chose, what came of it."""

    episode: int  # index of the episode among those played
    observation: Any
    info: dict
    action: str
    reward: float
    done: bool


def play_baseline(
    agent: Any, name: str, seeds: Sequence[int], rng_seed: int = 0
) -> Iterator[BaselineStep]:
    """Play one of the agent's baseline policies, one episode per seed, step by step
    (``rng_seed`` seeds the baseline's own randomness, e.g. the random policy's)."""
    baseline = agent.baselines[name]
    rng = np.random.default_rng(rng_seed)
    env = agent.make_env()
    try:
        for index, episode_seed in enumerate(seeds):
            observation, info = env.reset(seed=episode_seed)
            if hasattr(baseline, "reset"):
                baseline.reset()  # stateful baselines (e.g. a walkthrough) start over
            done = False
            while not done:
                legal = list(agent.named_actions(observation, info))
                action_name = baseline(observation, info, legal, rng)
                action = agent.env_action(legal.index(action_name), legal)
                next_observation, reward, terminated, truncated, next_info = env.step(action)
                done = bool(terminated or truncated)
                yield BaselineStep(index, observation, dict(info), action_name, float(reward), done)
                observation, info = next_observation, next_info
    finally:
        env.close()


def evaluate_baseline(agent: Any, name: str, episodes: int, seed: int = 0) -> EvalResult:
    """Play one of the agent's baseline policies on the evaluation seeds."""
    returns = [0.0] * episodes
    for step in play_baseline(agent, name, evaluation_seeds(seed, episodes), rng_seed=seed):
        returns[step.episode] += step.reward
    return summarise(name, returns)
