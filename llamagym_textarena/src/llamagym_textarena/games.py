"""What each supported TextArena game allows and what its best move is, read from the
game's own state (TextArena 0.7's attributes and ``state.game_state``).

A move is written exactly as the game asks for it (``[A C]``, ``[up]``, ``[7]``,
``[1 2 3 4]``), so the text the model is shown, the text it scores and the text the game
parses are one. Nothing here imports TextArena: the functions read the game object they
are handed.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GAMES", "Game"]

Moves = Callable[[Any], list[str]]
Expert = Callable[[Any], "str | None"]


@dataclass(frozen=True)
class Game:
    """One TextArena game: its family name (``TowerOfHanoi``), the variants this plugin
    plays (TextArena ids; the first is the default), its legal moves now, and the move
    of a strong player now (None: no expert for this game)."""

    family: str
    variants: tuple[str, ...]
    moves: Moves
    expert: Expert | None = None


# -- Tower of Hanoi --------------------------------------------------------------------
def hanoi_moves(game: Any) -> list[str]:
    towers = game.state.game_state["towers"]
    moves = []
    for source, target in itertools.permutations(sorted(towers), 2):
        if towers[source] and (not towers[target] or towers[target][-1] > towers[source][-1]):
            moves.append(f"[{source} {target}]")
    return moves


def _hanoi_next(peg_of: dict[int, str], disk: int, target: str) -> tuple[str, str] | None:
    """The first move of the shortest way to bring disks 1..disk onto ``target``, or
    None when they are all there already."""
    if disk == 0:
        return None
    if peg_of[disk] == target:
        return _hanoi_next(peg_of, disk - 1, target)
    spare = ({"A", "B", "C"} - {peg_of[disk], target}).pop()
    return _hanoi_next(peg_of, disk - 1, spare) or (peg_of[disk], target)


def hanoi_expert(game: Any) -> str | None:
    towers = game.state.game_state["towers"]
    peg_of = {disk: peg for peg, disks in towers.items() for disk in disks}
    move = _hanoi_next(peg_of, len(peg_of), "C")
    return f"[{move[0]} {move[1]}]" if move else None


# -- Lights Out ------------------------------------------------------------------------
def lights_out_moves(game: Any) -> list[str]:
    return [f"[{row} {col}]" for row in range(game.size) for col in range(game.size)]


# -- Frozen Lake -----------------------------------------------------------------------
_STEPS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _inside(game: Any, row: int, col: int) -> bool:
    return 0 <= row < game.size and 0 <= col < game.size


def frozen_lake_moves(game: Any) -> list[str]:
    row, col = game.state.game_state["player_pos"]
    return [f"[{name}]" for name, (dr, dc) in _STEPS.items() if _inside(game, row + dr, col + dc)]


def frozen_lake_expert(game: Any) -> str | None:
    """The first step of a shortest path around the holes (breadth-first search)."""
    grid = game.state.game_state["grid"]
    state = game.state.game_state
    start, goal = tuple(state["player_pos"]), tuple(state["goal_pos"])
    first_step: dict[tuple[int, int], str | None] = {start: None}
    queue = deque([start])
    while queue:
        row, col = queue.popleft()
        if (row, col) == goal:
            return first_step[(row, col)]
        for name, (dr, dc) in _STEPS.items():
            cell = (row + dr, col + dc)
            if _inside(game, *cell) and cell not in first_step and grid[cell[0]][cell[1]] != "H":
                first_step[cell] = first_step[(row, col)] or f"[{name}]"
                queue.append(cell)
    return None


# -- Guess the Number ------------------------------------------------------------------
def guess_moves(game: Any) -> list[str]:
    guessed = game.guessed_numbers
    return [f"[{n}]" for n in range(game.min_number, game.max_number + 1) if n not in guessed]


def guess_expert(game: Any) -> str | None:
    """Binary search over the range the hints leave."""
    low, high = game.min_number, game.max_number
    for guess, hint in game.state.game_state["guess_history"]:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return f"[{(low + high) // 2}]" if low <= high else None


# -- Mastermind ------------------------------------------------------------------------
def _codes(game: Any) -> list[tuple[int, ...]]:
    digits = range(1, game.num_numbers + 1)
    return list(itertools.permutations(digits, game.code_length))


def _code_text(code: tuple[int, ...]) -> str:
    return "[" + " ".join(map(str, code)) + "]"


def mastermind_moves(game: Any) -> list[str]:
    tried = {tuple(entry["guess"]) for entry in game.state.game_state["history"]}
    return [_code_text(code) for code in _codes(game) if code not in tried]


def _pegs(code: tuple[int, ...], guess: tuple[int, ...]) -> tuple[int, int]:
    black = sum(a == b for a, b in zip(code, guess, strict=True))
    return black, len(set(code) & set(guess)) - black  # no repeated digits in these codes


def mastermind_expert(game: Any) -> str | None:
    """The first code (in order) that agrees with every answer so far."""
    history = game.state.game_state["history"]
    for code in _codes(game):
        if all(_pegs(code, tuple(h["guess"])) == (h["black"], h["white"]) for h in history):
            return _code_text(code)
    return None


# -- Sudoku ----------------------------------------------------------------------------
def sudoku_moves(game: Any) -> list[str]:
    """Every digit an empty cell can take without repeating one in its row, column or
    box. The game also refuses a digit that breaks no rule but is not its solution's:
    that reaches the game, which counts it as an invalid move."""
    board = game.state.game_state["board"]
    moves = []
    for row, col in itertools.product(range(9), range(9)):
        if board[row][col]:
            continue
        box = {board[r][c] for r in range(row // 3 * 3, row // 3 * 3 + 3)
               for c in range(col // 3 * 3, col // 3 * 3 + 3)}
        taken = set(board[row]) | {board[r][col] for r in range(9)} | box
        moves += [f"[{row + 1} {col + 1} {digit}]" for digit in range(1, 10) if digit not in taken]
    return moves


def sudoku_expert(game: Any) -> str | None:
    """The solution's digit for the first empty cell (an oracle: it reads the solution)."""
    board = game.state.game_state["board"]
    for row, col in itertools.product(range(9), range(9)):
        if not board[row][col]:
            return f"[{row + 1} {col + 1} {game.full_grid[row][col]}]"
    return None


GAMES: dict[str, Game] = {
    game.family: game
    for game in (
        Game("TowerOfHanoi", ("TowerOfHanoi-v0", "TowerOfHanoi-v0-medium",
                              "TowerOfHanoi-v0-hard"), hanoi_moves, hanoi_expert),
        Game("LightsOut", ("LightsOut-v0",), lights_out_moves),
        Game("FrozenLake", ("FrozenLake-v0", "FrozenLake-v0-random", "FrozenLake-v0-hardcore"),
             frozen_lake_moves, frozen_lake_expert),
        Game("GuessTheNumber", ("GuessTheNumber-v0", "GuessTheNumber-v0-hardcore"),
             guess_moves, guess_expert),
        Game("Mastermind", ("Mastermind-v0", "Mastermind-v0-hard"), mastermind_moves,
             mastermind_expert),
        Game("Sudoku", ("Sudoku-v0-medium", "Sudoku-v0", "Sudoku-v0-easy", "Sudoku-v0-very-easy",
                        "Sudoku-v0-hard"), sudoku_moves, sudoku_expert),
    )
}
