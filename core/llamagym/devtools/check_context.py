"""What a conformance check is given and shares: the agent under test, the observations
met on a random walk, the tiny model's tokenizer, and the Gymnasium calls made with the
answer checked (a reset or step that breaks the API fails the check that made it).
A check raises :class:`CheckFailure` (what is wrong, and the fix) or
:class:`CheckSkipped` (why it does not apply); :mod:`llamagym.devtools.conformance`
runs them."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llamagym.devtools.fake_model import load_tiny_tokenizer

if TYPE_CHECKING:
    from llamagym.agent import Agent

#: Decisions one end-to-end episode may take before the check calls it endless.
MAX_TURNS_PER_EPISODE = 1000
#: Steps of the random walk that samples observations, per episode and in total.
SAMPLE_STEPS_PER_EPISODE = 40
SAMPLE_EPISODES = 3
#: Steps of the fixed action sequence played after a seeded reset, twice, compared.
SEEDED_STEPS = 20
#: Tokens the engine keeps free for the reply in score mode (see RolloutEngine).
SCORE_MODE_REPLY_TOKENS = 16
#: Distinct legal-action lists whose names are round-tripped (dynamic actions vary a lot).
ROUND_TRIP_LISTS = 40


class CheckFailure(Exception):
    """Raised inside a check: ``problem`` is what is wrong, ``fix`` how to fix it."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


class CheckSkipped(Exception):
    """Raised inside a check that does not apply to this agent (the message says why)."""


@dataclass
class Sample:
    """An observation met on a random walk, with its info and legal actions."""

    observation: Any
    info: dict
    legal: list[str]


@dataclass
class CheckContext:
    agent: Agent
    seed: int
    episodes: int
    samples: list[Sample] = field(default_factory=list)
    _tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = load_tiny_tokenizer()
        return self._tokenizer

    def make_env(self) -> Any:
        return self.agent.make_env()


@dataclass(frozen=True)
class Check:
    name: str
    run: Callable[[CheckContext], str]
    needs: tuple[str, ...] = ()


def describe(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def same_value(a: Any, b: Any) -> bool:
    """Structural equality for observations: arrays, tuples, dicts, strings, numbers."""
    import numpy as np

    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f"))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an object whose == is ambiguous or broken is not comparable
        return False


def reset_env(env: Any, seed: int) -> tuple[Any, dict]:
    result = env.reset(seed=seed)
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict)):
        raise CheckFailure(
            f"env.reset(seed={seed}) returned {describe(result)}, not (observation, info)",
            "follow the Gymnasium API: reset(*, seed=None, options=None) returns "
            "(observation, info_dict)",
        )
    return result


def step_env(env: Any, action: Any) -> tuple[Any, float, bool, bool, dict]:
    result = env.step(action)
    if not (isinstance(result, tuple) and len(result) == 5):
        raise CheckFailure(
            f"env.step({describe(action)}) returned {describe(result)}, not 5 values",
            "follow the Gymnasium API: step returns (observation, reward, terminated, "
            "truncated, info); old Gym envs can be wrapped with "
            "gymnasium.wrappers.EnvCompatibility or shimmy",
        )
    observation, reward, terminated, truncated, info = result
    if not math.isfinite(float(reward)):
        raise CheckFailure(
            f"env.step returned the reward {reward!r}", "rewards must be finite numbers"
        )
    return observation, float(reward), bool(terminated), bool(truncated), dict(info)


def action_key(name: str) -> str:
    """How the parsers compare names: case and runs of spaces do not count."""
    return " ".join(name.split()).lower()


