"""The TextWorld agent: prompts, admissible commands as actions, reply parsing, baselines.

The game's objective is said once, in the episode's system prompt (``episode_context``):
it survives however many old turns the engine drops to fit the model's context
(``rollout.history_turns`` keeps a window of recent turns and always keeps the system
prompt and the current turn), and a model that keeps each env's key/value cache runs it
once per episode, not in every turn.

Score mode ranks the admissible commands (by default those the episode has taken least
often in the same room: ``rollout.explore``). Generate mode reads a reply through
the extraction chain: the JSON parser (``{"command": "open door"}``), then this agent
(the reply is the command itself, or failing that the admissible command it is closest
to), then the regex parser (the last admissible command named anywhere in the reply).
"""

from __future__ import annotations

import difflib
import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llamagym.agent import Agent
from llamagym.config import MAX_EPISODE_STEPS, MAX_OBSERVATION_CHARS
from llamagym.display import cut
from llamagym.errors import LlamaGymError
from llamagym_textworld.baselines import FALLBACK_COMMAND, WalkthroughPolicy
from llamagym_textworld.games import (
    MAX_GAMES,
    MAX_OBJECTS,
    MAX_QUEST_LENGTH,
    MAX_SEED,
    MAX_WORLD_SIZE,
)
from llamagym_textworld.plugin import TEXTWORLD

logger = logging.getLogger(__name__)

# Bounds on the work one reply can cause: the part searched for verbatim commands, and
# the part of its first line compared by difflib, whose cost grows with the square of
# the length (a command is a few words).
_MAX_REPLY_CHARS = 2000
_MAX_COMMAND_CHARS = 200
_JSON_COMMAND = re.compile(r'"command"\s*:\s*"([^"\n]*)')
_LEADING_LABEL = re.compile(r"^\s*(?:>+|(?:command|action|answer)\s*[:=])\s*", re.IGNORECASE)


#: TextWorld's published game sets, as ``tw-make custom`` names them (world size,
#: objects, quest length) with the turns an episode gets there: the options each sets.
PRESETS: dict[str, dict[str, int]] = {
    "w2-o3-q4": {"world_size": 2, "nb_objects": 3, "quest_min_length": 4,
                 "quest_max_length": 4, "max_episode_steps": 12},
    "w4-o6-q8": {"world_size": 4, "nb_objects": 6, "quest_min_length": 8,
                 "quest_max_length": 8, "max_episode_steps": 24},
}
#: How far the test pool's seeds are from the training pool's: more than a pool holds,
#: so the two never share a game.
TEST_POOL_OFFSET = 100_000


class TextWorldOptions(BaseModel):
    """The ``agent`` section keys this agent reads, e.g. ``--set agent.games=50``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    preset: Literal["w2-o3-q4", "w4-o6-q8"] | None = Field(
        None,
        description="A published game set: its world size, objects, quest length and "
        "turns (an option given beside it wins).",
    )
    pool: Literal["train", "test"] = Field(
        "train",
        description="train: the games from first_seed up; test: as many held-out games, "
        f"first_seed + {TEST_POOL_OFFSET:,} up, never in a training pool.",
    )
    parser: Literal["admissible", "game"] = Field(
        "admissible",
        description="admissible: a reply is read as one of the game's admissible commands; "
        "game (generate mode): no command list anywhere, the reply is the command and the "
        "game's own parser judges it (an unknown one costs a step).",
    )
    games: int = Field(20, ge=1, le=MAX_GAMES, description="Games in the pool the envs play.")
    first_seed: int = Field(
        0, ge=0, le=MAX_SEED - TEST_POOL_OFFSET - MAX_GAMES,
        description="Seed of the first game; the rest count up.",
    )
    world_size: int = Field(3, ge=1, le=MAX_WORLD_SIZE, description="Rooms per game.")
    nb_objects: int = Field(
        5, ge=0, le=MAX_OBJECTS, description="Objects per game (at least)."
    )
    quest_min_length: int = Field(
        2, ge=1, le=MAX_QUEST_LENGTH, description="Shortest quest, in commands."
    )
    quest_max_length: int = Field(
        3, ge=1, le=MAX_QUEST_LENGTH, description="Longest quest, in commands."
    )
    max_episode_steps: int = Field(
        30, ge=1, le=MAX_EPISODE_STEPS, description="Steps before an episode is cut."
    )
    win_bonus: float = Field(
        0.0, ge=-1_000, le=1_000, description="Reward added on the step that wins."
    )
    step_penalty: float = Field(
        0.0, ge=0, le=1_000, description="Reward taken off every step."
    )
    max_observation_chars: int = Field(
        1200, ge=50, le=MAX_OBSERVATION_CHARS,
        description="Game text longer than this is cut (keeps prompts bounded).",
    )
    list_commands: bool | None = Field(
        None,
        description="Name the admissible commands in the prompt; null = only in generate "
        "mode (score mode puts each command after the prompt anyway).",
    )
    fuzzy_threshold: float = Field(
        0.8, ge=0, le=1, description="Least difflib similarity for a near-miss reply to count."
    )

    @model_validator(mode="before")
    @classmethod
    def _moved_options(cls, data: Any) -> Any:
        moved = {
            "least_tried": "rollout.explore, for every agent: --set "
            "rollout.explore=least-tried (the default) or all",
            "progress_reward": "rollout.progress_reward, for every env that reports "
            "info['progress']: --set rollout.progress_reward=R",
        }
        for key, now in moved.items():
            if isinstance(data, Mapping) and key in data:
                raise ValueError(f"agent.{key} is now {now}")
        return data

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("preset") in PRESETS:
            return {**PRESETS[data["preset"]], **data}
        return data

    @model_validator(mode="after")
    def _quest_range(self) -> TextWorldOptions:
        if self.quest_min_length > self.quest_max_length:
            raise ValueError(
                f"quest_min_length ({self.quest_min_length}) is above quest_max_length "
                f"({self.quest_max_length})"
            )
        return self


def random_admissible(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


class WalkthroughBaseline:
    """The oracle: replays the game's walkthrough (see :class:`WalkthroughPolicy`)."""

    def __init__(self) -> None:
        self._policy = WalkthroughPolicy()

    def reset(self) -> None:
        self._policy.reset()

    def __call__(self, observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
        command = self._policy(observation, info)
        return command if command in legal else legal[0]


def written_command(reply: str) -> str:
    """The command a reply writes (see :meth:`TextWorldAgent.extract_action`), at most
    ``_MAX_COMMAND_CHARS`` long."""
    written = _JSON_COMMAND.search(reply)  # closed or not: a reply may stop mid-way
    if written:
        return " ".join(written.group(1).split())[:_MAX_COMMAND_CHARS]
    first_line = next((line for line in reply.splitlines() if line.strip()), "")
    command = _LEADING_LABEL.sub("", first_line[:_MAX_COMMAND_CHARS]).strip()
    return command.strip("\"'`.!").strip()


def normalise(text: str) -> str:
    return " ".join(text.split()).lower()


def names_verbatim(reply: str, command: str) -> bool:
    """Whether ``command`` appears in ``reply`` as whole words (any case and spacing)."""
    if not command.split():
        return False
    words = r"\s+".join(map(re.escape, command.split()))
    return re.search(rf"(?<![\w-]){words}(?![\w-])", reply, re.IGNORECASE) is not None


def closest_command(
    text: str, commands: Sequence[str], threshold: float, margin: float = 0.05
) -> int | None:
    """Index of the command most similar to ``text``, if it is similar enough and
    clearly more similar than the runner-up (``go north`` vs ``go south`` must not
    be settled by a coin toss)."""
    wanted = normalise(text)
    if not wanted:
        return None
    ratios = [difflib.SequenceMatcher(None, wanted, normalise(c)).ratio() for c in commands]
    if not ratios:
        return None
    ranked = sorted(range(len(ratios)), key=ratios.__getitem__, reverse=True)
    best = ranked[0]
    if ratios[best] < threshold:
        return None
    if len(ranked) > 1 and ratios[best] - ratios[ranked[1]] < margin:
        return None
    return best


@TEXTWORLD.bind  # name, description and env_id come from the registration
class TextWorldAgent(Agent):
    baselines = {"random": random_admissible, "walkthrough": WalkthroughBaseline()}
    # A game is won or it is not (lost: TextWorld's own lost state, or the step limit
    # reached first). Read from the game's state, not the return, which win bonuses
    # and step penalties shift.
    outcome_names = ("won", "lost")
    # Score mode ranks a dozen admissible commands per turn, which a small model learns
    # far faster than writing commands out. Rewards are sparse (1 for the quest, at the
    # end), so the discount is what rewards short solutions. One turn of history tells
    # the model what it just did (the game's reply alone can be ambiguous) at half the
    # prompt length of two. Score-mode prompts are long (hundreds of tokens, one row per
    # command): minibatches of 32 turns keep a training step's memory to a few GB.
    defaults = {
        # The tiny model's numbers were measured with the game's score alone (no
        # progress reward); a pretrained model gets it (below).
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 1,
                    "reply_prefix": '{"command": "', "max_new_tokens": 16,
                    "progress_reward": 0.0},
        "algorithm": {
            "name": "ppo",
            "lr": 1e-3,
            "episodes_per_update": 16,
            "minibatch_size": 32,
            # Two epochs, not four: an update costs half as much, so 15 minutes hold
            # 1,360 episodes instead of 320 (100% vs 70% of the training games won;
            # python benchmarks/textworld.py).
            "epochs": 2,
            "credit": "gae",
            "gamma": 0.95,
            "gae_lambda": 0.95,
            "entropy_coef": 0.01,
        },
        # One torch thread for `tiny`: its forwards are too small to split well, and on
        # a busy machine a second thread mostly waits for a core (a pretrained model gets
        # torch's count back from the pretrained-model defaults).
        "training": {"minutes": 15, "eval_episodes": 100, "threads": 1},
    }
    # A pretrained model: a turn's prompt (a couple of hundred tokens, a dozen commands
    # scored after it) costs SmolLM2-135M a fraction of a second on the CPU, so 30
    # minutes hold a few hundred episodes, not the thousand the tiny model used. Each
    # has to teach more: the game's progress reward says at every step whether the move
    # shortened the plan to win, and a short discount (0.5) makes each move's credit its
    # own progress and the next one or two (the shaping keeps the shortest win the best
    # policy). 16 episodes per update; the whole history in the prompt measured slower
    # (prompts reach ~5,000 tokens by turn 30; docs/results.md).
    pretrained_defaults = {
        "score": {
            "rollout": {"num_envs": 8, "progress_reward": 1.0},
            "algorithm": {"episodes_per_update": 16, "gamma": 0.5, "lr": 5e-4,
                          "target_kl": 0.05},
        }
    }

    #: Options under ``agent.`` (``--set agent.KEY=VALUE``); ``self.options`` holds them.
    Config = TextWorldOptions
    options: TextWorldOptions
    _game_files: list[Path] | None = None  # made on first use

    # -- the environment ----------------------------------------------------------------
    def game_files(self) -> list[Path]:
        """The pool of games, generated into the cache on first use (then reused)."""
        if self._game_files is None:
            from llamagym_textworld.games import make_games

            options = self.options
            logger.info("making (or finding in the cache) %d TextWorld games", options.games)
            offset = TEST_POOL_OFFSET if options.pool == "test" else 0
            self._game_files = make_games(
                options.games,
                first_seed=options.first_seed + offset,
                world_size=options.world_size,
                nb_objects=options.nb_objects,
                quest_length=(options.quest_min_length, options.quest_max_length),
            )
        return self._game_files

    def make_env(self, game_files: Sequence[str | Path] | None = None) -> Any:
        """A :class:`TextWorldEnv` over the agent's pool (or over ``game_files``)."""
        from llamagym_textworld.env import TextWorldEnv

        options = self.options
        if options.parser == "game" and self.config.rollout.mode == "score":
            raise LlamaGymError(
                "agent.parser=game lets the game judge written commands, so it needs "
                "generate mode: add --set rollout.mode=generate (or keep "
                "agent.parser=admissible to rank the admissible commands)"
            )
        return TextWorldEnv(
            list(game_files) if game_files is not None else self.game_files(),
            max_episode_steps=options.max_episode_steps,
            win_bonus=options.win_bonus,
            step_penalty=options.step_penalty,
        )

    # -- prompts --------------------------------------------------------------------
    def get_system_prompt(self) -> str:
        prompt = "You are playing a text adventure. Reach the goal in as few moves as you can."
        if self.config.rollout.mode == "generate":
            return prompt + ' Reply with one valid command as JSON: {"command": "go north"}.'
        # Score mode puts each command, as plain text, right after the prompt.
        return prompt + " Reply with one valid command."

    def episode_context(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        """The game's objective, once per episode in the system prompt (the turn cache
        then keeps it across the episode's turns instead of running it every turn)."""
        objective = str(info.get("objective") or "").strip()
        return f"Goal: {objective[: self.options.max_observation_chars]}" if objective else None

    def format_observation(self, observation: Any, info: dict) -> str:
        objective = str(info.get("objective") or "").strip()
        text = str(observation)
        # The first observation repeats the objective under an ASCII-art banner: both
        # are noise beside the goal the system prompt states, and the banner costs
        # hundreds of tokens.
        if objective and objective in text:
            text = text.split(objective, 1)[1]
        text = text.strip()
        text = cut(text, self.options.max_observation_chars)
        lines = [text]
        if self.lists_commands:
            lines.append("Valid commands: " + ", ".join(self.legal_actions(observation, info)))
        return "\n\n".join(line for line in lines if line)

    @property
    def lists_commands(self) -> bool:
        if self.options.list_commands is None:
            return self.config.rollout.mode == "generate" and self.options.parser != "game"
        return self.options.list_commands

    def outcome(self, episode_return: float, info: Mapping[str, Any]) -> str:
        return "won" if info.get("won") is True else "lost"

    # -- actions --------------------------------------------------------------------
    def legal_actions(self, observation: Any, info: dict) -> Sequence[str] | None:
        """The admissible commands; None with ``agent.parser=game``, where any written
        command goes to the game (:meth:`extract_action` reads it)."""
        if self.options.parser == "game":
            return None
        return self.named_actions(observation, info)

    def named_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        """The admissible commands, whatever the parser (the baselines and checks play
        them). The game always accepts "look"; offering it when TextWorld lists nothing
        keeps the engine from ever facing an empty choice."""
        return list(info.get("admissible_commands") or [FALLBACK_COMMAND])

    def exploration_place(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        """The room (``rollout.explore``): the game's text after a command says what
        the command did, not where the player stands."""
        return str(info.get("room") or "") or None

    def env_action(self, index: int, legal_actions: Sequence[str]) -> str:
        return legal_actions[index]  # TextWorldEnv steps on the command text itself

    def extract_action(self, response: str) -> str | None:
        """The reply itself (cut short), or None if it is blank: reading it needs the
        admissible commands, which only :meth:`action_index` sees. With
        ``agent.parser=game``, the command itself, for the game's parser: the
        ``"command"`` of a JSON object, else the reply's first line without a label
        (a blank reply is the empty command, which the game answers as it does)."""
        text = response[:_MAX_REPLY_CHARS].strip()
        if self.options.parser != "game":
            return text or None
        return written_command(text)

    def action_index(self, value: Any, legal_actions: Sequence[str]) -> int | None:
        """The command a reply names: its first line is the command exactly (ignoring
        case, a ``>``/``Command:`` label and closing punctuation), or, when the reply
        names no command verbatim anywhere, the command its first line is closest to."""
        if not isinstance(value, str):
            return super().action_index(value, legal_actions)
        first_line = next((line for line in value.splitlines() if line.strip()), "")
        first_line = first_line[:_MAX_COMMAND_CHARS]
        command = _LEADING_LABEL.sub("", first_line).strip().strip("\"'`.!").strip()
        wanted = normalise(command)
        for index, name in enumerate(legal_actions):
            if normalise(name) == wanted:
                return index
        # A command named verbatim somewhere is the regex parser's to find (it runs
        # next); guessing here could only override it with a worse match.
        if any(names_verbatim(value, name) for name in legal_actions):
            return None
        return closest_command(command, legal_actions, self.options.fuzzy_threshold)
