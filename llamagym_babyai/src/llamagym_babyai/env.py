"""A BabyAI level with the level's bot beside it: ``info["bot_action"]`` is the action
MiniGrid's ``BabyAIBot`` would take now (an index of the level's action space), or None
where the bot has given up. The bot plans from what the agent has seen so far and is
told every action actually taken, so it keeps advising whoever plays (the ``bot``
baseline follows it; an agent never sees it)."""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
from typing import Any, SupportsFloat

import gymnasium as gym

from llamagym.errors import ConfigError, MissingDependencyError

__all__ = ["PLAYED_ACTIONS", "BotAdvice", "make_level"]

logger = logging.getLogger(__name__)
_EXAMPLES = ("BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-GoTo-v0")


def make_level(level: str, max_episode_steps: int | None = None) -> gym.Env:
    """``gymnasium.make(level)`` with minigrid's levels registered, and the bot's advice."""
    try:
        import minigrid  # importing it registers its levels with gymnasium
    except ImportError as exc:
        raise MissingDependencyError("minigrid", "BabyAI levels", "llamagym-babyai") from exc
    if level not in gym.registry or not level.startswith("BabyAI-"):
        known = sorted(name for name in gym.registry if name.startswith("BabyAI-"))
        closest = difflib.get_close_matches(level[:100], known, n=3)
        hint = f"closest: {', '.join(closest)}" if closest else f"e.g. {', '.join(_EXAMPLES)}"
        raise ConfigError(
            f"agent.level: {level[:100]!r} is not one of the {len(known)} BabyAI levels of "
            f"minigrid {getattr(minigrid, '__version__', '?')}; {hint}"
        )
    kwargs = {"max_episode_steps": max_episode_steps} if max_episode_steps else {}
    return BotAdvice(gym.make(level, **kwargs))


#: MiniGrid's actions without the last, ``done``, which completes no BabyAI mission.
PLAYED_ACTIONS = 6


class BotAdvice(gym.Wrapper):
    """Adds ``info["bot_action"]``: the BabyAI bot's next action (see the module), and
    offers the level's first six actions (``done`` left out)."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.action_space = gym.spaces.Discrete(PLAYED_ACTIONS)
        self._bot: Any = None

    def reset(self, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
        from minigrid.utils.baby_ai_bot import BabyAIBot

        # A level prints each layout it rejects while drawing one ("Sampling rejected"):
        # noise on a run's console.
        with contextlib.redirect_stdout(io.StringIO()):
            observation, info = self.env.reset(**kwargs)
        try:
            self._bot = BabyAIBot(self.env.unwrapped)
        except Exception:  # a level the bot does not know: no advice, the game goes on
            logger.debug("the BabyAI bot cannot plan this level", exc_info=True)
            self._bot = None
        return observation, {**info, "bot_action": self._advice(None)}

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        advice = None if terminated or truncated else self._advice(int(action))
        return observation, reward, terminated, truncated, {**info, "bot_action": advice}

    def _advice(self, action_taken: int | None) -> int | None:
        if self._bot is None:
            return None
        try:
            advice = int(self._bot.replan(action_taken))
            return advice if advice < PLAYED_ACTIONS else None  # "done": nothing left
        except Exception:  # the bot's planner asserts on states it cannot handle
            logger.debug("the BabyAI bot gave up", exc_info=True)
            self._bot = None
            return None
