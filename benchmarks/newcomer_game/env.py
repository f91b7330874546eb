"""VaultEnv: a text game with one reward at the end, as a newcomer would write one.

The player must pass ``DOORS`` rooms on the way to a vault. Each room has four doors
(north, south, east, west); one leads on, the other three back to the first room. The
way on is drawn at each reset, and the room says it, in its own terms: a draft comes
from the side of a landmark (the mountains lie north, the sea south, the sunrise east,
the sunset west). Passing the last door pays 1 and ends the game; ``MAX_STEPS`` moves
without reaching the vault cut the episode off (truncated). Every move is a string.
Each step's ``info["progress"]`` is the rooms it gained (one) or lost (back to the first).
"""

from __future__ import annotations

import string
from typing import Any

import gymnasium
from gymnasium import spaces

DOORS = 4
MAX_STEPS = 12
COMMANDS = ("go north", "go south", "go east", "go west")
LANDMARKS = {"go north": "the mountains", "go south": "the sea",
             "go east": "the sunrise", "go west": "the sunset"}
ROOMS = ("entrance hall", "library", "armoury", "chapel", "kitchen", "gallery")


class VaultEnv(gymnasium.Env):
    """Find the way through ``DOORS`` rooms to the vault: observations and actions are
    text; ``info["commands"]`` lists the moves; ``info["way"]`` the door that leads on
    (for the oracle baseline only)."""

    metadata = {"render_modes": []}

    def __init__(self, max_steps: int = MAX_STEPS):
        self.max_steps = max_steps
        self.observation_space = spaces.Text(300, charset=string.printable)
        self.action_space = spaces.Text(20, charset=string.printable)
        self.ways: list[str] = []
        self.rooms: list[str] = []
        self.room = self.steps = 0

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self.ways = [COMMANDS[int(self.np_random.integers(len(COMMANDS)))]
                     for _ in range(DOORS)]
        order = self.np_random.permutation(len(ROOMS))
        self.rooms = [ROOMS[int(i)] for i in order[:DOORS]]
        self.room = self.steps = 0
        return self._observation("You enter."), self._info()

    def step(self, action: Any) -> tuple[str, float, bool, bool, dict[str, Any]]:
        command = str(action)
        if command not in COMMANDS:
            raise ValueError(f"{command!r} is not one of {', '.join(COMMANDS)}")
        self.steps += 1
        before = self.room
        if command == self.ways[self.room]:
            self.room += 1
            said = "The door opens onto the next room."
        else:
            self.room = 0
            said = "A trapdoor drops you back at the start."
        # The progress signal LlamaGym reads: rooms gained (or lost) by this move.
        progress = {"progress": self.room - before}
        if self.room == DOORS:
            return "You reach the vault.", 1.0, True, False, {**self._info(), **progress}
        truncated = self.steps >= self.max_steps
        return self._observation(said), 0.0, False, truncated, {**self._info(), **progress}

    def _observation(self, said: str) -> str:
        landmark = LANDMARKS[self.ways[self.room]]
        return (f"{said} You are in the {self.rooms[self.room]} (room {self.room + 1} of "
                f"{DOORS}). A cold draft blows from the side of {landmark}.")

    def _info(self) -> dict[str, Any]:
        way = self.ways[self.room] if self.room < DOORS else ""
        return {"commands": list(COMMANDS), "way": way, "room": self.room}
