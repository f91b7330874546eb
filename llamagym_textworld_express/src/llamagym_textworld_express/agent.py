"""The TextWorldExpress agents: one per game, all read and written the same way.

The game's task is said once per episode, in the system prompt (``episode_context``); a
user turn is what the game answered to the last action (the room on arrival, what an
action did). The actions are the game's own (``move north``, ``take coin``): score mode
ranks the valid ones (``info["valid_actions"]``); generate mode reads a reply through
the extraction chain: the JSON parser (``{"action": "take coin"}``), then this agent
(the reply's first line as an action, in any case and spacing), then the regex parser
(an action named anywhere in the reply).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from llamagym.agent import Agent
from llamagym.config import MAX_EPISODE_STEPS, MAX_OBSERVATION_CHARS
from llamagym.display import cut
from llamagym_textworld_express import plugin
from llamagym_textworld_express.games import GAMES, Game, game_params_text, parse_game_params

# Bounds on the work one reply can cause.
_MAX_REPLY_CHARS = 2000
_MAX_ACTION_CHARS = 200
_LEADING_LABEL = re.compile(r"^\s*(?:>+|(?:action|command|answer)\s*[:=])\s*", re.IGNORECASE)
# Listing the actions in a generate-mode prompt helps with a few; a hundred would swamp it.
_MOST_ACTIONS_LISTED = 40


class TextWorldExpressOptions(BaseModel):
    """The ``agent`` section keys every TextWorldExpress agent reads (each game states
    its own ``game_params`` and ``max_episode_steps``)."""

    model_config = ConfigDict(extra="forbid")
    fold: Literal["train", "dev", "test"] = Field(
        "train",
        description="The seeds episodes are drawn from: train, dev or test (TextWorldExpress's "
        "1,000 seeds each; a reset's seed picks one of them).",
    )
    timeout_seconds: float = Field(
        60.0, gt=0, le=3600,
        description="The longest one call to Java (or starting the JVM) may take; past it "
        "the env fails with an error.",
    )
    max_observation_chars: int = Field(
        2000, ge=50, le=MAX_OBSERVATION_CHARS, description="Game text longer than this is cut."
    )
    list_actions: bool | None = Field(
        None,
        description="Name the valid actions in the prompt; null = in generate mode when "
        f"there are at most {_MOST_ACTIONS_LISTED}.",
    )


def normalise_action(text: str) -> str:
    return " ".join(text.split()).lower()


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def gold_path_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """The game's gold path (``info["gold_action"]``: the next action of the sequence
    TextWorldExpress generated with the game), or a random valid action off it."""
    action = info.get("gold_action")
    return action if action in legal else random_action(observation, info, legal, rng)


def _defaults(history_turns: int | None) -> dict[str, Any]:
    return {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": history_turns,
                    "reply_prefix": '{"action": "', "max_new_tokens": 16},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 32, "epochs": 2, "gamma": 0.95,
                      "entropy_coef": 0.01},
        "training": {"minutes": 15, "eval_episodes": 100, "threads": 1},
    }


class TextWorldExpressAgent(Agent):
    """What every TextWorldExpress agent shares; a subclass names its game (``game``)."""

    game: str = ""
    baselines = {"random": random_action, "gold-path": gold_path_action}
    # Read from the game's own end state: a score of 0.5 is a task half done, not won.
    outcome_names = ("won", "lost")
    # One earlier turn says what the agent just did (a game's answer alone, "You take the
    # coin.", may not); the games that show a fact once (a map, a math problem) keep
    # the whole episode.
    defaults = _defaults(history_turns=1)
    # A pretrained model: an untrained policy plays to the step limit, so a batch is
    # many decisions. 16 episodes on 8 envs, a smaller step and a looser KL stop, as
    # TextWorld's and BabyAI's pretrained defaults have them (not measured on these
    # games).
    pretrained_defaults = {
        "score": {
            "rollout": {"num_envs": 8},
            "algorithm": {"episodes_per_update": 16, "lr": 5e-4, "target_kl": 0.05},
        }
    }
    Config: type[BaseModel] = TextWorldExpressOptions
    options: Any

    def make_env(self) -> Any:
        from llamagym_textworld_express.env import TextWorldExpressEnv

        options = self.options
        return TextWorldExpressEnv(
            self.game,
            options.game_params,
            fold=options.fold,
            max_episode_steps=options.max_episode_steps,
            timeout_seconds=options.timeout_seconds,
            max_observation_length=options.max_observation_chars,
        )

    # -- prompts --------------------------------------------------------------------
    def get_system_prompt(self) -> str:
        prompt = "You are playing a text game. Do the task in as few steps as you can."
        if self.config.rollout.mode == "generate":
            return prompt + ' Reply with one valid action as JSON: {"action": "look around"}.'
        return prompt + " Reply with one valid action."  # score mode puts each after the prompt

    def episode_context(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        task = str(info.get("task") or "").strip()
        return f"Task: {task[: self.options.max_observation_chars]}" if task else None

    def format_observation(self, observation: Any, info: dict) -> str:
        text = str(observation).strip()
        text = cut(text, self.options.max_observation_chars)
        actions = self.legal_actions(observation, info)
        if self.lists_actions(len(actions)):
            text += "\n\nValid actions: " + ", ".join(actions)
        return text

    def lists_actions(self, count: int) -> bool:
        if self.options.list_actions is None:
            return self.config.rollout.mode == "generate" and count <= _MOST_ACTIONS_LISTED
        return bool(self.options.list_actions)

    def outcome(self, episode_return: float, info: Mapping[str, Any]) -> str:
        return "won" if info.get("won") is True else "lost"

    # -- actions --------------------------------------------------------------------
    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        return list(info.get("valid_actions") or [])

    def env_action(self, index: int, legal_actions: Sequence[str]) -> str:
        return legal_actions[index]  # the env steps on the action's text

    def extract_action(self, response: str) -> str | None:
        """The reply's first line as an action, without a label (``Action:``, ``>``),
        quotes or closing punctuation; None for a blank or overlong one."""
        text = response[:_MAX_REPLY_CHARS]
        first_line = next((line for line in text.splitlines() if line.strip()), "")
        action = _LEADING_LABEL.sub("", first_line[: 2 * _MAX_ACTION_CHARS])
        action = action.strip().strip("\"'`.!").strip()
        return action if action and len(action) <= _MAX_ACTION_CHARS else None

    def action_index(self, value: Any, legal_actions: Sequence[str]) -> int | None:
        if not isinstance(value, str):
            return super().action_index(value, legal_actions)
        wanted = normalise_action(value[: _MAX_ACTION_CHARS + 2])
        for index, action in enumerate(legal_actions):
            if normalise_action(action) == wanted:
                return index
        return None  # an action named elsewhere in the reply is the regex parser's to find


def _options(game: Game) -> type[BaseModel]:
    """The agent's options: the shared ones, and its game's ``game_params`` (checked
    against the game's keys and ranges as the config is read, before any JVM starts)
    and ``max_episode_steps``."""
    keys = "; ".join(p.allowed() for p in game.parameters) or "none (the empty string)"

    class Options(TextWorldExpressOptions):
        game_params: str = Field(
            game.default_params,
            description=f"{game.title}'s parameters, KEY=INTEGER,...: {keys}. A key left "
            "out takes TextWorldExpress's default.",
        )
        max_episode_steps: int = Field(
            game.max_episode_steps, ge=1, le=MAX_EPISODE_STEPS,
            description="Steps before an episode is cut.",
        )

        @field_validator("game_params")
        @classmethod
        def _known_parameters(cls, value: str) -> str:
            return game_params_text(parse_game_params(game, value))

    Options.__name__ = Options.__qualname__ = f"{game.title.replace(' ', '')}Options"
    return Options


@plugin.COIN.bind
class CoinAgent(TextWorldExpressAgent):
    game = "coin"
    Config = _options(GAMES[game])


@plugin.COOKINGWORLD.bind
class CookingWorldAgent(TextWorldExpressAgent):
    game = "cookingworld"
    Config = _options(GAMES[game])
    defaults = _defaults(history_turns=2)  # the recipe is read once, then followed


@plugin.TWC.bind
class CommonsenseAgent(TextWorldExpressAgent):
    game = "twc"
    Config = _options(GAMES[game])


@plugin.MAPREADER.bind
class MapReaderAgent(TextWorldExpressAgent):
    game = "mapreader"
    Config = _options(GAMES[game])
    defaults = _defaults(history_turns=None)  # the map is read once


@plugin.ARITHMETIC.bind
class ArithmeticAgent(TextWorldExpressAgent):
    game = "arithmetic"
    Config = _options(GAMES[game])
    defaults = _defaults(history_turns=None)  # the problem is read once


@plugin.SORTING.bind
class SortingAgent(TextWorldExpressAgent):
    game = "sorting"
    Config = _options(GAMES[game])


@plugin.SIMONSAYS.bind
class SimonSaysAgent(TextWorldExpressAgent):
    game = "simonsays"
    Config = _options(GAMES[game])


@plugin.PECKINGORDER.bind
class PeckingOrderAgent(TextWorldExpressAgent):
    game = "peckingorder"
    Config = _options(GAMES[game])
