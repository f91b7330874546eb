"""A Gymnasium environment over one TextArena single-player game.

Why an adapter: a TextArena env is reset with a player count, returns ``(done, info)``
from ``step``, hands its messages out through ``get_observation()`` (each message once),
and gives the reward only when the game is over (``state.rewards``). It also seeds and
draws from Python's *global* ``random`` module. This adapter plays the game's unwrapped
form (TextArena's ``-raw`` id) and adds Gymnasium's semantics:

* ``reset(seed=s)`` always deals the same game, and no env disturbs another's draws or
  the process's: each env keeps its own ``random`` state and swaps it in only while the
  game runs.
* The observation is what the game said since the last move (its description of the
  move, a hint, or why a move was refused) and the current board; the game's rules (its
  first message) are ``info["prompt"]``. Text outside printable ASCII is replaced by
  ``?`` and the whole is cut to ``max_observation_length`` characters.
* The reward is the game's own, on the step that ends it: 1 for a win, otherwise the
  share of the puzzle done (TextArena's completion score). ``info`` says how it ended:
  ``won``, ``invalid_move`` (the game's rule: a second invalid move in a row ends it)
  and ``reason``.
* ``info["legal_moves"]`` lists the moves the game allows now, in its own format, and
  ``info["expert_move"]`` a strong player's move (None where there is none).
* ``info["progress"]`` is how much closer to won the step brought the game: its
  potential after the step less its potential before (0 on reset). The potential (each
  game's function in :mod:`llamagym_textarena.games`; ``info["potential"]`` is the last
  one measured) is minus how far the game is from won, 0 once won: the fewest moves
  left in Tower of Hanoi, Lights Out (presses) and Frozen Lake (steps around the
  holes), the empty cells in Sudoku, the bits still unknown in Guess the Number and
  Mastermind (log2 of the numbers or codes the answers allow). A shaping term of the
  potential-based kind: over an episode it sums to the end potential less the start
  one, so the best policy stays the best. A state without a potential (None: Frozen
  Lake's player in a hole) makes the step's progress 0 and keeps the last potential; a
  refused move changes nothing, so its progress is 0 too. The reward is not changed:
  LlamaGym's learner adds ``rollout.progress_reward`` times the progress.

Any string is a valid action: the game's parser judges it (TextArena warns on a first
invalid move and ends the game on a second one in a row), and nothing it says can stop
the env with an exception.
"""

from __future__ import annotations

import logging
import random
import string
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium import spaces

from llamagym.errors import MissingDependencyError
from llamagym_textarena.games import GAMES, Game

logger = logging.getLogger(__name__)

__all__ = ["TextArenaEnv", "game_of"]

_PRINTABLE = frozenset(string.printable)
_MAX_ACTION_CHARS = 200
_FIRST_TURN = "Your move."


def game_of(game_id: str) -> Game:
    """The :class:`Game` a TextArena id belongs to, or a ValueError naming those played."""
    for game in GAMES.values():
        if game_id in game.variants:
            return game
    known = ", ".join(v for g in GAMES.values() for v in g.variants)
    raise ValueError(f"TextArena game {game_id!r} is not one this plugin plays; known: {known}")


def _make_raw(game_id: str) -> Any:
    try:
        import textarena
    except ImportError as exc:
        raise MissingDependencyError("textarena", "TextArena games", "llamagym-textarena") from exc
    return textarena.make(f"{game_id}-raw")  # the game without TextArena's wrappers


def _printable(text: str) -> str:
    return text if _PRINTABLE.issuperset(text) else "".join(
        c if c in _PRINTABLE else "?" for c in text
    )


class TextArenaEnv(gym.Env[str, str]):
    """Play the TextArena game ``game_id`` (e.g. ``TowerOfHanoi-v0``) through Gymnasium.

    Args:
        game_id: a TextArena id from :data:`llamagym_textarena.games.GAMES`.
        max_episode_steps: steps (moves, refused ones included) before the episode is
            truncated; every game also has its own turn limit, which ends it first.
        max_observation_length: observations are cut to this many characters.
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        game_id: str,
        *,
        max_episode_steps: int = 200,
        max_observation_length: int = 4000,
        render_mode: str | None = None,
    ) -> None:
        super().__init__()
        if max_episode_steps < 1:
            raise ValueError("max_episode_steps must be >= 1")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}")
        self.game = game_of(game_id)
        self.game_id = game_id
        self.max_episode_steps = int(max_episode_steps)
        self.max_observation_length = int(max_observation_length)
        self.render_mode = render_mode
        self.observation_space = spaces.Text(
            max_length=self.max_observation_length, min_length=0, charset=string.printable
        )
        self.action_space = spaces.Text(
            max_length=_MAX_ACTION_CHARS, min_length=1, charset=string.printable
        )
        self._raw = _make_raw(game_id)
        self._random_state = random.Random(0).getstate()
        self._prompt = ""
        self._board = ""
        self._last = ""
        self._steps = 0
        self._done = True
        self._potential: float | None = None
        self._progress = 0.0

    # ------------------------------------------------------------------ Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        game_seed = int(self.np_random.integers(2**31 - 1))
        self._in_game(lambda: self._raw.reset(num_players=1, seed=game_seed))
        self._prompt, self._board, self._last = "", "", ""
        self._steps = 0
        self._done = False
        self._potential, self._progress = self._measure(), 0.0
        self._last = self._read_messages() or _FIRST_TURN
        return self._last, self._info()

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("call reset() before step() (and after an episode ends)")
        move = " ".join(str(action).split())[:_MAX_ACTION_CHARS]
        done, _ = self._in_game(lambda: self._raw.step(move))
        self._steps += 1
        state = self._raw.state
        terminated = bool(done or state.done)
        truncated = not terminated and self._steps >= self.max_episode_steps
        self._done = terminated or truncated
        reward = self._game_reward() if terminated else 0.0
        potential, before = self._measure(), self._potential
        self._progress = 0.0 if potential is None or before is None else potential - before
        self._potential = before if potential is None else potential
        self._last = self._read_messages() or self._last
        return self._last, reward, terminated, truncated, self._info()

    def render(self) -> str | None:
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi'")
            return None
        return self._last + "\n"

    # ------------------------------------------------------------------ helpers
    def _in_game(self, call: Any) -> Any:
        """Run ``call`` with this env's ``random`` state as the global one, and put the
        process's back afterwards (TextArena games seed and draw from the module)."""
        outside = random.getstate()
        random.setstate(self._random_state)
        try:
            return call()
        finally:
            self._random_state = random.getstate()
            random.setstate(outside)

    def _read_messages(self) -> str:
        """What the game said since the last call, minus the player's own move; the
        board is remembered, so a refused move still shows it."""
        _, messages = self._raw.get_observation()
        said: list[str] = []
        board_now = False
        for _, text, kind in messages:
            text = _printable(str(text)).strip()
            if kind.name == "PROMPT":
                self._prompt = text
            elif kind.name in ("GAME_BOARD", "GAME_ACTION_DESCRIPTION") and "\n" in text:
                self._board, board_now = text, True  # a multi-line message is a board
            elif kind.name != "PLAYER_ACTION" and text:
                said.append(text)
        if self._board and (board_now or said):
            said.append(self._board)
        return "\n\n".join(said)[: self.max_observation_length]

    def _measure(self) -> float | None:
        """The game's potential now (None: none here, or the game has no measure)."""
        if self.game.potential is None:
            return None
        try:
            value = self.game.potential(self._raw)
        except Exception:  # a state the measure does not know: no progress, the game goes on
            logger.debug("no potential for this state of %s", self.game_id, exc_info=True)
            return None
        return None if value is None else float(value)

    def _game_reward(self) -> float:
        rewards = self._raw.state.rewards or {}
        return float(rewards.get(0, 0.0))

    def _info(self) -> dict[str, Any]:
        state = self._raw.state
        finished = bool(state.done)
        game_info = state.game_info.get(0, {})
        won = finished and not game_info.get("invalid_move") and self._game_reward() >= 1.0
        legal = [] if self._done else self.game.moves(self._raw)
        expert = self.game.expert(self._raw) if self.game.expert and legal else None
        return {
            "game": self.game_id,
            "prompt": self._prompt,
            "legal_moves": legal,
            "expert_move": expert,
            "won": bool(won),
            "invalid_move": bool(game_info.get("invalid_move", False)),
            "reason": _printable(str(game_info.get("reason") or "")),
            "game_reward": self._game_reward() if finished else None,
            "progress": self._progress,
            "potential": self._potential,
            "episode_step": self._steps,
        }
