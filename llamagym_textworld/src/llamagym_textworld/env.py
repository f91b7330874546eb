"""A Gymnasium environment over TextWorld games.

Why not ``textworld.gym``: its environments follow the old Gym API (``reset()`` takes no
seed, ``step`` returns four values and the *cumulative* score, "done" mixes winning with
the step limit) and they cycle through their games with a private RNG, so which game a
reset starts cannot be tied to the reset seed. This adapter drives the same machinery one
level lower, ``textworld.start(path, EnvInfos(...))``, which returns TextWorld's own
state-tracking wrapper around the Jericho/Frotz interpreter, and adds the Gymnasium
semantics on top.

Spaces. Both are :class:`gymnasium.spaces.Text`. Observations are the game's feedback,
tidied (see ``clean_observations``), with any character outside printable ASCII replaced
by ``?`` and cut to ``max_observation_length`` characters, so that every observation is
really inside the declared space. TextWorld's generated games only print ASCII (the
intro banner uses ``$``, ``|`` and backslashes), so in practice nothing is replaced.
Commands are free text: the action space lists the characters a command is made of,
but :meth:`TextWorldEnv.step` accepts any string, since the game's parser, not the
space, decides what a command means. The legal commands are in
``info["admissible_commands"]``.
"""

from __future__ import annotations

import re
import string
import warnings
from collections.abc import Sequence
from os import PathLike
from pathlib import Path
from typing import Any, SupportsFloat

import gymnasium as gym
from gymnasium import spaces

from llamagym_textworld.games import MissingDependencyError, check_game_files

__all__ = ["ACTION_CHARSET", "OBSERVATION_CHARSET", "TextWorldEnv"]

#: Printable ASCII including whitespace: everything TextWorld's games print.
OBSERVATION_CHARSET = string.printable
#: Characters of a typical command (TextWorld entity names are words, hyphens, apostrophes).
ACTION_CHARSET = string.ascii_letters + string.digits + " -'.,"

# The interpreter ends each output with the input prompt ">" followed by the status line
# (room name and score/moves) that Jericho prints on the same line; that tail is noise to
# an agent, and the moves counter in it would make identical states read differently.
_OBSERVATION_CHARS = frozenset(OBSERVATION_CHARSET)
_PROMPT_TAIL = re.compile(r"\n>[^\n]*\s*\Z")
_BLANK_RUNS = re.compile(r"\n{3,}")
_TRAILING_SPACES = re.compile(r"[ \t]+\n")


#: The interpreter's own verbs, which act on its session, not in the game: save and
#: restore (and Inform's recording and replay) write and read files, quit, restart and
#: undo ask a yes-or-no question the next command would answer, script and its kin
#: start a transcript file. A free-text command starting with one never reaches the
#: interpreter: the game answers :data:`REFUSED_FEEDBACK`, and the step counts.
INTERPRETER_VERBS = frozenset({
    "save", "restore", "quit", "q", "restart", "undo", "script", "unscript",
    "transcript", "noscript", "verify", "recording", "replay",
})
REFUSED_FEEDBACK = "That command is not part of this game."


#: What a command may hold on its way to the interpreter: printable ASCII but the
#: backslash. A control character crashes it (``\x11`` ends the process with a
#: segmentation fault), and a line starting with a backslash is one of the interpreter's
#: own commands (``\help``), not the game's.
_TYPED = frozenset(string.ascii_letters + string.digits + string.punctuation + " ") - {"\\"}
MAX_COMMAND_CHARS = 500


def typed_command(action: Any) -> str:
    """``action`` as a player could type it: any other character a space, whitespace
    collapsed to single spaces (one line: the interpreter reads only the first),
    at most :data:`MAX_COMMAND_CHARS` long."""
    text = str(action)[: 4 * MAX_COMMAND_CHARS]
    if not _TYPED.issuperset(text):
        text = "".join(c if c in _TYPED else " " for c in text)
    return " ".join(text.split())[:MAX_COMMAND_CHARS]


def clean_feedback(text: str) -> str:
    """Drop the trailing prompt/status line, trailing spaces and runs of blank lines."""
    text = _PROMPT_TAIL.sub("", text)
    text = _TRAILING_SPACES.sub("\n", text)
    text = _BLANK_RUNS.sub("\n\n", text)
    return text.strip("\n").rstrip()


def _room_of(state: Any) -> str:
    """The room the player is in (TextWorld's fact ``at(P, room)``), or ""."""
    return next(
        (fact.arguments[1].name for fact in state.get("facts") or ()
         if fact.name == "at" and fact.arguments and fact.arguments[0].name == "P"),
        "",
    )


def _import_textworld() -> Any:
    try:
        import textworld
    except ImportError as exc:
        raise MissingDependencyError() from exc
    return textworld


class TextWorldEnv(gym.Env[str, str]):
    """Play TextWorld games through Gymnasium's API.

    Args:
        game_files: one ``.z8`` path or several (each with its ``.json`` beside it, as
            :func:`llamagym_textworld.games.make_game` writes). With several, each reset
            picks one with the environment's RNG, so ``reset(seed=s)`` always starts the
            same game; ``options={"game_index": i}`` picks one explicitly.
        max_episode_steps: steps before the episode is truncated.
        win_bonus: added to the reward of the step that wins.
        step_penalty: subtracted from every step's reward (a cost for dawdling; pass a
            positive number).
        progress_reward: added for each command a step takes off the game's own plan to
            win (TextWorld's ``policy_commands`` from the current state), and taken off
            for each command a step adds to it. A shaping term of the potential-based
            kind (minus the plan's length is the potential): over an episode it sums to
            ``progress_reward`` times the plan's start length less its end length, so a
            detour undone costs nothing and the best policy stays the best.
        max_observation_length: observations are cut to this many characters.
        clean_observations: tidy the game's text (see :func:`clean_feedback`); ``False``
            gives the interpreter's raw output (still cut and ASCII-only).
        render_mode: ``"ansi"`` (``render()`` returns the last command and observation)
            or ``"human"`` (prints them).

    The reward of a step is the increase of the game's score, plus ``win_bonus`` when the
    step wins, plus ``progress_reward`` per command the plan to win lost (minus per command
    it gained), minus ``step_penalty``; over a winning episode with neither bonus,
    progress nor penalty the rewards add up to ``max_score``. ``info["progress"]`` is the
    step's change of the plan's length (positive: closer to winning).

    ``info`` holds, on reset and on every step: ``objective``, ``admissible_commands``
    (sorted), ``score``, ``max_score``, ``won``, ``lost``, ``walkthrough`` (the game's
    winning command list from generation time), plus ``policy_commands`` (TextWorld's
    current shortest plan from *this* state), ``progress`` (see above; 0 on reset),
    ``room`` (the name of the room the player is in), ``episode_step``, ``game_file``
    and ``game_index``. Lists are fresh copies on every call.
    """

    # render_fps means nothing for text; it is declared only because Gymnasium's checker
    # warns when a render mode has none.
    metadata = {"render_modes": ["human", "ansi"], "render_fps": 1}

    def __init__(
        self,
        game_files: str | PathLike[str] | Sequence[str | PathLike[str]],
        *,
        max_episode_steps: int = 50,
        win_bonus: float = 0.0,
        step_penalty: float = 0.0,
        progress_reward: float = 0.0,
        max_observation_length: int = 16_384,
        max_command_length: int = 200,
        clean_observations: bool = True,
        render_mode: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(game_files, (str, PathLike)):
            game_files = [game_files]
        if not game_files:
            raise ValueError("TextWorldEnv needs at least one game file")
        if max_episode_steps < 1:
            raise ValueError("max_episode_steps must be >= 1")
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be one of {self.metadata['render_modes']}")

        self.game_files: list[Path] = check_game_files(game_files)
        self.max_episode_steps = int(max_episode_steps)
        self.win_bonus = float(win_bonus)
        self.step_penalty = float(step_penalty)
        self.progress_reward = float(progress_reward)
        self.max_observation_length = int(max_observation_length)
        self.clean_observations = bool(clean_observations)
        self.render_mode = render_mode

        # min_length=0: once the prompt line is stripped a reply can be empty, and that is
        # still a legitimate observation, so the space must contain "".
        self.observation_space = spaces.Text(
            max_length=self.max_observation_length, min_length=0, charset=OBSERVATION_CHARSET
        )
        self.action_space = spaces.Text(
            max_length=int(max_command_length), min_length=1, charset=ACTION_CHARSET
        )

        self._textworld = _import_textworld()
        # What TextWorld computes for us each step. Admissible commands, the winning
        # policy and win/lost come from its state tracker replaying the game's logic
        # (which needs the .json); objective, max_score and the walkthrough (an "extra")
        # are read from that .json.
        self._request_infos = self._textworld.EnvInfos(
            feedback=True,
            objective=True,
            admissible_commands=True,
            policy_commands=True,
            score=True,
            max_score=True,
            won=True,
            lost=True,
            facts=True,
            extras=["walkthrough"],
        )
        self._tw_env: Any = None
        self._state: Any = {}  # the game's state after the last reset or step
        self._loaded: Path | None = None
        self._game_index = 0
        self._walkthrough: list[str] = []
        self._score = 0
        self._plan_length = 0
        self._progress = 0
        self._steps = 0
        self._done = True
        self._last_obs = ""
        self._last_command: str | None = None

    # ------------------------------------------------------------------ Gymnasium API
    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        options = options or {}
        if "game_index" in options:
            index = int(options["game_index"])
            if not 0 <= index < len(self.game_files):
                raise IndexError(f"game_index {index} out of range({len(self.game_files)})")
        else:
            # The game comes from the env's seeded RNG, so reset(seed=s) replays the same
            # game and an unseeded reset continues the seeded sequence.
            index = int(self.np_random.integers(len(self.game_files)))
        self._game_index = index
        path = self.game_files[index]

        if self._loaded != path:
            with warnings.catch_warnings():
                # Jericho warns that it cannot read score/moves of any game outside its
                # catalogue. TextWorld's own tracker supplies those for its games, so the
                # warning is noise here.
                warnings.filterwarnings("ignore", message=r"Game .* is not fully supported")
                if self._tw_env is None:
                    self._tw_env = self._textworld.start(str(path), self._request_infos)
                else:
                    # Reuse the interpreter: load() swaps the story file and its .json.
                    self._tw_env.load(str(path))
            self._loaded = path

        state = self._tw_env.reset()
        self._state = state
        self._walkthrough = list(state.get("extra.walkthrough") or [])
        if not self._walkthrough:
            # Games made outside make_game may lack the metadata; the tracker's plan from
            # the initial state is an equally valid walkthrough.
            self._walkthrough = list(state.get("policy_commands") or [])
        self._score = int(state.get("score") or 0)
        self._plan_length = len(state.get("policy_commands") or [])
        self._progress = 0
        self._steps = 0
        self._done = False
        self._last_command = None
        self._last_obs = self._observation(state)
        return self._last_obs, self._info(state)

    def step(self, action: str) -> tuple[str, SupportsFloat, bool, bool, dict[str, Any]]:
        if self._tw_env is None or self._done:
            raise RuntimeError("call reset() before step() (and after an episode ends)")
        command = typed_command(action)
        if command.split(" ", 1)[0].lower() in INTERPRETER_VERBS:
            return self._refused(command)
        state, score, done = self._tw_env.step(command)
        self._steps += 1
        self._state = state

        score = int(score or 0)
        won = bool(state.get("won"))
        lost = bool(state.get("lost"))
        reward = float(score - self._score)
        self._score = score
        if won:
            reward += self.win_bonus
        # A won game has no plan left; a lost one is scored by its end, not its plan.
        plan_length = 0 if won else len(state.get("policy_commands") or [])
        self._progress = 0 if lost else self._plan_length - plan_length
        self._plan_length = plan_length
        reward += self.progress_reward * self._progress
        reward -= self.step_penalty

        terminated = bool(done or won or lost)
        truncated = not terminated and self._steps >= self.max_episode_steps
        # After the end the interpreter only answers "RESTART, RESTORE ... or QUIT?",
        # so further steps are refused rather than fed to it.
        self._done = terminated or truncated
        self._last_command = command
        self._last_obs = self._observation(state)
        return self._last_obs, reward, terminated, truncated, self._info(state)

    def _refused(self, command: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """An interpreter verb (:data:`INTERPRETER_VERBS`): a step that changes nothing
        in the game, as an unknown command does."""
        self._steps += 1
        self._progress = 0
        truncated = self._steps >= self.max_episode_steps
        self._done = truncated
        self._last_command, self._last_obs = command, REFUSED_FEEDBACK
        return REFUSED_FEEDBACK, -self.step_penalty, False, truncated, self._info(self._state)

    def render(self) -> str | None:
        if self.render_mode is None:
            gym.logger.warn("render() called without a render_mode; pass render_mode=...")
            return None
        text = self._last_obs
        if self._last_command is not None:
            text = f"> {self._last_command}\n{text}"
        if self.render_mode == "ansi":
            return text + "\n"
        print(text)
        return None

    def close(self) -> None:
        # Frees the interpreter (Jericho keeps a private copy of libfrotz per instance).
        if self._tw_env is not None:
            self._tw_env.close()
            self._tw_env = None
            self._loaded = None
        self._done = True
        super().close()

    # ------------------------------------------------------------------ helpers
    @property
    def current_game(self) -> Path:
        """The game file the current (or last) episode plays."""
        return self.game_files[self._game_index]

    def _observation(self, state: Any) -> str:
        text = str(state.get("feedback") or "")
        if self.clean_observations:
            text = clean_feedback(text)
        # Keep the promise of the observation space: ASCII only, bounded length.
        if not _OBSERVATION_CHARS.issuperset(text):
            text = "".join(c if c in _OBSERVATION_CHARS else "?" for c in text)
        return text[: self.max_observation_length]

    def _info(self, state: Any) -> dict[str, Any]:
        admissible = sorted(state.get("admissible_commands") or [])
        return {
            "objective": str(state.get("objective") or ""),
            "admissible_commands": admissible,
            "room": _room_of(state),
            "score": self._score,
            "max_score": int(state.get("max_score") or 0),
            "won": bool(state.get("won")),
            "lost": bool(state.get("lost")),
            "walkthrough": list(self._walkthrough),
            "policy_commands": list(state.get("policy_commands") or []),
            "progress": self._progress,
            "episode_step": self._steps,
            "game_file": str(self.current_game),
            "game_index": self._game_index,
        }
