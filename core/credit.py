"""Credit assignment across the turns of an episode.

Each function takes one episode's per-turn rewards and returns one number per turn:

* ``equal``: the episode return split evenly over its turns (the original LlamaGym rule);
* ``discounted``: the reward-to-go, discounted by ``gamma``;
* ``terminal``: the final turn's reward given to every turn;
* ``gae``: generalised advantage estimation with the value head (PPO only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

CreditRule = Literal["equal", "discounted", "terminal", "gae"]


def equal_split(rewards: Sequence[float]) -> list[float]:
    if not rewards:
        return []
    share = sum(rewards) / len(rewards)
    return [share] * len(rewards)


def discounted_returns(rewards: Sequence[float], gamma: float) -> list[float]:
    returns, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        returns[t] = running
    return returns


def terminal_reward(rewards: Sequence[float]) -> list[float]:
    return [rewards[-1]] * len(rewards) if rewards else []


def gae(
    rewards: Sequence[float], values: Sequence[float], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """(advantages, returns) for one finished episode; the state after the last turn
    is terminal, so its value is zero."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    returns = [a + v for a, v in zip(advantages, values, strict=True)]
    return advantages, returns


def turn_returns(rewards: Sequence[float], rule: CreditRule, gamma: float = 1.0) -> list[float]:
    """The per-turn return under ``rule`` (not ``gae``, which needs values)."""
    if rule == "equal":
        return equal_split(rewards)
    if rule == "discounted":
        return discounted_returns(rewards, gamma)
    if rule == "terminal":
        return terminal_reward(rewards)
    raise ValueError(f"credit rule {rule!r} needs a value function; use gae() for it")
