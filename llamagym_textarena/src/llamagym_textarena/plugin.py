"""Entry point of the plugin: one agent per TextArena game it plays, each stated once
here (name, the game in a line, its default TextArena id). Nothing here imports
TextArena or the agent module, so ``llamagym list`` stays fast."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec


def _spec(name: str, attribute: str, description: str, env_id: str) -> AgentSpec:
    return AgentSpec(
        name=f"textarena-{name}",
        entry_point=f"llamagym_textarena.agent:{attribute}",
        description=f"TextArena {description}",
        env_id=env_id,
    )


TOWER_OF_HANOI = _spec(
    "tower-of-hanoi", "TowerOfHanoiAgent",
    "Tower of Hanoi: move 3 disks from tower A to C, never a larger on a smaller",
    "TowerOfHanoi-v0",
)
LIGHTS_OUT = _spec(
    "lights-out", "LightsOutAgent",
    "Lights Out: press cells of a 5x5 grid (each toggles its neighbours) until all are off",
    "LightsOut-v0",
)
FROZEN_LAKE = _spec(
    "frozen-lake", "FrozenLakeAgent",
    "Frozen Lake: walk a 4x4 grid to the goal without falling into a hole",
    "FrozenLake-v0",
)
GUESS_THE_NUMBER = _spec(
    "guess-the-number", "GuessTheNumberAgent",
    "Guess the Number: find a number from 1 to 20 in 10 guesses from higher/lower hints",
    "GuessTheNumber-v0",
)
MASTERMIND = _spec(
    "mastermind", "MastermindAgent",
    "Mastermind: find a 4-digit code (digits 1-6) from black/white peg answers",
    "Mastermind-v0",
)
SUDOKU = _spec(
    "sudoku", "SudokuAgent",
    "Sudoku: fill the 41 empty cells of a 9x9 grid, one digit a move",
    "Sudoku-v0-medium",
)
AGENTS = (TOWER_OF_HANOI, LIGHTS_OUT, FROZEN_LAKE, GUESS_THE_NUMBER, MASTERMIND, SUDOKU)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    for spec in AGENTS:
        register(spec)
