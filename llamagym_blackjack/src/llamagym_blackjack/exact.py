"""The exact expected return of any stick/hit policy on Gymnasium's ``Blackjack-v1``.

Blackjack-v1 (``natural=False``, ``sab=False``) draws from an infinite deck: each card is
1-9 with probability 1/13 and 10 with probability 4/13. The dealer shows one card, and
with an infinite deck the hidden card may as well be drawn when the player sticks. The
dealer then hits below 17, counting a usable ace as 11. So the value of any policy
follows by recursion over (player sum, dealer card, usable ace) states: no sampling, no
noise, and a few milliseconds for the whole table. Evaluating 20,000 episodes gives a
95% interval of about +-0.013; this gives the number itself.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

CARD_PROBABILITIES = {card: (4 / 13 if card == 10 else 1 / 13) for card in range(1, 11)}

State = tuple[int, int, bool]
"""(player sum, dealer's showing card 1-10, usable ace) as Blackjack-v1 observes it."""


def _add(total: int, usable: bool, card: int) -> tuple[int, bool]:
    """Hand value after drawing ``card``, counting one ace as 11 while that fits."""
    raw = total - (10 if usable else 0) + card  # every ace counted as 1
    # An ace already counted as 1 in a hard hand means raw >= 12, which no card can bring
    # back under 12; so only a usable ace or the card drawn now can become the 11.
    if (usable or card == 1) and raw + 10 <= 21:
        return raw + 10, True
    return raw, False


@functools.cache
def _dealer_outcomes(total: int, usable: bool) -> tuple[tuple[int, float], ...]:
    """Distribution of the dealer's final total (22 = bust) from a hand worth ``total``."""
    if total >= 17:
        return ((min(total, 22), 1.0),)
    outcome: dict[int, float] = {}
    for card, probability in CARD_PROBABILITIES.items():
        new_total, new_usable = _add(total, usable, card)
        if new_total > 21:
            outcome[22] = outcome.get(22, 0.0) + probability
            continue
        for final, p in _dealer_outcomes(new_total, new_usable):
            outcome[final] = outcome.get(final, 0.0) + probability * p
    return tuple(sorted(outcome.items()))


@functools.cache
def stick_value(player: int, dealer_card: int) -> float:
    start_total, start_usable = (11, True) if dealer_card == 1 else (dealer_card, False)
    value = 0.0
    for card, probability in CARD_PROBABILITIES.items():
        total, usable = _add(start_total, start_usable, card)
        for final, p in _dealer_outcomes(total, usable):
            if final > 21 or player > final:
                value += probability * p
            elif player < final:
                value -= probability * p
    return value


def policy_value(policy: Callable[[State], str]) -> float:
    """Expected return of ``policy`` (state -> "stick" or "hit") from Blackjack-v1's
    starting distribution: two player cards, one dealer card showing."""

    @functools.cache
    def value(player: int, dealer_card: int, usable: bool) -> float:
        if policy((player, dealer_card, usable)) == "stick":
            return stick_value(player, dealer_card)
        expected = 0.0
        for card, probability in CARD_PROBABILITIES.items():
            total, new_usable = _add(player, usable, card)
            outcome = -1.0 if total > 21 else value(total, dealer_card, new_usable)
            expected += probability * outcome
        return expected

    total = 0.0
    for first, p1 in CARD_PROBABILITIES.items():
        for second, p2 in CARD_PROBABILITIES.items():
            player, usable = _add(*_add(0, False, first), second)
            for dealer_card, pd in CARD_PROBABILITIES.items():
                total += p1 * p2 * pd * value(player, dealer_card, usable)
    return total


def reachable_states() -> list[State]:
    """Every (sum, dealer card, usable ace) a policy can be asked about."""
    states = []
    for dealer_card in range(1, 11):
        for player in range(4, 22):
            states.append((player, dealer_card, False))
        for player in range(12, 22):
            states.append((player, dealer_card, True))
    return states
