"""The BabyAI agent: a level's mission and view in words, its six actions by name, the
random and bot baselines.

Each user turn is the mission, then what the agent sees (:mod:`llamagym_babyai.text`).
The actions are MiniGrid's first six, named as GLAM names them; the seventh, ``done``,
ends nothing in BabyAI's levels and is left out. Score mode (the default) ranks the six
names after the prompt; generate mode reads a reply through the extraction chain (JSON,
then the names' synonyms here, then the regex over the names).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from llamagym.agent import Agent
from llamagym.config import MAX_EPISODE_STEPS
from llamagym_babyai.plugin import BABYAI
from llamagym_babyai.text import describe

# In MiniGrid's order: action i of the level is ACTIONS[i].
ACTIONS = ("turn left", "turn right", "go forward", "pick up", "drop", "toggle")
_LEVEL = re.compile(r"BabyAI-[A-Za-z0-9]{1,60}-v[0-9]{1,3}")
_SYNONYMS = {
    "left": "turn left", "right": "turn right", "forward": "go forward",
    "move forward": "go forward", "pickup": "pick up", "pick": "pick up", "open": "toggle",
}
_MAX_REPLY_CHARS = 2000


class BabyAIOptions(BaseModel):
    """The ``agent`` section keys this agent reads, e.g. ``--set agent.level=BabyAI-GoTo-v0``."""

    model_config = ConfigDict(extra="forbid")
    level: str = Field(
        BABYAI.env_id or "BabyAI-GoToLocal-v0",
        description="The BabyAI level (a gymnasium id from minigrid, BabyAI-NAME-vN).",
        pattern=_LEVEL.pattern,
    )
    max_episode_steps: int | None = Field(
        None, ge=1, le=MAX_EPISODE_STEPS,
        description="Steps before an episode is cut; null = the level's.",
    )


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def bot_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """MiniGrid's BabyAI bot (``info["bot_action"]``), or a random action where it has none."""
    advice = info.get("bot_action")
    if isinstance(advice, int) and 0 <= advice < len(ACTIONS):
        return ACTIONS[advice]
    return random_action(observation, info, legal, rng)


@BABYAI.bind  # name, description and env_id come from the registration
class BabyAIAgent(Agent):
    action_names = ACTIONS
    baselines = {"random": random_action, "bot": bot_action}
    # A level pays 1 - 0.9 * steps / max_steps for the mission done, 0 otherwise.
    outcome_names = ("success", "failure")
    # Score mode: six names ranked after the prompt. One earlier turn says what the
    # agent just did and saw (the view is partial: a turn can hide the target).
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 1,
                    "reply_prefix": '{"action": "', "max_new_tokens": 8},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 32, "epochs": 2, "gamma": 0.95,
                      "entropy_coef": 0.01},
        "training": {"minutes": 15, "eval_episodes": 100, "threads": 1},
    }
    # A pretrained model: an untrained policy fails most missions, so an episode runs to
    # the level's limit (64 steps on GoToLocal), and SmolLM2-135M plays about 3 env steps
    # a second on a 2-core CPU. The generic pretrained batch (64 episodes on 16 envs) is
    # 4,096 decisions: one update did not finish in 19 minutes. 16 episodes on 8 envs
    # (a quarter of those decisions per update), a larger step and a looser KL stop, as
    # TextWorld's pretrained defaults have them.
    pretrained_defaults = {
        "score": {
            "rollout": {"num_envs": 8},
            "algorithm": {"episodes_per_update": 16, "lr": 5e-4, "target_kl": 0.05},
        }
    }
    Config = BabyAIOptions
    options: BabyAIOptions

    def make_env(self) -> Any:
        from llamagym_babyai.env import make_level

        # The progress by the bot's plan costs a plan a step: none where nothing reads it.
        progress = self.config.rollout.progress_reward > 0
        return make_level(self.options.level, self.options.max_episode_steps, progress=progress)

    def get_system_prompt(self) -> str:
        prompt = (
            "You are an agent in a grid world. Carry out the goal in as few steps as you "
            "can. Possible actions: " + ", ".join(ACTIONS) + "."
        )
        if self.config.rollout.mode == "generate":
            return prompt + ' Reply with JSON only: {"action": "go forward"}.'
        return prompt

    def format_observation(self, observation: Any) -> str:
        return describe(observation)

    def outcome(self, episode_return: float) -> str:
        return "success" if episode_return > 0 else "failure"

    def extract_action(self, response: str) -> str | None:
        """A synonym as the reply's first words (``forward``, ``pickup``, ``open``)."""
        words = " ".join(response[:_MAX_REPLY_CHARS].lower().split()).strip("\"'`.! ")
        for synonym in sorted(_SYNONYMS, key=len, reverse=True):
            if words == synonym or words.startswith(synonym + " "):
                return _SYNONYMS[synonym]
        return None
