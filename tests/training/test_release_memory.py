"""Freed heap blocks are handed back to the system between a run's phases."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

import pytest

from llamagym.testing import BanditAgent, tiny_agent
from llamagym.training.loop import trainer as trainer_module
from llamagym.training.loop.release_memory import release_freed_memory
from llamagym.training.loop.trainer import Trainer

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not Path("/proc/self/statm").exists(),
    reason="malloc_trim is glibc's, the resident set read from /proc",
)


def resident_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


@glibc_only
def test_the_pages_of_freed_blocks_inside_the_heap_leave_the_resident_set() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 96 * 1024, 2048  # 192 MiB in blocks below any mmap threshold
    blocks = [libc.malloc(block) for _ in range(count)]
    assert all(blocks)
    for address in blocks:
        ctypes.memset(address, 1, block)  # resident
    pin = libc.malloc(block)  # keeps the freed blocks off the heap's top, as in a run
    ctypes.memset(pin, 1, block)
    try:
        for address in blocks:
            libc.free(address)
        freed_but_resident = resident_bytes()
        assert release_freed_memory() is True
        released = freed_but_resident - resident_bytes()
    finally:
        libc.free(pin)
    assert released > 150 * 2**20, f"only {released / 2**20:.0f} MiB left the resident set"


def test_a_run_releases_freed_memory_before_and_after_each_update(tmp_path, monkeypatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: calls.append(1) or True)
    agent = tiny_agent(
        BanditAgent,
        training={"episodes": 32},
        algorithm={"episodes_per_update": 16},
        output={"dir": str(tmp_path / "run"), "quiet": True},
    )
    summary = Trainer(agent, agent.session).run()
    assert summary.updates == 2
    assert len(calls) == 2 * summary.updates
