"""An environment's answers checked against Gymnasium's API: ``reset`` and ``step``
called so that anything else than what Gymnasium defines raises ``ValueError`` saying
what came back (an env is untrusted), the turns an episode of an env may last, and the
legal actions an agent names for an observation, checked before any is tokenized, and
the progress a step reports, bounded."""

from __future__ import annotations

import math
import numbers
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

from llamagym.errors import EnvFailureError, LlamaGymError


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


#: The largest step of ``info["progress"]`` the learner takes (an env is untrusted: a
#: huge number must not swamp every other reward).
MAX_PROGRESS = 1_000.0


def progress_of(info: Mapping[str, Any]) -> float:
    """A step's ``info["progress"]``: how much closer to its goal the env says the step
    came (negative: further), bounded to +-:data:`MAX_PROGRESS`; 0 where the env says
    nothing, or gives something other than a finite real number."""
    value = info.get("progress") if isinstance(info, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return 0.0
    value = float(value)
    if not math.isfinite(value):
        return 0.0
    return max(-MAX_PROGRESS, min(MAX_PROGRESS, value))


def step_reward(reward: float, info: Mapping[str, Any], progress_reward: float) -> float:
    """What the learner gets for a step before any shaping plugin's term: the env's
    reward plus ``progress_reward`` (``rollout.progress_reward``) times its progress."""
    return reward + progress_reward * progress_of(info)


def error_text(error: Exception, limit: int = 300) -> str:
    """An env's error message on one bounded line (an env is untrusted)."""
    text = " ".join(str(error).split())
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def checked_legal_actions(
    agent: Any, where: str, named: Sequence[Sequence[Any] | None], mode: str, max_chars: int
) -> list[list[str]]:
    """Each row's legal actions (``named``: ``agent.legal_actions`` per slot, ``where``
    names the env) as lists of names, checked before any is tokenized: a non-empty list
    of strings, each at most ``max_chars`` (``rollout.max_action_chars``) long and
    writable text. An empty list stands for actions the agent does not name (None,
    generate mode only: ``extract_action``'s value goes to the env as it is)."""
    legal: list[list[str]] = []
    for actions in named:
        if actions is None:
            if mode == "score":
                raise LlamaGymError(
                    f"{type(agent).__name__} names no actions, and score mode ranks the legal"
                    " actions: set action_names = [...] on the class (in the env's action "
                    "order), pass env=..., override legal_actions(), or use "
                    "rollout.mode=generate"
                )
            legal.append([])
            continue
        if isinstance(actions, (str, bytes)):
            raise EnvFailureError(
                f"{where} gave its legal actions as one string ({bounded_repr(actions)}); "
                "give a list of names"
            )
        names = list(actions)
        if not names:
            raise EnvFailureError(f"{where} gave no legal actions; it must name at least one")
        for index, name in enumerate(names):
            problem = _action_name_problem(name, max_chars)
            if problem:
                raise EnvFailureError(
                    f"{where} gave a legal action (number {index} of {len(names)}) that is "
                    f"{problem}"
                )
        legal.append(names)
    return legal


def _action_name_problem(name: Any, max_chars: int) -> str:
    """What is wrong with one legal action's name, or "" when nothing is."""
    if not isinstance(name, str):
        return f"{type(name).__name__} {bounded_repr(name)}, not a string: name every action"
    if len(name) > max_chars:
        return (
            f"{len(name):,} characters long ({name[:40]!r}...), more than "
            f"rollout.max_action_chars = {max_chars:,}; raise it if the names are meant"
        )
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"not writable text ({error.reason} at {error.start}: {bounded_repr(name)})"
    return ""


def bounded_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters (what a message may quote of data)."""
    text = reprlib.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
