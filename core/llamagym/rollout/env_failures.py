"""Environments that fail during a collection: each failure counted (in a row, across
collections), logged, and the env replaced in place; too many in a row end the run
(:class:`EnvFailures`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

from llamagym.errors import EnvFailureError
from llamagym.rollout.env_checks import error_text

logger = logging.getLogger(__name__)


class EnvFailures:
    """Replaces an env that failed with a new one from ``make_env``.

    ``env_name()`` names the env in messages; ``stats.env_failures`` counts every
    failure. More than ``max_in_a_row`` failures with no completed step between them
    raise :class:`EnvFailureError` (a batch of dropped episodes is no success)."""

    def __init__(
        self,
        make_env: Callable[[], Any],
        env_name: Callable[[], str],
        max_in_a_row: int,
        stats: Any,
    ):
        self.make_env = make_env
        self.env_name = env_name
        self.max_in_a_row = max_in_a_row
        self.stats = stats
        self.in_a_row = 0

    def succeeded(self) -> None:
        """An env completed a step: the count in a row starts again."""
        self.in_a_row = 0

    def replace(self, envs: list[Any], position: int, error: Exception) -> None:
        """Count ``envs[position]``'s failure, then close it and put a new env in its
        place (or raise, past ``max_in_a_row``)."""
        self.in_a_row += 1
        self.stats.env_failures += 1
        logger.warning(
            "%s, environment %d, failed (%s: %s); episode dropped, environment recreated",
            self.env_name(),
            position,
            type(error).__name__,
            error_text(error),
        )
        if self.in_a_row > self.max_in_a_row:
            raise EnvFailureError(
                f"{self.env_name()} failed {self.in_a_row} times in a row (last: "
                f"{type(error).__name__}: {error_text(error)}); stopping the run "
                f"(training.max_env_failures = {self.max_in_a_row})"
            ) from error
        with contextlib.suppress(Exception):  # a broken env may fail to close; it is replaced
            envs[position].close()
        envs[position] = self.make_env()
