"""The lake03 agent: how the model sees FrozenLake-v1 and what it may answer.

The model never sees the env's numbers, only the text below: the lake as a picture
with the agent's square marked, and four move words. In score mode (the default here)
the model ranks the four words; in generate mode it writes a reply that the extraction
chain reads (JSON {"action": "down"}, then extract_action below, then any move word).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium
from llamagym.agent import Agent
from pydantic import BaseModel, ConfigDict, Field

from llamagym_lake03.plugin import AGENT

# One name per action of the env's Discrete(4) space, in the env's order.
ACTION_NAMES = ("left", "down", "right", "up")

# Gymnasium's default "4x4" map: S start, F frozen, H hole, G goal.
LAKE = ("SFFF", "FHFH", "FFFH", "HFFG")

# A shortest safe route across that map, as state -> move (state = row * 4 + column).
ROUTE = {0: "right", 1: "right", 2: "down", 6: "down", 10: "down", 14: "right"}


def random_move(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def follow_route(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """Walk the hand-written route: the score a trained agent should reach."""
    return ROUTE.get(int(observation), "down")


class Options(BaseModel):
    """The agent's own settings: a run's `agent` section, validated by this model
    (`--set agent.is_slippery=true`, or `is_slippery: true` under `agent:` in a config
    file). `llamagym config show lake03` lists them with their descriptions."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    is_slippery: bool = Field(
        False,
        description="Slippery ice: a move may slide sideways (Gymnasium's default lake). "
        "Off, every move goes where it says and a small model learns the route in minutes.",
    )


@AGENT.bind  # name, description and env_id come from the registration (plugin.py)
class Lake03Agent(Agent):
    # The run's validated `agent` section arrives as self.options, an Options.
    Config = Options
    options: Options
    action_names = ACTION_NAMES
    # Each baseline is played on the same seeds as the trained agent at the end of a run.
    baselines = {"random": random_move, "route": follow_route}
    # What evaluations count beside the mean return (see outcome below).
    outcome_names = ("goal", "no goal")
    # Laid over LlamaGym's defaults; `llamagym config show lake03` prints the result.
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 64, "epochs": 4, "gamma": 0.95},
        "training": {"episodes": 3000, "eval_episodes": 100},
    }

    def outcome(self, episode_return: float) -> str:
        # The lake pays 1 at the goal and 0 otherwise (a hole, or the time limit).
        return "goal" if episode_return > 0 else "no goal"

    def make_env(self) -> Any:
        # The options reach the env here (env_kwargs suits arguments that never change).
        return gymnasium.make(AGENT.env_id, is_slippery=self.options.is_slippery)

    def get_system_prompt(self) -> str:
        return (
            "Cross the frozen lake from S to the goal G without stepping into a hole H. "
            "Answer with one move: left, down, right or up."
        )

    def format_observation(self, observation: Any) -> str:
        row, column = divmod(int(observation), len(LAKE[0]))
        picture = [list(line) for line in LAKE]
        picture[row][column] = "@"
        lines = ["".join(line) for line in picture]
        return "\n".join(lines) + f"\nYou are at @ (row {row + 1}, column {column + 1})."

    def extract_action(self, response: str) -> str | None:
        # Asked after the JSON parser and before the regex over the move words: read
        # the compass words a model may use instead. Return None when unsure, so the
        # regex parser still gets its turn.
        compass = {"west": "left", "south": "down", "east": "right", "north": "up"}
        words = response.lower().replace(".", " ").split()
        found = [compass[word] for word in words if word in compass]
        return found[-1] if found else None
