"""Credit rules and the critic-free baselines against numbers worked out by hand."""

from __future__ import annotations

import math

import pytest

from llamagym.algorithms.credit import (
    discounted_returns,
    equal_split,
    gae,
    group_normalized,
    has_signal,
    leave_one_out,
    minus_batch_mean,
    terminal_reward,
    turn_returns,
)
from llamagym.algorithms.kl_control import KLController
from llamagym.rollout.trajectory import Episode


def close(actual, expected, tol: float = 1e-6) -> bool:
    if isinstance(expected, list):
        return len(actual) == len(expected) and all(
            close(a, e, tol) for a, e in zip(actual, expected, strict=True)
        )
    return abs(actual - expected) < tol


# -- credit rules ------------------------------------------------------------------------
def test_equal_split_shares_the_return() -> None:
    assert equal_split([0.0, 0.0, 3.0]) == [1.0, 1.0, 1.0]
    assert equal_split([]) == []


def test_discounted_is_the_reward_to_go() -> None:
    # t=2: 2; t=1: 0 + 0.5 * 2 = 1; t=0: 1 + 0.5 * 1 = 1.5
    assert close(discounted_returns([1.0, 0.0, 2.0], 0.5), [1.5, 1.0, 2.0])
    # gamma 1 with a reward only at the end: every turn gets the episode return
    assert discounted_returns([0.0, 0.0, -1.0], 1.0) == [-1.0, -1.0, -1.0]


def test_terminal_gives_the_last_reward_to_every_turn() -> None:
    assert terminal_reward([1.0, -1.0, 2.0]) == [2.0, 2.0, 2.0]


def test_gae_by_hand() -> None:
    # gamma 0.9, lambda 0.8, so gamma * lambda = 0.72; the state after t=2 is terminal.
    # t=2: delta = 2 - 1.5 = 0.5                        -> A = 0.5
    # t=1: delta = 0 + 0.9 * 1.5 - 1.0 = 0.35           -> A = 0.35 + 0.72 * 0.5 = 0.71
    # t=0: delta = 1 + 0.9 * 1.0 - 0.5 = 1.4            -> A = 1.4 + 0.72 * 0.71 = 1.9112
    advantages, returns = gae([1.0, 0.0, 2.0], [0.5, 1.0, 1.5], gamma=0.9, lam=0.8)
    assert close(advantages, [1.9112, 0.71, 0.5])
    assert close(returns, [2.4112, 1.71, 2.0])


def test_gae_bootstraps_a_truncated_episode() -> None:
    # Same episode cut off by a time limit, the next state's value estimated at 3.0:
    # t=2: delta = 2 + 0.9 * 3.0 - 1.5 = 3.2            -> A = 3.2
    # t=1: delta = 0.35                                  -> A = 0.35 + 0.72 * 3.2 = 2.654
    # t=0: delta = 1.4                                   -> A = 1.4 + 0.72 * 2.654 = 3.31088
    advantages, returns = gae([1.0, 0.0, 2.0], [0.5, 1.0, 1.5], 0.9, 0.8, last_value=3.0)
    assert close(advantages, [3.31088, 2.654, 3.2])
    assert close(returns, [3.81088, 3.654, 4.7])


@pytest.mark.parametrize(
    ("info", "truncated"),
    [
        ({"terminated": False}, True),  # the time limit cut it
        ({"terminated": True}, False),
        ({"terminated": False, "ended_by_invalid_reply": True}, False),
        ({}, False),  # the act/terminate_episode loop: no summary, counts as ended
    ],
)
def test_episode_knows_whether_it_was_truncated(info: dict, truncated: bool) -> None:
    assert Episode(info=info).truncated is truncated


def test_turn_returns_dispatches_and_refuses_gae() -> None:
    rewards = [1.0, 0.0, 2.0]
    assert turn_returns(rewards, "equal") == [1.0, 1.0, 1.0]
    assert close(turn_returns(rewards, "discounted", 0.5), [1.5, 1.0, 2.0])
    assert turn_returns(rewards, "terminal") == [2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="value function"):
        turn_returns(rewards, "gae")


# -- baselines -------------------------------------------------------------------------
def test_grpo_normalises_within_the_group() -> None:
    # returns 1, 0, 0, 1: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735
    advantages = group_normalized([[1.0], [0.0], [0.0], [1.0]], eps=0.0)
    third = 0.5 / math.sqrt(1 / 3)
    assert close(advantages, [[third], [-third], [-third], [third]])


def test_grpo_uses_start_returns_as_baseline_for_every_turn() -> None:
    # Two episodes: per-turn returns [3, 1] and [1]; start returns 3 and 1: mean 2,
    # sample std sqrt(2) -> each turn: (G_t - 2) / sqrt(2)
    advantages = group_normalized([[3.0, 1.0], [1.0]], eps=0.0)
    r = 1 / math.sqrt(2)
    assert close(advantages, [[r, -r], [-r]])
    assert close(group_normalized([[3.0, 1.0], [1.0]], scale_by_std=False), [[1.0, -1.0], [-1.0]])


def test_grpo_eps_keeps_small_spreads_finite() -> None:
    advantages = group_normalized([[1.0], [1.0 + 1e-6]], eps=1e-4)
    assert all(abs(a[0]) < 0.01 for a in advantages)


def test_zero_variance_group_has_no_signal() -> None:
    assert group_normalized([[1.0], [1.0], [1.0]]) is None
    assert leave_one_out([[0.5, 1.0], [0.5]]) is None  # start returns equal
    assert minus_batch_mean([[-1.0], [-1.0]]) is None
    assert group_normalized([[1.0]]) is None  # a lone episode has nothing to compare to
    assert not has_signal([2.0]) and has_signal([2.0, 3.0])


def test_rloo_leave_one_out_baseline() -> None:
    # i=0: baseline (0 + 0 + 1) / 3 = 1/3 -> 2/3; i=1: (1 + 0 + 1) / 3 = 2/3 -> -2/3
    expected = [[2 / 3], [-2 / 3], [-2 / 3], [2 / 3]]
    assert close(leave_one_out([[1.0], [0.0], [0.0], [1.0]]), expected)
    # 3, 1, 2: baselines 1.5, 2.5, 2.0
    assert close(leave_one_out([[3.0], [1.0], [2.0]]), [[1.5], [-1.5], [0.0]])


def test_reinforce_batch_mean_baseline() -> None:
    assert close(minus_batch_mean([[3.0, 5.0], [1.0], [2.0]]), [[1.0, 3.0], [-1.0], [0.0]])


def test_adaptive_kl_controller_by_hand() -> None:
    # KL twice the target: error clipped to +0.2; 10 samples over a horizon of 100
    controller = KLController(0.1, target=0.05, horizon=100)
    controller.update(0.1, samples=10)
    assert close(controller.coef, 0.1 * (1 + 0.2 * 10 / 100))
    # KL at 80% of the target: error -0.2
    controller = KLController(0.1, target=0.05, horizon=100)
    controller.update(0.04, samples=10)
    assert close(controller.coef, 0.1 * (1 - 0.2 * 10 / 100))
    fixed = KLController(0.1)
    fixed.update(10.0, samples=1000)
    assert fixed.coef == 0.1
