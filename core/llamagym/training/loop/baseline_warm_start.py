"""A warm start from one of the agent's own baselines (``algorithm.warm_start.baseline``,
``llamagym run AGENT --warm-start NAME``).

Before the run is built, the baseline plays ``baseline_episodes`` episodes on seeds of
their own (never the final evaluation's: :func:`~llamagym.rollout.demonstrations.recording_seeds`),
and the decisions of its successful episodes
(:class:`~llamagym.rollout.demonstrations.SuccessRule`) are written to the run
directory's ``demonstrations.jsonl``, each as the run's model sees it in the run's mode:
what ``llamagym record AGENT --baseline NAME --outcome BEST`` writes. The algorithm is
then built with that file as its ``algorithm.warm_start.demonstrations`` and trains on it
before the first update. The recording moves none of the training random streams, so
the run is the one that the same file given as ``demonstrations`` would make.

A resumed run records nothing. As with any demonstrations file, it trains on them again
before its checkpoint is loaded over them (so its KL reference is the unbroken run's),
from the file its run recorded when it started.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from llamagym import distributed
from llamagym.errors import LlamaGymError
from llamagym.models.policy import Policy
from llamagym.paths import check_own_entry, copy_atomically
from llamagym.rollout.demonstrations import (
    MAX_BASELINE_EPISODES,
    SuccessRule,
    record_demonstrations,
)
from llamagym.schedule import Schedule, WarmStartLimit
from llamagym.task import Task
from llamagym.training.loop.run_directory import DEMONSTRATIONS
from llamagym.training.loop.run_state import isolated_rng, make_engine

logger = logging.getLogger(__name__)


def warm_start_settings(task: Task) -> Any:
    """The ``algorithm.warm_start`` section of ``task``'s config (None in an algorithm
    without one): the algorithm's ``Config`` validated it."""
    return getattr(task.resolved.algorithm, "warm_start", None)


def warm_start_baseline(task: Task) -> str | None:
    """The baseline ``task``'s config warm-starts from, if it names one."""
    return getattr(warm_start_settings(task), "baseline", None)


def check_resumed_demonstrations(task: Task, resumed_run: Path) -> Path | None:
    """The demonstrations file that the run in ``resumed_run`` recorded from its baseline
    when it started (None when the config names no baseline); a missing one is refused
    in one line, before anything is written."""
    baseline = warm_start_baseline(task)
    if baseline is None:
        return None
    path = resumed_run / DEMONSTRATIONS
    check_own_entry(path)  # the run wrote it: a link or a pipe there is not its record
    if not path.is_file():
        raise LlamaGymError(
            f"cannot resume with a warm start from the baseline {baseline!r}: "
            f"{str(path)!r} is missing, the demonstrations the run recorded from it when it "
            "started (a resumed run records none); put the file back, or start a new run"
        )
    return path


@contextlib.contextmanager
def baseline_demonstrations(
    task: Task, policy: Policy, output_dir: Path, resumed_run: Path | None = None
) -> Iterator[Path | None]:
    """The demonstrations file of ``task``'s baseline warm start while the run is built
    (None when its config names no baseline). A fresh run records it into
    ``output_dir``; each process after the first records the same episodes into a
    temporary file of its own, the run directory being rank 0's to write. A resumed run
    (``resumed_run``: the directory of the run it continues) records nothing and takes
    the file that run recorded, copied into ``output_dir`` when it continues elsewhere."""
    baseline = warm_start_baseline(task)
    if baseline is None:
        yield None
    elif resumed_run is not None:
        path = check_resumed_demonstrations(task, resumed_run)
        assert path is not None  # a baseline is named
        if distributed.is_main() and resumed_run.resolve() != output_dir.resolve():
            copy_atomically(path, output_dir / DEMONSTRATIONS)
        logger.info(
            "warm start: the demonstrations of %r the run recorded when it started (%s), "
            "trained on again before the checkpoint is loaded; none recorded", baseline, path,
        )
        yield path
    elif distributed.is_main():
        yield record_baseline(task, policy, baseline, output_dir / DEMONSTRATIONS)
    else:
        with tempfile.TemporaryDirectory(prefix="llamagym-demonstrations-") as scratch:
            yield record_baseline(task, policy, baseline, Path(scratch) / DEMONSTRATIONS)


def _what_to_try(task: Task, baseline: str, episodes: int) -> str:
    """More episodes of the baseline (while the bound allows), or another baseline."""
    tries = []
    if episodes < MAX_BASELINE_EPISODES:
        more = min(10 * episodes, MAX_BASELINE_EPISODES)
        tries.append(f"play more of them (--set algorithm.warm_start.baseline_episodes={more})")
    others = [name for name in task.baselines if name != baseline]
    if others:
        tries.append(f"warm-start from another baseline ({', '.join(others)})")
    return " or ".join(tries) or "this agent has no other baseline to warm-start from"


def record_baseline(task: Task, policy: Policy, baseline: str, path: Path) -> Path:
    """Play ``baseline`` for the configured episodes on the run's recording seeds and
    write the decisions of its successful episodes to ``path``, prompts rendered as the
    run renders them; an engine of its own, and the training random streams untouched."""
    config = task.config
    episodes = int(warm_start_settings(task).baseline_episodes)
    success = SuccessRule.of(task)
    with isolated_rng():
        engine = make_engine(
            task, policy, config, Schedule(config.rollout), num_envs=1, observe=False
        )
        try:
            recording = record_demonstrations(
                engine, baseline, episodes, path, seed=config.training.seed,
                outcomes=success.outcomes, min_return=success.min_return,
            )
        finally:
            engine.close()
    if not recording.demonstrations:
        path.unlink(missing_ok=True)  # an empty file would be no warm start
        raise LlamaGymError(
            f"warm start: no episode of {baseline!r} {success} in {episodes:,} "
            f"episode{'' if episodes == 1 else 's'}, so "
            f"there is nothing to learn from; {_what_to_try(task, baseline, episodes)}"
        )
    logger.info(
        "warm start: %s demonstrations from %s of %s episodes of %r (those that %s), "
        "written to %s",
        f"{recording.demonstrations:,}", f"{recording.kept_episodes:,}", f"{episodes:,}",
        baseline, success, path,
    )
    return path


#: The share of a time budget past which a warm start is said to crowd out RL.
WARM_START_SHARE = 0.5


def warm_start_limit(
    budget_seconds: float | None, resumed_meta: dict[str, Any] | None, several: bool
) -> WarmStartLimit:
    """Where a run's warm start stops: a resumed run (``resumed_meta``, its checkpoint's
    meta) after the batches the run it continues took; a fresh one of one process at
    :data:`WARM_START_SHARE` of its time budget, counted from now (several processes
    take every batch: a deadline each read on its own clock would break their lockstep)."""
    if resumed_meta is not None:
        state = resumed_meta.get("state") or {}
        saved = ((state.get("algorithm") or {}).get("warm_start") or {}).get(
            "demonstration_batches")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0:
            return WarmStartLimit(batches=saved)
        return WarmStartLimit()
    if budget_seconds is None or several:
        return WarmStartLimit()
    return WarmStartLimit(deadline=time.perf_counter() + WARM_START_SHARE * budget_seconds)


def warn_if_long(seconds: float, budget_seconds: float | None, algorithm: Any) -> None:
    """Say when a fresh run's warm start took more than :data:`WARM_START_SHARE` of its
    time budget (it counts in it), with what makes it shorter."""
    if budget_seconds is None or seconds <= WARM_START_SHARE * budget_seconds:
        return
    settings = getattr(getattr(algorithm, "config", None), "warm_start", None)
    if settings is None or (settings.demonstrations is None and settings.baseline is None):
        return
    left = max(budget_seconds - seconds, 0.0)
    logger.warning(
        "warm start: it took %.0f s of the %g min budget, %.0f s left for RL; fewer passes "
        "over the demonstrations (--set algorithm.warm_start.demonstration_epochs=..., now "
        "%d), fewer baseline episodes (algorithm.warm_start.baseline_episodes, now %d) or "
        "a larger budget (--minutes) leave RL more",
        seconds, budget_seconds / 60, left, settings.demonstration_epochs,
        settings.baseline_episodes,
    )
