"""What each supported TextArena game allows, what its best move is and how far it is
from won, read from the game's own state (TextArena 0.7's attributes and
``state.game_state``).

A move is written exactly as the game asks for it (``[A C]``, ``[up]``, ``[7]``,
``[1 2 3 4]``), so the text the model is shown, the text it scores and the text the game
parses are one. Nothing here imports TextArena: the functions read the game object they
are handed.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["GAMES", "Game", "fewest_presses", "hanoi_distance"]

Moves = Callable[[Any], list[str]]
Expert = Callable[[Any], "str | None"]
Potential = Callable[[Any], "float | None"]


@dataclass(frozen=True)
class Game:
    """One TextArena game: its family name (``TowerOfHanoi``), the variants this plugin
    plays (TextArena ids; the first is the default), its legal moves now, the move of a
    strong player now (None: no expert for this game), and its potential now: minus how
    far the game is from won, 0 once it is (None: no measure in this state; a game
    without the function has none, and its progress is always 0)."""

    family: str
    variants: tuple[str, ...]
    moves: Moves
    expert: Expert | None = None
    potential: Potential | None = None


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


def hanoi_distance(peg_of: dict[int, str], disk: int, target: str) -> int:
    """The fewest moves that bring disks 1..disk onto ``target``: the largest one not
    there moves once, after the smaller ones went to the spare peg, and they follow it
    (2**(disk-1) - 1 moves)."""
    if disk == 0:
        return 0
    if peg_of[disk] == target:
        return hanoi_distance(peg_of, disk - 1, target)
    spare = ({"A", "B", "C"} - {peg_of[disk], target}).pop()
    return hanoi_distance(peg_of, disk - 1, spare) + 2 ** (disk - 1)


def _peg_of(game: Any) -> dict[int, str]:
    return {disk: peg for peg, disks in game.state.game_state["towers"].items() for disk in disks}


def hanoi_expert(game: Any) -> str | None:
    peg_of = _peg_of(game)
    move = _hanoi_next(peg_of, len(peg_of), "C")
    return f"[{move[0]} {move[1]}]" if move else None


def hanoi_potential(game: Any) -> float:
    """Minus the moves of the shortest solution from here (every disk onto C)."""
    peg_of = _peg_of(game)
    return -hanoi_distance(peg_of, len(peg_of), "C")


# -- Lights Out ------------------------------------------------------------------------
def lights_out_moves(game: Any) -> list[str]:
    return [f"[{row} {col}]" for row in range(game.size) for col in range(game.size)]


def _press(size: int, cell: int) -> int:
    """The lights (bits ``row * size + col``) a press of ``cell`` toggles."""
    row, col = divmod(cell, size)
    mask = 0
    for r, c in ((row, col), (row - 1, col), (row + 1, col), (row, col - 1), (row, col + 1)):
        if 0 <= r < size and 0 <= c < size:
            mask |= 1 << (r * size + c)
    return mask


def fewest_presses(grid: list[list[bool]]) -> int | None:
    """The cells (bits) of a smallest set of presses that turns every light of ``grid``
    off, or None when none does. Presses commute and two of a cell cancel, so a set is
    a solution of a linear system over GF(2): solved by elimination, then the smallest
    of the solutions the free cells allow (4 on a 5x5 board)."""
    size = len(grid)
    cells = size * size
    # One equation per light: the presses that toggle it (a press toggles its
    # neighbours and a light is toggled by its neighbours' presses: the same mask).
    rows = [(_press(size, j), int(bool(grid[j // size][j % size]))) for j in range(cells)]
    pivots: list[int] = []
    for col in range(cells):
        rank = len(pivots)
        found = next((k for k in range(rank, cells) if rows[k][0] >> col & 1), None)
        if found is None:
            continue
        rows[rank], rows[found] = rows[found], rows[rank]
        for k in range(cells):
            if k != rank and rows[k][0] >> col & 1:
                rows[k] = (rows[k][0] ^ rows[rank][0], rows[k][1] ^ rows[rank][1])
        pivots.append(col)
    rank = len(pivots)
    if any(rhs for _, rhs in rows[rank:]):  # a light no set of presses reaches
        return None
    free = [col for col in range(cells) if col not in pivots]
    best: int | None = None
    for choice in itertools.product((0, 1), repeat=len(free)):
        presses = sum(bit << col for bit, col in zip(choice, free, strict=True))
        for (mask, rhs), col in zip(rows, pivots, strict=False):
            presses |= (rhs ^ (mask & presses).bit_count() & 1) << col
        if best is None or presses.bit_count() < best.bit_count():
            best = presses
    return best


def lights_out_expert(game: Any) -> str | None:
    """A press of a smallest set that turns every light off (its first cell)."""
    presses = fewest_presses(game.state.game_state["grid"])
    if not presses:
        return None
    row, col = divmod((presses & -presses).bit_length() - 1, game.size)
    return f"[{row} {col}]"


def lights_out_potential(game: Any) -> float | None:
    """Minus the fewest presses that turn every light off."""
    presses = fewest_presses(game.state.game_state["grid"])
    return None if presses is None else -presses.bit_count()


# -- Frozen Lake -----------------------------------------------------------------------
_STEPS = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}


def _inside(game: Any, row: int, col: int) -> bool:
    return 0 <= row < game.size and 0 <= col < game.size


def frozen_lake_moves(game: Any) -> list[str]:
    row, col = game.state.game_state["player_pos"]
    return [f"[{name}]" for name, (dr, dc) in _STEPS.items() if _inside(game, row + dr, col + dc)]


def _shortest_path(game: Any) -> tuple[int, str | None] | None:
    """The length of a shortest path around the holes to the goal and its first step
    (breadth-first search), or None when there is none (or the player is in a hole)."""
    grid = game.state.game_state["grid"]
    state = game.state.game_state
    start, goal = tuple(state["player_pos"]), tuple(state["goal_pos"])
    if grid[start[0]][start[1]] == "H":
        return None
    first_step: dict[tuple[int, int], tuple[int, str | None]] = {start: (0, None)}
    queue = deque([start])
    while queue:
        row, col = queue.popleft()
        if (row, col) == goal:
            return first_step[(row, col)]
        distance, step = first_step[(row, col)]
        for name, (dr, dc) in _STEPS.items():
            cell = (row + dr, col + dc)
            if _inside(game, *cell) and cell not in first_step and grid[cell[0]][cell[1]] != "H":
                first_step[cell] = (distance + 1, step or f"[{name}]")
                queue.append(cell)
    return None


def frozen_lake_expert(game: Any) -> str | None:
    """The first step of a shortest path around the holes."""
    path = _shortest_path(game)
    return path[1] if path else None


def frozen_lake_potential(game: Any) -> float | None:
    """Minus the steps of a shortest path around the holes to the goal (None: in a hole)."""
    path = _shortest_path(game)
    return None if path is None else -path[0]


# -- Guess the Number ------------------------------------------------------------------
def guess_moves(game: Any) -> list[str]:
    guessed = game.guessed_numbers
    return [f"[{n}]" for n in range(game.min_number, game.max_number + 1) if n not in guessed]


def _hinted_range(game: Any) -> tuple[int, int]:
    """The lowest and highest number the hints so far leave (low > high: none)."""
    low, high = game.min_number, game.max_number
    for guess, hint in game.state.game_state["guess_history"]:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return low, high


def guess_expert(game: Any) -> str | None:
    """Binary search over the range the hints leave."""
    low, high = _hinted_range(game)
    return f"[{(low + high) // 2}]" if low <= high else None


def guess_potential(game: Any) -> float | None:
    """Minus the bits still unknown: log2 of the numbers the hints leave (0 once
    guessed). A guess that halves the range gains 1; one the hints ruled out, 0."""
    if game.game_number in game.guessed_numbers:
        return 0.0
    low, high = _hinted_range(game)
    return -math.log2(high - low + 1) if low <= high else None


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


def _consistent(code: tuple[int, ...], history: list[dict[str, Any]]) -> bool:
    """Whether ``code`` agrees with every answer so far."""
    return all(_pegs(code, tuple(h["guess"])) == (h["black"], h["white"]) for h in history)


def mastermind_expert(game: Any) -> str | None:
    """The first code (in order) that agrees with every answer so far."""
    history = game.state.game_state["history"]
    return next((_code_text(code) for code in _codes(game) if _consistent(code, history)), None)


def mastermind_potential(game: Any) -> float | None:
    """Minus the bits still unknown: log2 of the codes every answer so far allows (0
    once cracked). Not the pegs of the last guess: a guess with none can rule out most
    codes."""
    history = game.state.game_state["history"]
    left = sum(_consistent(code, history) for code in _codes(game))
    return -math.log2(left) if left else None


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


def sudoku_potential(game: Any) -> float:
    """Minus the empty cells (the game takes a digit only where it is the solution's)."""
    return -sum(not digit for row in game.state.game_state["board"] for digit in row)


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
                              "TowerOfHanoi-v0-hard"), hanoi_moves, hanoi_expert,
             hanoi_potential),
        Game("LightsOut", ("LightsOut-v0",), lights_out_moves, lights_out_expert,
             lights_out_potential),
        Game("FrozenLake", ("FrozenLake-v0", "FrozenLake-v0-random", "FrozenLake-v0-hardcore"),
             frozen_lake_moves, frozen_lake_expert, frozen_lake_potential),
        Game("GuessTheNumber", ("GuessTheNumber-v0", "GuessTheNumber-v0-hardcore"),
             guess_moves, guess_expert, guess_potential),
        Game("Mastermind", ("Mastermind-v0", "Mastermind-v0-hard"), mastermind_moves,
             mastermind_expert, mastermind_potential),
        Game("Sudoku", ("Sudoku-v0-medium", "Sudoku-v0", "Sudoku-v0-easy", "Sudoku-v0-very-easy",
                        "Sudoku-v0-hard"), sudoku_moves, sudoku_expert, sudoku_potential),
    )
}
