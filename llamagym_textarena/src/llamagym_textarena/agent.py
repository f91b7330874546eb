"""The TextArena agents: one per game, all read and written the same way.

The game's rules (its first message) are said once per episode, in the system prompt
(``episode_context``); a user turn is what the game printed since the last move (the
board, a hint, why a move was refused). The moves are the game's own text (``[A C]``,
``[up]``, ``[7]``): score mode ranks the legal ones the game allows now
(``info["legal_moves"]``); generate mode reads a reply through the extraction chain:
the JSON parser (``{"action": "[A C]"}``), then this agent (the first bracketed move in
the reply, or its first line as a move, in any case and spacing), then the regex parser.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from llamagym.agent import Agent
from llamagym.config import MAX_EPISODE_STEPS, MAX_OBSERVATION_CHARS
from llamagym.display import cut
from llamagym.plugin_runtime.registry import AgentSpec
from llamagym_textarena import plugin
from llamagym_textarena.games import GAMES

# Bounds on the work one reply can cause.
_MAX_REPLY_CHARS = 2000
_MAX_MOVE_CHARS = 60
_BRACKETED = re.compile(r"\[[^\[\]\n]{0,60}\]")
# Listing the moves in a generate-mode prompt helps with a few; hundreds (Mastermind's
# 360 codes) would swamp it.
_MOST_MOVES_LISTED = 40


class TextArenaOptions(BaseModel):
    """The ``agent`` section keys every TextArena agent reads (each adds ``game``)."""

    model_config = ConfigDict(extra="forbid")
    max_episode_steps: int = Field(
        200, ge=1, le=MAX_EPISODE_STEPS,
        description="Moves (refused ones included) before an episode is cut; every game "
        "also has its own turn limit.",
    )
    max_observation_chars: int = Field(
        2000, ge=50, le=MAX_OBSERVATION_CHARS, description="Game text longer than this is cut."
    )
    list_moves: bool | None = Field(
        None,
        description="Name the legal moves in the prompt; null = in generate mode when "
        f"there are at most {_MOST_MOVES_LISTED}.",
    )


def normalise_move(text: str) -> str:
    """``[a, c]``, ``[ A C ]`` and ``[A C]`` alike: lower case, commas as spaces, single
    spaces, none inside the brackets."""
    words = " ".join(text.replace(",", " ").split()).lower()
    return words.replace("[ ", "[").replace(" ]", "]")


def random_move(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def expert_move(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """The game's strong player (``info["expert_move"]``), or a random legal move."""
    move = info.get("expert_move")
    return move if move in legal else random_move(observation, info, legal, rng)


#: Mastermind's turns per forward pass in an update (each turn ranks up to 360 codes).
MASTERMIND_MICROBATCH = 4
#: The digits of a Mastermind code, in both of its games.
MASTERMIND_CODE_LENGTH = 4


def _defaults(history_turns: int | None) -> dict[str, Any]:
    return {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": history_turns,
                    "reply_prefix": "[", "max_new_tokens": 12},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 32, "epochs": 2, "gamma": 0.95,
                      "entropy_coef": 0.01},
        "training": {"minutes": 15, "eval_episodes": 100, "threads": 1},
    }


class TextArenaAgent(Agent):
    """What every TextArena agent shares; a subclass names its game (``family``)."""

    family: str = ""
    example_move: str = ""
    baselines = {"random": random_move}
    # Read from the game's end state, not the return (a lost game scores its share done).
    outcome_names = ("won", "lost", "invalid move")
    # Boards hold the whole state: no earlier turn is needed (guessing games keep them).
    defaults = _defaults(history_turns=0)
    Config: type[BaseModel] = TextArenaOptions
    options: Any

    def make_env(self) -> Any:
        from llamagym_textarena.env import TextArenaEnv

        return TextArenaEnv(
            self.options.game,
            max_episode_steps=self.options.max_episode_steps,
            max_observation_length=self.options.max_observation_chars,
        )

    # -- prompts --------------------------------------------------------------------
    def get_system_prompt(self) -> str:
        prompt = "You are playing a puzzle game. Win it in as few moves as you can."
        if self.config.rollout.mode == "generate":
            return prompt + f" Reply with one move in the game's format, e.g. {self.example_move}."
        return prompt + " Reply with one move."  # score mode puts each move after the prompt

    def episode_context(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        rules = str(info.get("prompt") or "").strip()
        if not rules:
            return None
        return f"The game's rules:\n{rules[: self.options.max_observation_chars]}"

    def format_observation(self, observation: Any, info: dict) -> str:
        text = str(observation).strip()
        text = cut(text, self.options.max_observation_chars)
        moves = self.legal_actions(observation, info)
        if self.lists_moves(len(moves)):
            text += "\n\nLegal moves: " + ", ".join(moves)
        return text

    def lists_moves(self, count: int) -> bool:
        if self.options.list_moves is None:
            return self.config.rollout.mode == "generate" and count <= _MOST_MOVES_LISTED
        return bool(self.options.list_moves)

    def outcome(self, episode_return: float, info: Mapping[str, Any]) -> str:
        if info.get("invalid_move") is True:
            return "invalid move"
        return "won" if info.get("won") is True else "lost"

    # -- actions --------------------------------------------------------------------
    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        return list(info.get("legal_moves") or [])

    def env_action(self, index: int, legal_actions: Sequence[str]) -> str:
        return legal_actions[index]  # the env steps on the move's text

    def extract_action(self, response: str) -> str | None:
        """The first bracketed move in the reply, else its first line as a move."""
        text = response[:_MAX_REPLY_CHARS]
        found = _BRACKETED.search(text)
        if found:
            return found.group(0)
        first_line = next((line.strip() for line in text.splitlines() if line.strip()), "")
        first_line = first_line.strip("\"'`.!").strip()
        return f"[{first_line}]" if first_line and len(first_line) <= _MAX_MOVE_CHARS else None

    def action_index(self, value: Any, legal_actions: Sequence[str]) -> int | None:
        if not isinstance(value, str):
            return super().action_index(value, legal_actions)
        wanted = normalise_move(value[:_MAX_MOVE_CHARS + 2])
        for index, move in enumerate(legal_actions):
            if normalise_move(move) == wanted:
                return index
        return None


def _options(spec: AgentSpec, family: str) -> type[BaseModel]:
    """The agent's options: the shared ones and ``game``, one of its game's variants."""
    variants = GAMES[family].variants
    game = (Literal[variants],  # type: ignore[valid-type]
            Field(spec.env_id, description="The TextArena game played: " + ", ".join(variants)))
    return create_model(f"{family}Options", __base__=TextArenaOptions, game=game)


@plugin.TOWER_OF_HANOI.bind
class TowerOfHanoiAgent(TextArenaAgent):
    family, example_move = "TowerOfHanoi", "[A C]"
    Config = _options(plugin.TOWER_OF_HANOI, family)
    baselines = {"random": random_move, "optimal": expert_move}


@plugin.LIGHTS_OUT.bind
class LightsOutAgent(TextArenaAgent):
    family, example_move = "LightsOut", "[2 3]"
    Config = _options(plugin.LIGHTS_OUT, family)
    baselines = {"random": random_move, "solver": expert_move}


@plugin.FROZEN_LAKE.bind
class FrozenLakeAgent(TextArenaAgent):
    family, example_move = "FrozenLake", "[down]"
    Config = _options(plugin.FROZEN_LAKE, family)
    baselines = {"random": random_move, "shortest-path": expert_move}


@plugin.GUESS_THE_NUMBER.bind
class GuessTheNumberAgent(TextArenaAgent):
    family, example_move = "GuessTheNumber", "[10]"
    Config = _options(plugin.GUESS_THE_NUMBER, family)
    baselines = {"random": random_move, "binary-search": expert_move}
    defaults = _defaults(history_turns=None)  # the hints are in the earlier turns


@plugin.MASTERMIND.bind
class MastermindAgent(TextArenaAgent):
    family, example_move = "Mastermind", "[1 2 3 4]"
    Config = _options(plugin.MASTERMIND, family)
    baselines = {"random": random_move, "consistent-guess": expert_move}
    defaults = _defaults(history_turns=None)  # the answers are in the earlier turns
    # Up to 360 codes ranked per turn: a minibatch of 32 turns in one pass held 15.8 GB
    # on the tiny model (and was killed for memory); in passes of 4 turns, 2.2 GB.
    defaults["algorithm"]["microbatch_size"] = MASTERMIND_MICROBATCH
    # A pretrained model writes its code instead: ranking 360 codes is ~2,000 tokens a
    # turn, and 20 of SmolLM2-135M's games did not finish in 27 minutes on a 2-core CPU
    # (5.8 GB). A reply of a few tokens names the code, and the update trains only those
    # tokens. `--set rollout.mode=score` still ranks them, a few turns per pass.
    pretrained_defaults = {
        "score": {"rollout": {"mode": "generate"},
                  "algorithm": {"microbatch_size": MASTERMIND_MICROBATCH}}
    }

    def extract_action(self, response: str) -> str | None:
        """A bracketed move, else the reply's first four digits as a code: a reply that
        runs on past its code (``[4,3,2,1,3,2,`` at the token limit) still names one."""
        text = response[:_MAX_REPLY_CHARS]
        if _BRACKETED.search(text) is None:
            digits = re.findall(r"[0-9]", text[:_MAX_MOVE_CHARS])
            if len(digits) >= MASTERMIND_CODE_LENGTH:
                return "[" + " ".join(digits[:MASTERMIND_CODE_LENGTH]) + "]"
        return super().extract_action(text)


@plugin.SUDOKU.bind
class SudokuAgent(TextArenaAgent):
    family, example_move = "Sudoku", "[2 5 8]"
    Config = _options(plugin.SUDOKU, family)
    baselines = {"random": random_move, "solution": expert_move}
