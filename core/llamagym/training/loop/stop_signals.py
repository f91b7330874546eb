"""SIGINT and SIGTERM as a request to stop: the first is noted (the loop finishes its step
or update, then writes a checkpoint), a second raises KeyboardInterrupt at once."""

from __future__ import annotations

import logging
import signal
import threading
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)


class StopSignals:
    """A context manager that holds SIGINT/SIGTERM while a run is in it; ``received`` is
    the name of the first signal ("SIGTERM"...), or None. ``finishing`` says in the
    warning what the run does before it stops ("this step", "this update")."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, finishing: str):
        self.finishing = finishing
        self.received: str | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signal.Signals(signum).name
        logger.warning(
            "%s received: finishing %s, then writing a checkpoint "
            "(send it again to stop at once, without one)",
            self.received,
            self.finishing,
        )

    def __enter__(self) -> StopSignals:
        # Signal handlers can only be installed from the main thread; elsewhere the run
        # has no signals of its own.
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._request_stop) for sig in self.SIGNALS}
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
