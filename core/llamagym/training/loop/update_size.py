"""Updates that fit the budget: when a run's time budget would hold fewer than
``training.min_updates`` updates, the episodes per update are made fewer (never more),
so that a slow CPU or a slow env still gets a learning curve instead of a handful of
steps. The first collection ends once it has used its share of the budget (and holds
:data:`MIN_EPISODES`), with its episodes in progress carried on; after the first update,
its measured cost per episode sets the size of the rest, so that what is left of the
budget holds the other ``min_updates - 1``. The choice is said in the run's
first lines and written to ``config.yaml`` (and every checkpoint's config, so a resumed
run keeps it); an ``algorithm.episodes_per_update`` the user set (``--set``, a config
file, a dict in Python) is kept as it is, and so is every value of a resumed run."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

KEY = "algorithm.episodes_per_update"
#: The layers whose value the run may change: the built-in, agent and model defaults.
_DEFAULT_SOURCES = (None, "agent defaults", "pretrained-model defaults")
#: The fewest episodes an update is made of (a group-sampling algorithm's groups stay whole).
MIN_EPISODES = 4
SOURCE = "fitted to the time budget (training.min_updates)"


def fitted_episodes(
    episodes: int, first_seconds: float, budget_seconds: float, min_updates: int,
    group_size: int = 1, wanted: int | None = None,
) -> int | None:
    """The episodes per update that let what the first update (``episodes`` of them,
    ``first_seconds`` long) left of ``budget_seconds`` hold the other ``min_updates - 1``
    updates, when at the first one's cost per episode it holds fewer of ``wanted``
    (default: ``episodes``) each; None when it already holds them (or nothing smaller is
    allowed)."""
    wanted = episodes if wanted is None else wanted
    per_episode = first_seconds / max(episodes, 1)
    left, updates_left = max(budget_seconds - first_seconds, 0.0), min_updates - 1
    if per_episode <= 0 or updates_left < 1 or left / (per_episode * wanted) >= updates_left:
        return None
    fitted = math.floor(left / updates_left / per_episode)
    floor = max(MIN_EPISODES, group_size)
    fitted = max(floor, fitted - fitted % group_size)
    return fitted if fitted < wanted else None


def _fits(agent: Any, budget_seconds: float | None, resumed: bool) -> bool:
    """Whether this run's update size is the run's to choose: a time budget and
    ``training.min_updates``, a size from the defaults, the native backend, a new run."""
    config = agent.config
    return not (
        resumed or budget_seconds is None or config.training.min_updates is None
        or agent.resolved.sources.get(KEY) not in _DEFAULT_SOURCES
        or config.training.backend != "native"
    )


def first_collection_enough(
    agent: Any, budget_seconds: float | None, resumed: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> Callable[[int], bool] | None:
    """For the first collection of a run whose size is its own to choose (a carrying
    one: its episodes in progress go on): says it has enough once it has lasted the
    budget's share of one update and holds :data:`MIN_EPISODES` finished episodes, so a
    first update no longer eats the budget it is meant to measure. None: collect all."""
    if not _fits(agent, budget_seconds, resumed):
        return None
    assert budget_seconds is not None
    share, started = budget_seconds / agent.config.training.min_updates, clock()
    return lambda finished: finished >= MIN_EPISODES and clock() - started >= share


def fit_to_budget(
    agent: Any, algorithm: Any, first_episodes: int, first_seconds: float,
    budget_seconds: float | None, resumed: bool,
) -> str | None:
    """Apply :func:`fitted_episodes` to ``agent``'s run after its first update (of
    ``first_episodes`` episodes, ``first_seconds`` long); the line that says the choice,
    or None when nothing changed."""
    if not _fits(agent, budget_seconds, resumed):
        return None
    assert budget_seconds is not None
    config, episodes = agent.config, algorithm.episodes_per_update
    min_updates = config.training.min_updates
    fitted = fitted_episodes(first_episodes, first_seconds, budget_seconds, min_updates,
                             algorithm.group_size, wanted=episodes)
    if fitted is None or not hasattr(algorithm.config, "episodes_per_update"):
        return None
    algorithm.config.episodes_per_update = fitted
    config.algorithm.episodes_per_update = fitted
    agent.resolved.sources[KEY] = SOURCE
    return (
        f"update size: {fitted} episodes per update, not {episodes}: the first update "
        f"({first_episodes} episodes) took {first_seconds:.0f} s, and the "
        f"{max(budget_seconds - first_seconds, 0) / 60:.1f} min left hold "
        f"{min_updates - 1} more of {fitted} "
        f"(--set {KEY}={episodes} keeps {episodes}; training.min_updates=null turns this off)"
    )

