"""Credit assignment across the turns of an episode, and the baselines of the critic-free
algorithms.

A *credit rule* turns one episode's per-turn rewards into one return per turn:

* ``equal``: the episode return split evenly over its turns (the original LlamaGym rule);
* ``discounted``: the reward-to-go, discounted by ``gamma`` (with ``gamma = 1`` and a
  reward only at the end, every turn gets the episode return);
* ``terminal``: the final turn's reward given to every turn;
* ``gae``: generalised advantage estimation with the value head (PPO only).

Which algorithm accepts which rule (each algorithm's config rejects the others):

============  =====  ==========  ========  ===
algorithm     equal  discounted  terminal  gae
============  =====  ==========  ========  ===
ppo           yes    yes         yes       yes (default)
grpo          yes    yes (def.)  yes       no: needs a value head
rloo          yes    yes (def.)  yes       no: needs a value head
reinforce     yes    yes (def.)  yes       no: needs a value head
============  =====  ==========  ========  ===

The critic-free algorithms (GRPO, RLOO, REINFORCE) take their baseline from the *start*
returns of comparable episodes (turn 0's return under the rule): episodes of one seed
group share their start state, so their start returns estimate its value. Each turn's
advantage is its own return under the rule minus that baseline. The functions below
take one group's per-turn returns (a list per episode) and give per-turn advantages, or
``None`` when the group carries no signal (every start return equal, or too few
episodes to compare).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

CreditRule = Literal["equal", "discounted", "terminal", "gae"]
CREDIT_RULES: tuple[str, ...] = ("equal", "discounted", "terminal", "gae")
RULES_WITHOUT_VALUES: tuple[str, ...] = ("equal", "discounted", "terminal")

# Start returns closer than this count as equal: a group of them teaches nothing.
SIGNAL_TOLERANCE = 1e-8


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
    rewards: Sequence[float],
    values: Sequence[float],
    gamma: float,
    lam: float,
    last_value: float = 0.0,
) -> tuple[list[float], list[float]]:
    """(advantages, returns) for one finished episode. ``last_value`` is the value of the
    state after the last turn: 0 when the episode terminated; for an episode cut off by a
    time limit (truncated), an estimate of it, so the cut is not mistaken for an end."""
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else last_value
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


# -- baselines of the critic-free algorithms -------------------------------------------
def _start_returns(returns: Sequence[Sequence[float]]) -> list[float]:
    return [episode[0] if episode else 0.0 for episode in returns]


def has_signal(start_returns: Sequence[float]) -> bool:
    """At least two episodes, and not all with the same start return."""
    if len(start_returns) < 2:
        return False
    return max(start_returns) - min(start_returns) > SIGNAL_TOLERANCE


def _minus(
    returns: Sequence[Sequence[float]], baselines: Sequence[float], scale: float = 1.0
) -> list[list[float]]:
    return [
        [(value - baseline) / scale for value in episode]
        for episode, baseline in zip(returns, baselines, strict=True)
    ]


def group_normalized(
    returns: Sequence[Sequence[float]], eps: float = 1e-4, scale_by_std: bool = True
) -> list[list[float]] | None:
    """GRPO: ``(G_t - mean) / (std + eps)``, mean and std of the group's start returns.

    The std is the sample (unbiased) one, as in TRL's GRPO trainer.
    """
    start = _start_returns(returns)
    if not has_signal(start):
        return None
    mean = sum(start) / len(start)
    std = math.sqrt(sum((r - mean) ** 2 for r in start) / (len(start) - 1))
    scale = std + eps if scale_by_std else 1.0
    return _minus(returns, [mean] * len(start), scale)


def leave_one_out(returns: Sequence[Sequence[float]]) -> list[list[float]] | None:
    """RLOO: each episode's baseline is the mean start return of the *other* episodes
    of its group, so it never depends on the episode's own actions (unbiased)."""
    start = _start_returns(returns)
    if not has_signal(start):
        return None
    total, others = sum(start), len(start) - 1
    return _minus(returns, [(total - own) / others for own in start])


def minus_batch_mean(returns: Sequence[Sequence[float]]) -> list[list[float]] | None:
    """REINFORCE: one baseline, the mean start return of the whole batch."""
    start = _start_returns(returns)
    if not has_signal(start):
        return None
    mean = sum(start) / len(start)
    return _minus(returns, [mean] * len(start))


def unsupported_credit_message(algorithm: str, rule: str, supported: Sequence[str]) -> str:
    why = " (it has no value head; gae needs one)" if rule == "gae" else ""
    return (
        f"{algorithm} does not support credit rule {rule!r}{why}; "
        f"use one of: {', '.join(supported)}"
    )
