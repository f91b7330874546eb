"""The __NAME__ agent: how the model sees __ENV_ID__ and what it may answer.

The model never sees the env's numbers, only the text this class writes, and it
answers with one of the action names. In score mode (the default here) the model ranks
the names; in generate mode it writes a reply that the extraction chain reads (JSON
{"action": "<name>"}, then extract_action if you add one, then any action name: the
order of the class's reply_parsers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gymnasium.wrappers import TimeLimit
from llamagym.agent import Agent
from pydantic import BaseModel, ConfigDict, Field

from __PACKAGE__.plugin import AGENT

# One name per action of __ENV_ID__'s Discrete(__ACTION_COUNT__) space, in the env's order
# (index 0 first). TODO: replace each placeholder with a word or two that says what
# the action does (the comments quote the env's documentation). The model answers
# with these names; no name may contain another as whole words.
ACTION_NAMES = (
    # __ACTION_PLACEHOLDER_LINES__
)


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


class Options(BaseModel):
    """The agent's own settings: a run's `agent` section, validated by this model
    (`--set agent.max_episode_steps=50`, or `max_episode_steps: 50` under `agent:` in a
    config file). `llamagym config show __NAME__` lists them with their descriptions.
    Add a field (with a default and a description) for each thing a user may change."""

    model_config = ConfigDict(extra="forbid")  # a misspelt key is an error, not ignored
    max_episode_steps: int | None = Field(
        None,
        ge=1,
        description="End an episode after this many steps (null: the env's own time "
        "limit). Short episodes keep the first updates cheap.",
    )


@AGENT.bind  # name, description and env_id come from the registration (plugin.py)
class __CLASS__(Agent):
    # The run's validated `agent` section arrives as self.options, an Options.
    Config = Options
    options: Options
    action_names = ACTION_NAMES
    # Each baseline is played on the same seeds as the trained agent at the end of a
    # run. TODO: add a hand-written policy, so the report shows what "good" is.
    baselines = {"random": random_action}
    # Laid over LlamaGym's defaults; `llamagym config show __NAME__` prints the result.
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 64, "epochs": 4, "gamma": 0.95},
        "training": {"episodes": 3000, "eval_episodes": 100},
    }

    def make_env(self) -> Any:
        env = super().make_env()  # gymnasium.make(env_id, **env_kwargs)
        limit = self.options.max_episode_steps
        return env if limit is None else TimeLimit(env, max_episode_steps=limit)

    def get_system_prompt(self) -> str:
        # TODO: say what the goal is and how to answer.
        return "Play __ENV_ID__. Answer with one action: " + ", ".join(ACTION_NAMES) + "."

    def format_observation(self, observation: Any) -> str:
        # TODO: describe the observation in words the model can learn from (decode
        # numbers into positions, names, small values); the raw value is only a start.
        # __OBSERVATION_NOTE_LINES__
        return f"Observation: {observation}"
