"""What a BabyAI agent sees, in words, in the layout of GLAM's BabyAI-Text (Carta et
al., 2023): the mission, then one line per thing in the 7x7 view, placed by steps to
the left or right and forward from the agent ("You see a red ball 2 steps left and
1 step forward").

MiniGrid's partial view is ``observation["image"]``: ``image[x, y]`` is (object,
colour, state) as indices, already turned so that the agent stands at the bottom middle
(x 3, y 6) facing up: x below 3 is to its left, y below 6 in front of it. Walls are
many and alike, so only the nearest one straight ahead, to the left and to the right is
said; the cell the agent stands on shows what it carries.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["describe", "describe_view", "where"]

# MiniGrid's encoding (minigrid.core.constants), stated here so that this module, and
# the agent that uses it, need not import minigrid.
OBJECTS = ("unseen", "empty", "wall", "floor", "door", "key", "ball", "box", "goal",
           "lava", "agent")
COLOURS = ("red", "green", "blue", "purple", "yellow", "grey")
DOOR_STATES = ("open", "closed", "locked")
_NOTHING = {"unseen", "empty", "floor", "agent"}


def _steps(count: int, direction: str) -> str:
    return f"{count} step{'s' if count != 1 else ''} {direction}"


def where(dx: int, forward: int) -> str:
    """``dx`` cells to the right (negative: left) and ``forward`` cells ahead, in words."""
    parts = []
    if dx:
        parts.append(_steps(abs(dx), "left" if dx < 0 else "right"))
    if forward:
        parts.append(_steps(forward, "forward"))
    return " and ".join(parts)


def _name(cell: Any) -> str | None:
    kind, colour, state = (int(v) for v in cell)
    if not 0 <= kind < len(OBJECTS) or OBJECTS[kind] in _NOTHING:
        return None
    name = OBJECTS[kind]
    if name in ("wall", "goal", "lava"):
        return name
    colour_name = COLOURS[colour] if 0 <= colour < len(COLOURS) else "odd"
    if name == "door":
        door_state = DOOR_STATES[state] if 0 <= state < len(DOOR_STATES) else "odd"
        return f"{door_state} {colour_name} door"
    return f"{colour_name} {name}"


def describe_view(image: np.ndarray) -> list[str]:
    """One sentence per thing the agent sees (nearest first), and what it carries."""
    width, height = image.shape[0], image.shape[1]
    me_x, me_y = width // 2, height - 1
    lines: list[tuple[int, str]] = []
    carried = _name(image[me_x, me_y])
    nearest_walls: dict[str, tuple[int, int]] = {}
    for x in range(width):
        for y in range(height):
            if (x, y) == (me_x, me_y):
                continue
            name = _name(image[x, y])
            if name is None:
                continue
            dx, forward = x - me_x, me_y - y
            distance = abs(dx) + forward
            if name == "wall":
                line = "forward" if dx == 0 else ("left" if dx < 0 else "right")
                if forward and dx or (line in nearest_walls and nearest_walls[line][0] <= distance):
                    continue  # only walls straight ahead or beside, the nearest of each
                nearest_walls[line] = (distance, dx)
                continue
            article = "an" if name[0] in "aeiou" else "a"
            lines.append((distance, f"You see {article} {name} {where(dx, forward)}"))
    for distance, dx in nearest_walls.values():
        forward = distance - abs(dx)
        lines.append((distance, f"You see a wall {where(dx, forward)}"))
    said = [line for _, line in sorted(lines)]
    if carried:
        said.append(f"You carry a {carried}")
    return said or ["You see nothing but the floor"]


def describe(observation: dict) -> str:
    """The mission, then what the agent sees, one line each."""
    mission = str(observation.get("mission", "")).strip()
    return "\n".join([f"Goal of the agent: {mission}", *describe_view(observation["image"])])
