"""Starting a run and resuming one: the check that the agent's environment can be made
before anything is written, the restore of a checkpoint's weights, counters and random
states with the metrics history up to it, and the warning when a resumed run's plugins
are not the ones its checkpoint was trained with."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gymnasium

from llamagym.errors import LlamaGymError
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.loop.run_state import Counters, Run, isolated_rng
from llamagym.training.records.report import records_until, rewrite_records

logger = logging.getLogger(__name__)


def make_first_env(agent: Any) -> None:
    """Make one of the agent's environments and close it again, before anything is
    written: an env id that no installed package registers (or an env missing a
    dependency) is one line naming the agent and the fix, and no run directory is left
    behind. The training random streams do not move."""
    name = agent.config.agent.name or type(agent).__name__
    env_id = getattr(agent, "env_id", None)
    what = f"environment {env_id!r}" if env_id else "its environment"
    try:
        with isolated_rng():
            agent.make_env().close()
    except (gymnasium.error.UnregisteredEnv, gymnasium.error.DeprecatedEnv) as error:
        raise LlamaGymError(
            f"agent {name!r}: {what} is not registered with gymnasium "
            f"({_one_line(error)}); install the package that registers it, or check "
            "`llamagym list` for the agents installed"
        ) from error
    except gymnasium.error.DependencyNotInstalled as error:
        raise LlamaGymError(
            f"agent {name!r}: {what} needs a package that is not installed: {_one_line(error)}"
        ) from error
    except gymnasium.error.Error as error:
        raise LlamaGymError(
            f"agent {name!r} cannot make {what}: {_one_line(error)}; check the env id it "
            f"uses with `llamagym check {name}`"
        ) from error


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def restore_run(
    run: Run,
    checkpoint: Path,
    counters: Counters,
    earlier: list[dict[str, Any]],
    metrics_file: Path | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Load ``checkpoint`` into ``run`` and ``counters``. Returns the metrics
    history up to it (``earlier``: the records of the run it belongs to), which
    replaces ``metrics_file`` when one is given, and the plugins the checkpoint
    recorded."""
    saved = checkpoints.restore_training_checkpoint(checkpoint, run)
    plugins = checkpoints.read_meta(checkpoint).get("plugins")
    for name, value in saved.items():
        if hasattr(counters, name):
            setattr(counters, name, value)
    stats = run.engine.stats
    stats.env_steps, stats.env_failures = counters.env_steps, counters.env_failures
    # The history continues the old run's metrics up to the checkpoint; lines a
    # crashed run wrote after it would be written again, so they are dropped.
    history = records_until(earlier, counters.updates)
    history.append(
        {"kind": "resume", "update": counters.updates, "checkpoint": str(checkpoint)}
    )
    if metrics_file is not None:
        rewrite_records(metrics_file, history)
    logger.info("resumed from %s at update %d", checkpoint, counters.updates)
    return history, plugins


def _plugin_names(plugins: list[dict[str, Any]]) -> set[str]:
    return {f"{p.get('name')} ({p.get('distribution')} {p.get('version')})" for p in plugins}


def warn_if_plugins_changed(
    saved: list[dict[str, Any]], current: list[dict[str, Any]]
) -> None:
    """A resumed run whose per-step plugins differ from the checkpoint's says so: its
    prompts, parsing or rewards may no longer be the ones it was trained with."""
    before, now = _plugin_names(saved), _plugin_names(current)
    if before == now:
        return
    logger.warning(
        "the plugins answering per-step hooks differ from the checkpoint's: %s%s",
        f"new {', '.join(sorted(now - before))}" if now - before else "",
        ("; " if now - before and before - now else "")
        + (f"gone {', '.join(sorted(before - now))}" if before - now else ""),
    )
