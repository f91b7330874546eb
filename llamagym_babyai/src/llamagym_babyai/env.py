"""A BabyAI level with the level's bot beside it: ``info["bot_action"]`` is the action
MiniGrid's ``BabyAIBot`` would take now (an index of the level's action space), or None
where the bot has given up. The bot plans from what the agent has seen so far and is
told every action actually taken, so it keeps advising whoever plays (the ``bot``
baseline follows it; an agent never sees it).

``info["progress"]`` is how much closer to the mission's end a step came by the bot's
plan: ``info["bot_plan_length"]`` is the actions the bot would take from here to finish
the mission if it were followed (its advice, then what it says next, played on copies
of the level and the bot, at most the level's ``max_steps``), and a step's progress is
the length before it less the length after it; 0 on reset. A shaping term of the
potential-based kind (minus the length is the potential, 0 once the mission is done):
over an episode it sums to the start length less the end length, so a detour undone
costs nothing. Following the bot gains 1 a step; a turn away from its plan loses 1 or
2 (the bot, told of it, plans to undo it), an action that changes nothing 0. Where the
bot cannot say (it gave up, its plan fails the mission or runs out of steps, or the
step fails the mission) the step's progress is 0 and ``bot_plan_length`` keeps the
last length. The plan is the bot's, not the shortest: it knows only what the agent has
seen (it explores for the rest) and takes back a step away before going on. A plan
costs 1-4 ms a step on GoToLocal, PickupLoc and PutNextLocal, 25-65 ms on the large
levels (GoTo, BossLevel; 350 ms at most) on a 2-core CPU; ``progress=False`` skips it
(``bot_plan_length`` None, ``progress`` 0).
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import io
import logging
from typing import Any, SupportsFloat

import gymnasium as gym

from llamagym.errors import ConfigError, MissingDependencyError

__all__ = ["PLAYED_ACTIONS", "BotAdvice", "make_level"]

logger = logging.getLogger(__name__)
_EXAMPLES = ("BabyAI-GoToLocal-v0", "BabyAI-PickupLoc-v0", "BabyAI-GoTo-v0")


def make_level(
    level: str, max_episode_steps: int | None = None, *, progress: bool = True
) -> gym.Env:
    """``gymnasium.make(level)`` with minigrid's levels registered, the bot's advice and
    (``progress``) the progress by its plan."""
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
    return BotAdvice(gym.make(level, **kwargs), progress=progress)


#: MiniGrid's actions without the last, ``done``, which completes no BabyAI mission.
PLAYED_ACTIONS = 6


class BotAdvice(gym.Wrapper):
    """Adds ``info["bot_action"]``: the BabyAI bot's next action, and with ``progress``
    ``info["bot_plan_length"]`` and ``info["progress"]`` (see the module; without, None
    and 0), and offers the level's first six actions (``done`` left out)."""

    def __init__(self, env: gym.Env, progress: bool = True) -> None:
        super().__init__(env)
        self.action_space = gym.spaces.Discrete(PLAYED_ACTIONS)
        self.progress = progress
        self._bot: Any = None
        self._plan_length: int | None = None

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
        advice = self._advice(None)
        self._plan_length = self._plan(advice)
        return observation, {**info, **self._said(advice, 0)}

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        if terminated:  # a mission done has no plan left; a failed one ends unmeasured
            advice, length = None, 0 if self.progress and float(reward) > 0 else None
        else:
            advice = self._advice(int(action))
            length = self._plan(advice)
        before = self._plan_length
        progress = 0 if length is None or before is None else before - length
        self._plan_length = before if length is None else length
        info = {**info, **self._said(None if truncated else advice, progress)}
        return observation, reward, terminated, truncated, info

    def _said(self, advice: int | None, progress: int) -> dict[str, Any]:
        return {"bot_action": advice, "bot_plan_length": self._plan_length, "progress": progress}

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

    def _plan(self, advice: int | None) -> int | None:
        """The actions the bot takes to finish the mission from here, ``advice`` first,
        played on copies of the level and the bot (the real ones are not touched), or
        None where it does not within the level's ``max_steps``."""
        if not self.progress or self._bot is None or advice is None:
            return None
        level: Any = self.env.unwrapped  # a MiniGrid level: step_count, max_steps
        try:
            copied, bot = copy.deepcopy((level, self._bot))  # the bot's level is the copy
            copied.step_count = 0  # the copy's own clock: never cut short, never scored 0
            action = advice
            for steps in range(1, level.max_steps + 1):
                _, reward, terminated, _, _ = copied.step(action)
                if terminated:
                    return steps if float(reward) > 0 else None
                action = int(bot.replan(None))  # None: its own advice was taken
                if action >= PLAYED_ACTIONS:
                    return None  # "done" before the mission is: a plan that fails
        except Exception:  # the bot's planner asserts on states it cannot handle
            logger.debug("the BabyAI bot cannot plan from here", exc_info=True)
        return None
