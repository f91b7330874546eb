"""kill -9 in the middle of a checkpoint write leaves the previous one loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from llamagym.testing import tiny_agent
from llamagym.training.checkpoint import store as checkpoints

SCRIPT = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import safetensors.torch
    from llamagym.testing import tiny_agent
    from llamagym.training.loop.trainer import Trainer

    run_dir = Path(sys.argv[1])
    real_save = safetensors.torch.save_file

    def save_then_hang(tensors, path, *args, **kwargs):
        real_save(tensors, path, *args, **kwargs)
        if "update-000002" in str(path):
            (run_dir.parent / "writing").touch()  # the second checkpoint is half written
            time.sleep(120)

    safetensors.torch.save_file = save_then_hang
    agent = tiny_agent(
        training={"episodes": 32},
        output={"dir": str(run_dir), "quiet": True, "checkpoint_every": 1},
    )
    Trainer(agent, agent.session).run()
    """
)


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path) -> None:
    run_dir = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir)])
    try:
        deadline = time.time() + 120
        while not (tmp_path / "writing").exists():
            assert process.poll() is None, "the run ended before the second checkpoint"
            assert time.time() < deadline, "the second checkpoint write never started"
            time.sleep(0.1)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGKILL
    found = checkpoints.list_checkpoints(run_dir)
    assert [path.name for path in found] == ["update-000001"]
    assert any(
        path.name.startswith(".update-000002") for path in (run_dir / "checkpoints").iterdir()
    )
    agent = tiny_agent()
    meta = checkpoints.load_checkpoint(agent.policy, found[0])
    assert meta["update"] == 1 and meta["counters"]["episodes"] == 16
