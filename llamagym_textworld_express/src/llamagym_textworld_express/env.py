"""A Gymnasium environment over one TextWorldExpress game.

Why an adapter: TextWorldExpress's ``TextWorldExpressEnv`` follows the old Gym API
(``step`` returns four values, ``done`` mixes a win with its own step limit), starts a
JVM per instance and waits on Java without a limit. This env plays the same games
through the same Java interface (``textworldexpress.runtime.PythonInterface``, one per
env, on the JVM the process's envs share: :mod:`llamagym_textworld_express.jvm`) and
adds Gymnasium's semantics:

* The game and its parameters are fixed when the env is made; the parameter string is
  checked against the game's keys (:mod:`llamagym_textworld_express.games`) before any
  JVM starts, and then by the game itself.
* ``reset(seed=s)`` always deals the same game: the env's random stream, seeded by
  ``s``, picks one of the fold's seeds (``fold``: TextWorldExpress's train, dev and
  test seeds, 1,000 each, which never overlap; held-out objects and recipes too, in
  CookingWorld and TextWorld Commonsense). ``info["game_seed"]`` says which.
* The reward is the change in the game's own score, so an episode's return is its
  final score: 1 once the task is done, a share of it for a task partly done, and -1
  where the game ends the task failed (Arithmetic, Sorting, Simon Says and Pecking
  Order, on a wrong object or action).
* ``terminated`` when the game says the task succeeded or failed (``info["won"]``,
  ``info["lost"]``); ``truncated`` after ``max_episode_steps`` steps.
* ``info["valid_actions"]`` lists the actions the game accepts now, sorted;
  ``info["task"]`` is the task description; ``info["gold_action"]`` is the next action
  of the game's gold path while every action so far followed it (else None).
* Everything the game sends is data: text outside printable ASCII becomes ``?``, an
  observation is cut to ``max_observation_length`` characters, an action is at most
  :data:`MAX_ACTION_CHARS`, and an answer from Java larger than
  :data:`MAX_ANSWER_CHARS` fails the env.
* A call that takes longer than ``timeout_seconds``, or a JVM that died, fails the
  env with :class:`~llamagym_textworld_express.jvm.JavaFailure`, never a hang;
  ``close()`` gives the env's JVM lease back (the JVM ends with its last env).
"""

from __future__ import annotations

import json
import math
import re
import string
import weakref
from typing import Any, Literal, SupportsFloat

import gymnasium as gym
from gymnasium import spaces

from llamagym.errors import ConfigError
from llamagym_textworld_express.games import GAMES, game_params_text, parse_game_params
from llamagym_textworld_express.jvm import SHARED_JAVA, JavaFailure, JavaLease, SharedJava

__all__ = [
    "FOLDS", "MAX_ACTION_CHARS", "MAX_ANSWER_CHARS", "TextWorldExpressEnv", "printable_text",
]

Fold = Literal["train", "dev", "test"]
FOLDS: tuple[Fold, ...] = ("train", "dev", "test")
#: The longest action the env passes on or offers; the games' are a few words.
MAX_ACTION_CHARS = 200
#: The most characters one answer from Java may hold (a step's JSON is a few KB).
MAX_ANSWER_CHARS = 1_000_000
_PRINTABLE = frozenset(string.printable)
_ONE_LINE = frozenset(string.printable) - set("\t\n\r\x0b\x0c")
_SEEDS = re.compile(r"-?[0-9]{1,10}")
#: The most valid actions read from one answer (CookingWorld's largest worlds list a few
#: hundred).
_MOST_VALID_ACTIONS = 1000


def printable_text(text: Any) -> str:
    """``text`` with every character outside printable ASCII replaced by ``?``."""
    text = str(text)
    return text if _PRINTABLE.issuperset(text) else "".join(
        c if c in _PRINTABLE else "?" for c in text
    )


def _action_text(action: Any) -> str:
    """An action as one printable line, single-spaced, at most MAX_ACTION_CHARS."""
    text = str(action)[: 4 * MAX_ACTION_CHARS]
    if not _ONE_LINE.issuperset(text):
        text = "".join(c if c in _ONE_LINE else " " for c in text)
    return " ".join(text.split())[:MAX_ACTION_CHARS]


class TextWorldExpressEnv(gym.Env[str, str]):
    """Play the TextWorldExpress game ``game`` (``coin``, ``cookingworld``, ...).

    Args:
        game: a name from :data:`llamagym_textworld_express.games.GAMES`.
        game_params: the game's parameter string (``"numLocations=5,includeDoors=0"``);
            empty: TextWorldExpress's defaults for the game.
        fold: the seeds episodes are drawn from: ``train``, ``dev`` or ``test``.
        max_episode_steps: steps before the episode is truncated.
        timeout_seconds: the longest one call to Java (or starting the JVM) may take.
        max_observation_length: observations are cut to this many characters.
        java: the pool the env leases its JVM from (default
            :data:`~llamagym_textworld_express.jvm.SHARED_JAVA`, the process's own).
    """

    metadata = {"render_modes": ["ansi"], "render_fps": 1}

    def __init__(
        self,
        game: str,
        game_params: str = "",
        *,
        fold: Fold = "train",
        max_episode_steps: int = 50,
        timeout_seconds: float = 60.0,
        max_observation_length: int = 4000,
        render_mode: str | None = None,
        java: SharedJava | None = None,
    ) -> None:
        super().__init__()
        if game not in GAMES:
            raise ConfigError(f"TextWorldExpress game {game!r} is not one of {', '.join(GAMES)}")
        if fold not in FOLDS:
            raise ConfigError(f"fold {fold!r} is not one of {', '.join(FOLDS)}")
        if max_episode_steps < 1 or not timeout_seconds > 0:
            raise ConfigError("max_episode_steps must be >= 1 and timeout_seconds > 0")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ConfigError(f"render_mode must be one of {self.metadata['render_modes']}")
        try:  # before any JVM starts
            params = game_params_text(parse_game_params(GAMES[game], game_params))
        except ValueError as error:
            raise ConfigError(f"agent.game_params: {error}") from None
        self.game, self.game_params, self.fold = game, params, fold
        self.max_episode_steps = int(max_episode_steps)
        self.max_observation_length = int(max_observation_length)
        self.render_mode = render_mode
        self.observation_space = spaces.Text(
            max_length=self.max_observation_length, min_length=0, charset=string.printable
        )
        self.action_space = spaces.Text(
            max_length=MAX_ACTION_CHARS, min_length=0, charset=string.printable
        )
        self._lease: JavaLease = (java or SHARED_JAVA).lease(timeout_seconds)
        self._finalizer = weakref.finalize(self, self._lease.close)
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        self._observation, self._info = "", {}
        self._score, self._steps, self._done = 0.0, 0, True
        self._gold: list[str] = []
        self._on_gold_path = False

    @property
    def java_pid(self) -> int:
        """The pid of the JVM this env plays on."""
        return self._lease.process.pid

    # ------------------------------------------------------------------ Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._game_seed = self._seeds[int(self.np_random.integers(len(self._seeds)))]
        game = self._lease.game
        answer = self._call("starting a game",
                            lambda: game.generateNewGameJSON(self._game_seed, self.fold, True))
        task = self._text(self._call("reading the task", game.getTaskDescription))
        self._task = printable_text(task)[: self.max_observation_length]
        # One call, not one per action: a list read element by element from Python is a
        # round trip to Java for each.
        gold = self._text(self._call(
            "reading the gold path",
            lambda: self._lease.jvm.java.lang.String.join("\n", game.getGoldActionSequence()),
        ))
        self._gold = [_action_text(a) for a in gold.splitlines() if a.strip()]
        self._steps, self._done, self._on_gold_path = 0, False, True
        self._score, _, _ = self._read(answer)
        return self._observation, self._info

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._done:
            raise RuntimeError("call reset() before step() (and after an episode ends)")
        command = _action_text(action)
        game = self._lease.game
        answer = self._call("taking a step", lambda: game.stepJSON(command))
        gold = self._gold[self._steps] if self._steps < len(self._gold) else None
        self._on_gold_path = self._on_gold_path and command == gold
        self._steps += 1
        before = self._score
        self._score, won, lost = self._read(answer)
        terminated = won or lost
        truncated = not terminated and self._steps >= self.max_episode_steps
        self._done = terminated or truncated
        if self._done:  # nothing is offered once the episode is over
            self._info["valid_actions"], self._info["gold_action"] = [], None
        return self._observation, self._score - before, terminated, truncated, self._info

    def render(self) -> str | None:
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode='ansi'")
            return None
        return self._observation + "\n"

    def close(self) -> None:
        """Give the JVM lease back (the JVM ends with the process's last env)."""
        self._done = True
        self._finalizer()

    # ------------------------------------------------------------------ helpers
    def _call(self, what: str, function: Any) -> Any:
        return self._lease.call(f"TextWorldExpress {self.game}: {what}", function)

    def _text(self, answer: Any) -> str:
        if not isinstance(answer, str):
            raise JavaFailure(f"TextWorldExpress {self.game} answered a {type(answer).__name__}, "
                              "not text")
        if len(answer) > MAX_ANSWER_CHARS:
            raise JavaFailure(f"TextWorldExpress {self.game} answered {len(answer):,} characters "
                              f"(at most {MAX_ANSWER_CHARS:,} are read)")
        return answer

    def _load(self) -> None:
        game = self._lease.game
        refused = self._call("loading the game", lambda: game.load(self.game, self.game_params))
        if refused:
            raise ConfigError(f"agent.game_params: TextWorldExpress refused {self.game_params!r} "
                              f"for {self.game}: {printable_text(refused)[:300].strip()}")
        getter = {"train": game.getSeedsTrain, "dev": game.getSeedsDev, "test": game.getSeedsTest}
        listed = self._text(self._call("reading the fold's seeds",
                                       lambda: getter[self.fold]().toString()))
        self._seeds = [int(seed) for seed in _SEEDS.findall(listed)]
        if not self._seeds:
            raise JavaFailure(f"TextWorldExpress {self.game} lists no {self.fold} seeds")

    def _read(self, answer: Any) -> tuple[float, bool, bool]:
        """Read one JSON answer of the game into the observation and the info; return
        its score and whether the task succeeded or failed."""
        try:
            parsed = json.loads(self._text(answer))
        except json.JSONDecodeError as error:
            raise JavaFailure(f"TextWorldExpress {self.game} answered malformed JSON: "
                              f"{error}") from None
        if not isinstance(parsed, dict):
            raise JavaFailure(f"TextWorldExpress {self.game} answered no JSON object")
        score = parsed.get("score")
        score = float(score) if isinstance(score, (int, float)) and math.isfinite(score) else 0.0
        won, lost = parsed.get("tasksuccess") is True, parsed.get("taskfailure") is True
        valid = parsed.get("validActions")
        listed = valid[:_MOST_VALID_ACTIONS] if isinstance(valid, list) else []
        actions = sorted({_action_text(a) for a in listed if isinstance(a, str)} - {""})
        observation = printable_text(parsed.get("observation", ""))
        self._observation = observation[: self.max_observation_length]
        on_path = self._on_gold_path and self._steps < len(self._gold)
        self._info = {
            "game": self.game,
            "game_params": self.game_params,
            "fold": self.fold,
            "game_seed": self._game_seed,
            "task": self._task,
            "valid_actions": actions,
            "score": score,
            "won": won,
            "lost": lost,
            "gold_action": self._gold[self._steps] if on_path else None,
            "gold_path_length": len(self._gold),
            "episode_step": self._steps,
        }
        return score, won, lost
