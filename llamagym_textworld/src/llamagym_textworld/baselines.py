"""Reference policies for TextWorld: a floor (random) and a ceiling (the walkthrough).

A policy here is any callable ``policy(observation, info) -> command``, the same shape an
LLM agent has, so the baselines run through exactly the loop a trained agent does and
their returns are directly comparable. They need only the ``info`` fields that
:class:`llamagym_textworld.env.TextWorldEnv` provides, not TextWorld itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EpisodeResult",
    "Policy",
    "RandomAdmissiblePolicy",
    "WalkthroughPolicy",
    "play_episode",
    "random_admissible_command",
]

Policy = Callable[[str, Mapping[str, Any]], str]

#: What a baseline says when it has nothing better: harmless in every TextWorld game.
FALLBACK_COMMAND = "look"


def random_admissible_command(observation: str, info: Mapping[str, Any], rng: random.Random) -> str:
    """One admissible command drawn uniformly with ``rng`` (``"look"`` if there are none).

    The list is sorted before drawing so the choice depends only on the set of commands
    and the RNG state, not on the order the environment happened to list them in.
    """
    del observation  # A random policy does not read the text.
    commands: Sequence[str] = sorted(info.get("admissible_commands") or [])
    if not commands:
        return FALLBACK_COMMAND
    return rng.choice(commands)


class RandomAdmissiblePolicy:
    """Uniformly random admissible command, from a private seeded RNG.

    The RNG is the policy's own (not the environment's), so changing the agent cannot
    change which games the environment serves, and two policies with the same seed play
    the same moves.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def reset(self, seed: int | None = None) -> None:
        """Start a new episode; re-seeds only when ``seed`` is given."""
        if seed is not None:
            self._rng.seed(seed)

    def __call__(self, observation: str, info: Mapping[str, Any]) -> str:
        return random_admissible_command(observation, info, self._rng)


class WalkthroughPolicy:
    """Oracle that replays the game's walkthrough, one command per call.

    Its cursor is per episode: it restarts on :meth:`reset`, when ``info["episode_step"]``
    is 0 (the environment's reset info), or when the walkthrough in ``info`` changes
    (another game). Once the walkthrough is used up, or if ``replan=True``, it follows
    ``info["policy_commands"]``, TextWorld's shortest plan from the current state, which
    also recovers after someone else moved the game off the walkthrough.
    """

    def __init__(self, replan: bool = False) -> None:
        self.replan = replan
        self._walkthrough: list[str] | None = None
        self._cursor = 0

    def reset(self) -> None:
        self._walkthrough = None
        self._cursor = 0

    def __call__(self, observation: str, info: Mapping[str, Any]) -> str:
        del observation  # The plan is in info; the text adds nothing for an oracle.
        walkthrough = list(info.get("walkthrough") or [])
        if info.get("episode_step") == 0 or walkthrough != self._walkthrough:
            self._walkthrough = walkthrough
            self._cursor = 0
        plan = list(info.get("policy_commands") or [])
        if self.replan and plan:
            return plan[0]
        if self._cursor < len(walkthrough):
            command = walkthrough[self._cursor]
            self._cursor += 1
            return command
        return plan[0] if plan else FALLBACK_COMMAND


@dataclass
class EpisodeResult:
    """Summary of one episode played by :func:`play_episode`."""

    total_reward: float
    steps: int
    won: bool
    lost: bool
    truncated: bool
    score: int
    max_score: int
    commands: list[str]


def play_episode(
    env: Any, policy: Policy, seed: int | None = None, options: dict[str, Any] | None = None
) -> EpisodeResult:
    """Run ``policy`` in ``env`` (a Gymnasium env) for one episode and summarise it."""
    reset = getattr(policy, "reset", None)
    if callable(reset):
        reset()
    observation, info = env.reset(seed=seed, options=options)
    total = 0.0
    commands: list[str] = []
    terminated = truncated = False
    while not (terminated or truncated):
        command = policy(observation, info)
        commands.append(command)
        observation, reward, terminated, truncated, info = env.step(command)
        total += float(reward)
    return EpisodeResult(
        total_reward=total,
        steps=len(commands),
        won=bool(info.get("won")),
        lost=bool(info.get("lost")),
        truncated=bool(truncated),
        score=int(info.get("score", 0)),
        max_score=int(info.get("max_score", 0)),
        commands=commands,
    )
