"""The corridor's agent, with what 0.3 let an agent declare."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamagym.agent import Agent
from pydantic import BaseModel, ConfigDict, Field

from llamagym_corridor03.plugin import AGENT


def random_move(observation: Any, info: Mapping, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def forward(observation: Any, info: Mapping, legal: Sequence[str], rng: Any) -> str:
    return "forward"


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid")
    length: int = Field(4, ge=2, le=20, description="Cells of the corridor.")


class CorridorAgent(Agent):
    Config = Options
    options: Options
    env_id = AGENT.env_id
    baselines = {"random": random_move, "forward": forward}
    outcome_names = ("reached the end", "not there")
    defaults = {"training": {"episodes": 64, "eval_episodes": 8}}
    pretrained_defaults = {"score": {"algorithm": {"lr": 1e-4}}}

    @property
    def env_kwargs(self) -> dict[str, Any]:
        return {"length": self.options.length}

    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        return ["forward"] if int(observation) == 0 else ["back", "forward"]

    def env_action(self, index: int, legal_actions: Sequence[str]) -> Any:
        return 1 if legal_actions[index] == "forward" else 0

    def outcome(self, episode_return: float, info: Mapping[str, Any]) -> str:
        return "reached the end" if episode_return > 0 else "not there"

    def get_system_prompt(self) -> str:
        return "Walk the corridor to its end. Answer with one move: back or forward."

    def format_observation(self, observation: Any) -> str:
        return f"You are at cell {int(observation) + 1} of {self.options.length}."
