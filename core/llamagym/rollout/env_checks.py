"""An environment's answers checked against Gymnasium's API: ``reset`` and ``step``
called so that anything else than what Gymnasium defines raises ``ValueError`` saying
what came back (an env is untrusted), and the turns an episode of an env may last."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def max_turns(env: Any, default: int) -> int:
    """The turns an episode of ``env`` may last: its own ``max_episode_steps`` (the
    registration's), else ``default`` (``rollout.max_episode_turns``)."""
    spec = getattr(env, "spec", None)
    own = getattr(spec, "max_episode_steps", None)
    return own if isinstance(own, int) and own > 0 else default


def checked_reset(env: Any, seed: int) -> tuple[Any, dict]:
    """``env.reset(seed=seed)`` as Gymnasium defines it, ``(observation, info)``;
    anything else raises ``ValueError`` saying what came back."""
    result = env.reset(seed=seed)
    if not isinstance(result, tuple) or len(result) != 2:
        raise ValueError(
            f"env.reset returned {_shape(result)}, not Gymnasium's (observation, info)"
        )
    observation, info = result
    if not isinstance(info, Mapping):
        raise ValueError(f"env.reset returned an info of type {type(info).__name__}, not a dict")
    return observation, dict(info)


def checked_step(env: Any, action: Any) -> tuple[Any, float, bool, bool, dict]:
    """``env.step(action)`` as Gymnasium defines it: ``(observation, reward, terminated,
    truncated, info)`` with a finite number for the reward. Anything else (the old gym
    API's 4-tuple, a reward of nan, inf or text) raises ``ValueError`` saying what came
    back, which counts as a failure of the env."""
    result = env.step(action)
    if not isinstance(result, tuple) or len(result) != 5:
        old_api = isinstance(result, tuple) and len(result) == 4
        raise ValueError(
            f"env.step returned {_shape(result)}, not Gymnasium's (observation, reward, "
            "terminated, truncated, info)"
            + ("; that is the old gym API's (observation, reward, done, info)" if old_api else "")
        )
    observation, reward, terminated, truncated, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(
            f"env.step returned a reward of type {type(reward).__name__}, not a number"
        ) from None
    if not math.isfinite(reward):
        raise ValueError(f"env.step returned a non-finite reward ({reward})")
    if not isinstance(info, Mapping):
        raise ValueError(f"env.step returned an info of type {type(info).__name__}, not a dict")
    return observation, reward, bool(terminated), bool(truncated), dict(info)


def _shape(result: Any) -> str:
    if isinstance(result, tuple):
        return f"a tuple of {len(result)}"
    return f"a {type(result).__name__}"


def error_text(error: Exception, limit: int = 300) -> str:
    """An env's error message on one bounded line (an env is untrusted)."""
    text = " ".join(str(error).split())
    return repr(text[:limit] + ("..." if len(text) > limit else ""))
