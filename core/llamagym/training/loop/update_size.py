"""Updates that fit the budget: after a run's first update, when its time budget would
hold fewer than ``training.min_updates`` updates at the first one's cost, the episodes
per update are made fewer (never more), so that a slow CPU still gets a learning curve
instead of a handful of steps. The choice is said in the run's first lines and written
to ``config.yaml`` (and every checkpoint's config, so a resumed run keeps it); an
``algorithm.episodes_per_update`` the user set (``--set``, a config file, a dict in
Python) is kept as it is, and so is every value of a resumed run."""

from __future__ import annotations

import logging
import math
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
    group_size: int = 1,
) -> int | None:
    """The episodes per update that let ``budget_seconds`` hold ``min_updates`` updates,
    when the first (``episodes`` of them, ``first_seconds`` long) says it holds fewer;
    None when the budget already holds them (or nothing smaller is allowed)."""
    if first_seconds <= 0 or budget_seconds / first_seconds >= min_updates:
        return None
    per_episode = first_seconds / episodes
    fitted = math.floor(budget_seconds / min_updates / per_episode)
    floor = max(MIN_EPISODES, group_size)
    fitted = max(floor, fitted - fitted % group_size)
    return fitted if fitted < episodes else None


def fit_to_budget(
    agent: Any, algorithm: Any, first_seconds: float, budget_seconds: float | None,
    resumed: bool,
) -> str | None:
    """Apply :func:`fitted_episodes` to ``agent``'s run after its first update; the line
    that says the choice, or None when nothing changed."""
    config = agent.config
    min_updates = config.training.min_updates
    if (resumed or budget_seconds is None or min_updates is None
            or agent.resolved.sources.get(KEY) not in _DEFAULT_SOURCES
            or config.training.backend != "native"):
        return None
    episodes = algorithm.episodes_per_update
    fitted = fitted_episodes(episodes, first_seconds, budget_seconds, min_updates,
                             algorithm.group_size)
    if fitted is None or not hasattr(algorithm.config, "episodes_per_update"):
        return None
    algorithm.config.episodes_per_update = fitted
    config.algorithm.episodes_per_update = fitted
    agent.resolved.sources[KEY] = SOURCE
    return (
        f"update size: {fitted} episodes per update, not {episodes}: the first update took "
        f"{first_seconds:.0f} s, and {budget_seconds / 60:g} min hold {min_updates} updates "
        f"of {fitted} (--set {KEY}={episodes} keeps {episodes}; training.min_updates=null "
        "turns this off)"
    )
