"""The corridor: start at cell 0, reach cell ``length - 1``; 1 at the end, else 0."""

from __future__ import annotations

from typing import Any

import gymnasium
from gymnasium import spaces


class CorridorEnv(gymnasium.Env):
    def __init__(self, length: int = 4):
        self.length = length
        self.observation_space = spaces.Discrete(length)
        self.action_space = spaces.Discrete(2)  # 0: back, 1: forward
        self.position = 0

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position = 0
        return self.position, {"length": self.length}

    def step(self, action: Any):
        self.position = max(0, min(self.length - 1, self.position + (1 if action else -1)))
        done = self.position == self.length - 1
        return self.position, float(done), done, False, {"length": self.length}
