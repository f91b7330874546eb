"""__ENV_CLASS__: the game the agent plays, a Gymnasium environment.

The game it starts with: a secret whole number from 1 to 16 is drawn at each reset; each
step guesses one number, and the env answers whether the secret is higher, lower, or
the guess is correct. A correct guess pays 1.0 and ends the episode; after max_guesses
wrong guesses (MAX_GUESSES unless the env is made with another) the episode is cut off
(truncated).

Put your own game here: change the spaces in __init__, the start of an episode in
reset() and the rules in step(). Keep the Gymnasium API (reset returns (observation,
info), step returns (observation, reward, terminated, truncated, info)) and draw every
random number from self.np_random after super().reset(seed=seed), so that a seed
decides the whole episode: training and evaluation replay episodes by seed.
plugin.py registers this class with Gymnasium as __ENV_ID__.
If you rename the class, rename it there too. agent.py names the actions and reads the
observations: change it with them.
"""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium import spaces

LOWEST, HIGHEST = 1, 16
#: Wrong guesses after which an episode is truncated (a binary search needs at most 5
#: guesses in all).
MAX_GUESSES = 8
#: The observation's "hint", by its value: what the env said about the last guess.
HINTS = ("none yet", "higher", "lower", "correct")
NONE_YET, HIGHER, LOWER, CORRECT = range(len(HINTS))


class __ENV_CLASS__(gymnasium.Env):
    """Guess the secret number from LOWEST to HIGHEST.

    * Actions: Discrete(16), action ``a`` guesses the number ``a + 1``.
    * Observations: a dict of small whole numbers: ``guess``, the last guess (0 before
      the first); ``hint``, what the env said about it (an index into ``HINTS``:
      "higher" means the secret is higher than the guess); ``low`` and ``high``, the
      range the hints so far leave for the secret.
    * Rewards: 1.0 for the correct guess (the episode terminates), 0.0 for the others.
    * The episode is truncated after ``max_guesses`` guesses without finding the secret.
    """

    def __init__(self, max_guesses: int = MAX_GUESSES):
        self.max_guesses = max_guesses
        self.action_space = spaces.Discrete(HIGHEST - LOWEST + 1)
        self.observation_space = spaces.Dict(
            {
                "guess": spaces.Discrete(HIGHEST + 1),  # 0: no guess yet
                "hint": spaces.Discrete(len(HINTS)),
                "low": spaces.Discrete(HIGHEST - LOWEST + 1, start=LOWEST),
                "high": spaces.Discrete(HIGHEST - LOWEST + 1, start=LOWEST),
            }
        )
        self.secret = LOWEST
        self.guesses = 0
        self.low, self.high = LOWEST, HIGHEST
        self.last_guess, self.hint = 0, NONE_YET

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, int], dict[str, Any]]:
        super().reset(seed=seed)  # seeds self.np_random
        # The hidden state comes from self.np_random only, so the seed decides it.
        self.secret = int(self.np_random.integers(LOWEST, HIGHEST + 1))
        self.guesses = 0
        self.low, self.high = LOWEST, HIGHEST
        self.last_guess, self.hint = 0, NONE_YET
        return self._observation(), {}

    def step(self, action: Any) -> tuple[dict[str, int], float, bool, bool, dict[str, Any]]:
        if not self.action_space.contains(action):
            raise ValueError(f"action {action!r} is not in {self.action_space}")
        guess = int(action) + LOWEST
        self.guesses += 1
        self.last_guess = guess
        if guess == self.secret:
            self.hint = CORRECT
            self.low = self.high = guess
        elif guess < self.secret:
            self.hint = HIGHER
            self.low = max(self.low, guess + 1)
        else:
            self.hint = LOWER
            self.high = min(self.high, guess - 1)
        terminated = self.hint == CORRECT
        truncated = not terminated and self.guesses >= self.max_guesses
        reward = 1.0 if terminated else 0.0
        return self._observation(), reward, terminated, truncated, {"guesses": self.guesses}

    def _observation(self) -> dict[str, int]:
        return {"guess": self.last_guess, "hint": self.hint, "low": self.low, "high": self.high}
