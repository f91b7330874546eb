"""Agent ``openenv`` on an env LlamaGym did not write: the echo env OpenEnv's own
``openenv init`` makes (its template: a step echoes the message sent, rewarded by its
length up to 1.0 at 10 characters, and no episode ever ends), served by uvicorn as the
template says. ``llamagym check`` passes on it, and a tiny-model run learns to send the
longest of three messages."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
               "PYTHONUNBUFFERED": "1"}
#: The echo env's fields, and three messages to choose from (rewards 0.2, 0.5, 1.0).
ECHO = ["agent.text_field=echoed_message", "agent.action_field=message",
        "agent.actions=hi,hello,hello_there_friend", "agent.max_episode_steps=4"]


def _sets(url: str) -> list[str]:
    return [part for key in [f"agent.url={url}", *ECHO] for part in ("--set", key)]


@pytest.fixture(scope="module")
def echo_server(tmp_path_factory, stop_process) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("openenv")
    openenv = shutil.which("openenv", path=str(Path(sys.executable).parent))
    assert openenv, "the openenv command is not installed beside this Python"
    made = subprocess.run([openenv, "init", "echo_env"], cwd=folder, capture_output=True,
                          text=True, timeout=120)
    assert made.returncode == 0, made.stdout + made.stderr
    env_folder = folder / "echo_env"
    app = env_folder / "server" / "app.py"
    # The template serves one session; its comment says to raise it for more.
    text = app.read_text()
    assert "max_concurrent_envs=1," in text
    app.write_text(text.replace("max_concurrent_envs=1,", "max_concurrent_envs=16,"))
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
         "--port", "0"],
        cwd=env_folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=ENVIRONMENT,
    )
    found: dict[str, str] = {}
    ready = threading.Event()

    def read() -> None:
        for line in iter(server.stdout.readline, ""):
            match = re.search(r"running on http://127\.0\.0\.1:(\d+)", line)
            if match:
                found["port"] = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(60) and "port" in found, "the echo env's server did not start"
        yield f"ws://127.0.0.1:{found['port']}"
    finally:
        stop_process(server)


def _llamagym() -> list[str]:
    script = Path(sys.executable).with_name("llamagym")
    return [str(script)] if script.exists() else [sys.executable, "-m", "llamagym.cli"]


def test_llamagym_check_passes_on_openenvs_own_echo_env(echo_server):
    done = subprocess.run([*_llamagym(), "check", "openenv", *_sets(echo_server)],
                          capture_output=True, text=True, timeout=300, env=ENVIRONMENT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "9 passed, 0 failed" in done.stdout, done.stdout


def test_a_tiny_model_learns_to_send_the_longest_message(echo_server, tmp_path: Path):
    output = tmp_path / "run"
    done = subprocess.run(
        [*_llamagym(), "run", "openenv", *_sets(echo_server), "--model", "tiny",
         "--episodes", "128", "--eval-episodes", "20", "--threads", "1", "--seed", "0",
         "--quiet", "--output", str(output)],
        capture_output=True, text=True, timeout=600, env=ENVIRONMENT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if r.get("kind") == "update"]
    evaluation = [r for r in records if r.get("kind") == "evaluation"][-1]
    random = next(b for b in evaluation["baselines"] if b["name"] == "random")
    assert len(updates) == 2 and updates[-1]["env_failures"] == 0
    assert all(r["episode_length"] == 4 for r in updates)  # cut at agent.max_episode_steps
    # Random picks average 4 x (0.2 + 0.5 + 1.0) / 3 = 2.27; always the longest is 4.0.
    assert evaluation["mean"] > random["mean"] + 0.5, (evaluation["mean"], random["mean"])
