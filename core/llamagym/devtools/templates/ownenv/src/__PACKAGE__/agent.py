"""The __NAME__ agent: how the model sees its game (env.py), and what it may answer.

The model never sees the env's observations themselves, only the text
format_observation writes, and it answers with one of the action names: here a number
from 1 to 16. In score mode (the default here) the model ranks the names; in generate
mode it writes a reply that the extraction chain reads (JSON {"action": "<name>"}, then
extract_action if you add one, then any action name: the order of the class's
reply_parsers).

When you change the game in env.py, change this class with it: the action names (one
per action, in the env's order), the system prompt, format_observation and the
baselines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamagym.agent import Agent

from __PACKAGE__.env import HIGHER, HIGHEST, HINTS, LOWER, LOWEST, NONE_YET
from __PACKAGE__.plugin import AGENT

# One name per action of the env's Discrete(16) space, in the env's order: action 0
# guesses 1, action 15 guesses 16. No name contains another as whole words.
ACTION_NAMES = tuple(str(number) for number in range(LOWEST, HIGHEST + 1))


def random_guess(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def binary_search(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """Guess the middle of the range the hints leave: the secret is found within
    log2(16) + 1 = 5 guesses, the score a trained agent should reach."""
    middle = (int(observation["low"]) + int(observation["high"])) // 2
    return str(middle)


@AGENT.bind  # name, description and env_id come from the registration (plugin.py)
class __CLASS__(Agent):
    action_names = ACTION_NAMES
    # Each baseline is played on the same seeds as the trained agent at the end of a run.
    baselines = {"random": random_guess, "binary-search": binary_search}
    # What evaluations count beside the mean return (see outcome below).
    outcome_names = ("found", "not found")
    # Laid over LlamaGym's defaults; `llamagym config show __NAME__` prints the result.
    defaults = {
        # The game takes several turns, but format_observation says all the model needs
        # (the last guess, its hint and the range still possible), so each prompt holds
        # the current observation only: no earlier turns (history_turns 0).
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0},
        # gamma below 1: finding the secret in fewer guesses is worth more.
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 64, "epochs": 4, "gamma": 0.9},
        "training": {"episodes": 3000, "eval_episodes": 100},
    }

    def outcome(self, episode_return: float) -> str:
        # The env pays 1 for the correct guess and 0 otherwise (the turn limit).
        return "found" if episode_return > 0 else "not found"

    def make_env(self) -> Any:
        # Agent.make_env runs every plugin's llamagym_register_envs hook first
        # (plugin.py registers the env there), then calls gymnasium.make(env_id).
        # Wrap the env here if it needs a wrapper.
        return super().make_env()

    def get_system_prompt(self) -> str:
        return (
            "Find my secret whole number from 1 to 16 in as few guesses as you can. "
            "After each guess I say whether the secret is higher or lower. "
            "Answer with one number from 1 to 16."
        )

    def format_observation(self, observation: Any) -> str:
        guess, hint = int(observation["guess"]), int(observation["hint"])
        low, high = int(observation["low"]), int(observation["high"])
        if hint == NONE_YET:
            return f"No guess yet. The secret is from {low} to {high}."
        if hint not in (HIGHER, LOWER):
            return f"Your last guess, {guess}, is correct."
        left = f"{low}" if low == high else f"from {low} to {high}"
        return f"Your last guess was {guess}; the secret is {HINTS[hint]}. It must be {left}."
