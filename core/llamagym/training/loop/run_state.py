"""What a run carries: its parts (:class:`Run`, built by :func:`llamagym.run.build_run`;
a trainer is handed :class:`RunParts` to build it with), its counters (saved in every
checkpoint), the loop's state between updates, the summary it ends with, and the random
streams it draws from."""

from __future__ import annotations

import contextlib
import copy
import random
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from llamagym.algorithms.algorithm import Algorithm
from llamagym.config import RunConfig
from llamagym.models.policy import Policy
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.evaluation import EvalResult
from llamagym.schedule import Control, Schedule
from llamagym.training.checkpoint.state import capture_global_rng, restore_global_rng

if TYPE_CHECKING:
    from llamagym.task import Task

MOVING_AVERAGE_EPISODES = 500


@dataclass
class RunSummary:
    output_dir: Path
    episodes: int
    updates: int
    env_steps: int
    #: training time so far, earlier runs of a resumed one included; a collection cut
    #: short by a stop counts too (the checkpoint's counters stop at the last update)
    seconds: float
    evaluation: EvalResult | None = None
    baselines: list[EvalResult] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None
    #: the signal that stopped the run early ("SIGINT", "SIGTERM"), else None
    interrupted: str | None = None
    #: finished episodes of a collection cut short by a stop, thrown away untrained
    dropped_episodes: int = 0
    report: Path | None = None
    #: the learning curve, when it was drawn (None: no picture was written)
    curve: Path | None = None
    resumed_from: Path | None = None
    greedy: bool = True
    #: the trained policy (the TRL backend's is a new one, made from TRL's model)
    policy: Policy | None = None


@dataclass
class Counters:
    """Where a run stands; saved in every checkpoint."""

    updates: int = 0
    episodes: int = 0
    env_steps: int = 0
    env_failures: int = 0
    seconds: float = 0.0
    recent_returns: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class RunParts(Protocol):
    """What a trainer is handed to build its run on (an agent's session is one): the
    policy, loaded on first use, and a new run over it (with the ``demonstrations`` the
    trainer recorded from a baseline, if the config names one)."""

    @property
    def policy(self) -> Policy: ...

    def start_run(
        self, control: Control | None = None, demonstrations: Path | None = None
    ) -> Run: ...


def make_engine(
    agent: Task,
    policy: Policy,
    config: RunConfig,
    schedule: Schedule,
    *,
    num_envs: int | None = None,
    observe: bool = True,
) -> RolloutEngine:
    """The engine of a run over ``policy``: ``config.rollout`` with ``num_envs`` over it;
    ``observe=False`` for one whose episodes reach no training observer (evaluation)."""
    rollout = config.rollout
    if num_envs is not None:
        rollout = rollout.model_copy(update={"num_envs": num_envs})
    return RolloutEngine(
        agent,
        policy,
        rollout,
        seed=config.training.seed,
        schedule=schedule,
        max_failures_in_a_row=config.training.max_env_failures,
        observe=observe,
    )


@dataclass
class Run:
    """The parts of one run. Its state is the sum of its parts' ``state_dict()``s."""

    agent: Task
    config: RunConfig
    policy: Policy
    engine: RolloutEngine
    algorithm: Algorithm
    schedule: Schedule

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm.state_dict(), "engine": self.engine.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.algorithm.load_state_dict(state["algorithm"])
        self.engine.load_state_dict(state["engine"])


@dataclass
class Training:
    """What the training loop carries from one update to the next, in one process."""

    run: Run
    counters: Counters
    #: Every record of the run so far (metrics.jsonl's lines), for the report.
    history: list[dict[str, Any]]
    #: The returns of the last episodes, for the moving average.
    recent: deque[float]
    episode_budget: int | None
    time_budget: float | None
    resume_checkpoint: Path | None
    several: bool  # more than one process
    started: float = 0.0  # perf_counter when training started in this process
    seconds_before: float = 0.0  # training seconds of the run before (a resumed run's)
    warm_start_seconds: float = 0.0  # of a fresh run's budget, spent before update 1
    metrics: dict[str, float] = field(default_factory=dict)  # the last update's
    skipped_in_a_row: int = 0
    seconds_used: float | None = None  # set when a collection is cut short
    dropped: int = 0  # episodes of a collection cut short
    # Where this update's collection started: the clock and the engine's counts.
    update_started: float = 0.0
    steps_before: int = 0
    failures_before: int = 0

    def rl_budget(self) -> float | None:
        """The seconds of the time budget left for the updates once the warm start had
        its (None: no time budget)."""
        if self.time_budget is None:
            return None
        return max(self.time_budget - self.warm_start_seconds, 0.0)

    def time_used(self) -> float:
        """Training time so far, the same clock as ``counters.seconds``."""
        return self.seconds_before + time.perf_counter() - self.started


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def reseed_process(run: Run, seed: int) -> None:
    """Seed this process's own random streams: the global generators, the engine's episode
    seeds and sampling, and the algorithm's minibatch order."""
    seed_everything(seed)
    run.engine.drop_carried()  # rank 0's, restored from its checkpoint: not this one's
    run.engine.rng = np.random.default_rng(seed)
    run.engine.generator.manual_seed(seed)
    run.algorithm.rng.seed(seed)


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """Run observers (loggers, user plugins) without letting them move the training
    random streams: a logger that draws a random number, or imports a library that
    does, must not change what a resumed run computes."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])


@dataclass
class RandomState:
    """Every random stream a collection draws from, and the engine's step counters:
    taken before a collection, put back if the batch is dropped, so a checkpoint written
    afterwards is the last completed update's."""

    engine: dict[str, Any]
    global_rng: dict[str, Any]
    env_steps: int
    env_failures: int

    @classmethod
    def capture(cls, engine: Any) -> RandomState:
        return cls(
            copy.deepcopy(engine.state_dict()),
            capture_global_rng(),
            engine.stats.env_steps,
            engine.stats.env_failures,
        )

    def restore(self, engine: Any) -> None:
        engine.load_state_dict(self.engine)
        restore_global_rng(self.global_rng)
        engine.stats.env_steps, engine.stats.env_failures = self.env_steps, self.env_failures
