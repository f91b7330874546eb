"""Agent ``openenv`` end to end: ``llamagym check`` passes on a served Blackjack, a
tiny-model run trains on it, and a run whose server dies ends in one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from llamagym_openenv.client import OpenEnvError

from llamagym.cli.run_commands import resolve_run_config

ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_the_agent_is_installed_listed_and_asks_for_its_url(llamagym):
    listed = subprocess.run([*llamagym, "list"], capture_output=True, text=True, timeout=60)
    assert "openenv" in listed.stdout
    agent_class, resolved = resolve_run_config("openenv", None, [], {})
    with pytest.raises(OpenEnvError, match=r"--set agent.url=ws://127.0.0.1:PORT"):
        agent_class(config=resolved).make_env()
    with pytest.raises(OpenEnvError, match="not an OpenEnv server's URL"):
        agent_class(config=resolve_run_config(
            "openenv", None, ["agent.url=ftp://x"], {})[1]).make_env()


def test_llamagym_check_passes_on_openenv_against_a_served_blackjack(blackjack_server, llamagym):
    done = subprocess.run(
        [*llamagym, "check", "openenv", "--set", f"agent.url={blackjack_server.url}"],
        capture_output=True, text=True, timeout=120, env=ENVIRONMENT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failed" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "mode"), [
    ("ppo", "score"), ("grpo", "generate"), ("rloo", "score"), ("reinforce", "generate")])
def test_a_tiny_model_run_trains_on_a_served_blackjack(blackjack_server, llamagym, tmp_path: Path,
                                                       algorithm: str, mode: str):
    output = tmp_path / "run"
    done = subprocess.run(
        [*llamagym, "run", "openenv", "--set", f"agent.url={blackjack_server.url}",
         "--algorithm", algorithm, "--mode", mode, "--episodes", "16", "--eval-episodes", "0",
         "--threads", "1", "--quiet", "--seed", "0",
         "--set", "algorithm.episodes_per_update=8", "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=ENVIRONMENT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    metrics = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    updates = [m for m in metrics if m.get("kind") == "update"]
    assert [m["update"] for m in updates] == [1, 2] and updates[-1]["env_failures"] == 0
    resolved = (output / "config.yaml").read_text()
    assert f"name: {algorithm}" in resolved and f"mode: {mode}" in resolved


@pytest.mark.slow
def test_a_run_whose_server_is_killed_ends_in_one_line_and_never_hangs(
    serve, llamagym, tmp_path: Path
):
    with serve("blackjack", "--max-sessions", "16") as served:
        run = subprocess.Popen(
            [*llamagym, "run", "openenv", "--set", f"agent.url={served.url}",
             "--episodes", "100000", "--eval-episodes", "0", "--threads", "1", "--quiet",
             "--set", "agent.timeout_seconds=3", "--set", "agent.connect_timeout_seconds=2",
             "--output", str(tmp_path / "run")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENVIRONMENT,
        )
        try:
            time.sleep(25)  # the model loads and the run plays
            assert run.poll() is None, run.communicate()[1][-3000:]
            os.kill(served.process.pid, signal.SIGKILL)
            start = time.monotonic()
            _, stderr = run.communicate(timeout=120)
        finally:
            if run.poll() is None:
                run.kill()
    assert run.returncode == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "failed 11 times in a row" in errors[0], stderr[-3000:]
    assert "OpenEnv server at" in errors[0]
    assert time.monotonic() - start < 120
