"""One JVM for the tests that play games: a lease held for the session keeps the JVM
the envs share running between tests (starting one takes seconds), and giving it back
at the end ends it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from llamagym_textworld_express.jvm import SHARED_JAVA, JavaProcess


@pytest.fixture(scope="session")
def shared_jvm() -> Iterator[JavaProcess]:
    lease = SHARED_JAVA.lease(timeout=120)
    try:
        yield lease.process
    finally:
        lease.close()
