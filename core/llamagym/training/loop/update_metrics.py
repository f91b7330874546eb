"""An update's numbers: what every process did during it, added to the run's counters
and made into the update's metrics line; the warning when the first update moved the
policy too far, and the stop when too many in a row skipped their steps."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from llamagym import distributed
from llamagym.errors import TrainingDivergedError
from llamagym.training.loop.run_state import Training

logger = logging.getLogger(__name__)

# An update whose policy moves further than this from the one that collected its batch
# (PPO's approx-KL, in nats per action) has left the region where its surrogate is valid.
SANE_UPDATE_KL = 0.1


def count_update(
    training: Training, batch: list[Any], update_metrics: dict[str, float]
) -> dict[str, float]:
    """Add the update every process just made to ``training.counters``, and return its
    metrics: the rollout's over every process, then ``update_metrics``, the
    algorithm's own (rank 0's, with several processes)."""
    counters, engine = training.counters, training.run.engine
    # What every process did this update (one process: just this one).
    shares = distributed.all_gather(
        {
            "returns": [e.env_return for e in batch],
            "turns": sum(len(e.turns) for e in batch),
            "invalid": sum(e.invalid_replies for e in batch),
            "env_steps": engine.stats.env_steps - training.steps_before,
            "env_failures": engine.stats.env_failures - training.failures_before,
            "seconds": time.perf_counter() - training.started,
            "update_seconds": time.perf_counter() - training.update_started,
        }
    )
    returns = [value for share in shares for value in share["returns"]]
    turns = sum(share["turns"] for share in shares)
    steps = sum(share["env_steps"] for share in shares)
    counters.updates += 1
    counters.episodes += len(returns)
    counters.env_steps += steps
    counters.env_failures += sum(share["env_failures"] for share in shares)
    counters.seconds = training.seconds_before + shares[0]["seconds"]  # rank 0's clock
    recent = training.recent
    recent.extend(returns)
    counters.recent_returns = list(recent)
    metrics = {
        "update": counters.updates,
        "total_episodes": counters.episodes,
        "env_steps": counters.env_steps,
        "seconds": counters.seconds,
        "return_mean": sum(returns) / max(1, len(returns)),
        "return_moving_average": float(np.mean(recent)) if recent else 0.0,
        "invalid_rate": sum(s["invalid"] for s in shares) / max(1, turns),
        "episode_length": turns / max(1, len(returns)),
        "episodes": float(len(returns)),
        "env_steps_per_second": steps / max(shares[0]["update_seconds"], 1e-9),
        "env_failures": counters.env_failures,
        "temperature": engine.temperature,
    }
    metrics.update({k: v for k, v in update_metrics.items() if k not in metrics})
    return metrics


def warn_if_first_update_moved_far(metrics: dict[str, float], config: Any) -> None:
    """One warning when the first update moved the policy far: with a pretrained model
    it means the learning rate is too high for it, and the next updates only get worse."""
    kl = metrics.get("approx_kl")
    if kl is None or kl <= SANE_UPDATE_KL:
        return
    lr = getattr(config.algorithm, "lr", None)
    target = getattr(config.algorithm, "target_kl", None)
    fix = f"lower algorithm.lr (now {lr:g})" if lr is not None else "lower algorithm.lr"
    if target is None:
        fix += " or set algorithm.target_kl=0.02, which stops an update's epochs early"
    logger.warning(
        "update 1 moved the policy far from the one that collected its episodes "
        "(approx-KL %.3g, above %.2g): %s",
        kl,
        SANE_UPDATE_KL,
        fix,
    )


def check_skipped_steps(
    training: Training, skipped: int, max_in_a_row: int, last_checkpoint: Any
) -> None:
    """Count an update that ``skipped`` optimizer steps (a non-finite loss or gradient);
    ``max_in_a_row`` such updates in a row end the run, naming ``last_checkpoint``."""
    if not skipped:
        training.skipped_in_a_row = 0
        return
    training.skipped_in_a_row += 1
    logger.warning(
        "update %d: %d optimizer step(s) skipped for a non-finite loss or gradient; "
        "the weights were left unchanged",
        training.counters.updates + 1,
        skipped,
    )
    if training.skipped_in_a_row >= max_in_a_row:
        raise TrainingDivergedError(
            f"{training.skipped_in_a_row} updates in a row had a non-finite loss or "
            f"gradient; stopping. The last good checkpoint is {last_checkpoint}; "
            "try a lower algorithm.lr, or check the rewards for inf/nan"
        )
