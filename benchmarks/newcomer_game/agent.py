"""The vault agent: the game in env.py, as the model sees it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llamagym_vault.env import COMMANDS, LANDMARKS
from llamagym_vault.plugin import AGENT

from llamagym.agent import Agent


def random_move(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def follow_the_draft(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """The door on the side the draft comes from (it reads the room's text)."""
    return next((c for c, landmark in LANDMARKS.items() if landmark in str(observation)),
                legal[0])


@AGENT.bind
class VaultAgent(Agent):
    baselines = {"random": random_move, "follow-the-draft": follow_the_draft}
    outcome_names = ("won", "lost")
    defaults = {"rollout": {"mode": "score", "num_envs": 8, "history_turns": 0}}

    def get_system_prompt(self) -> str:
        return ("Find the way to the vault. In each room one door leads on; the others "
                "drop you back at the start. The mountains lie north, the sea south, the "
                "sunrise east and the sunset west. Answer with one move.")

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        return list(info.get("commands") or COMMANDS)

    def outcome(self, episode_return: float) -> str:
        return "won" if episode_return > 0 else "lost"
