"""`python benchmarks/sparse_rewards.py --quick` stays runnable: one row, one seed, a few
seconds of training, and a result file with the documented keys and numbers in range."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_sparse_rewards_quick_writes_its_json(tmp_path: Path) -> None:
    output = tmp_path / "sparse-rewards-quick.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/sparse_rewards.py", "--quick", "--output", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    printed = json.loads(completed.stdout)  # stdout is the summary as JSON, nothing else
    result = json.loads(output.read_text())
    assert printed["summary"] == result["summary"]

    for key in (
        "benchmark",
        "command",
        "date",
        "machine",
        "quick",
        "env",
        "model",
        "episodes_per_run",
        "eval_episodes",
        "seeds",
        "exact",
        "baselines",
        "summary",
        "runs",
        "total_wall_seconds",
    ):
        assert key in result, key
    assert result["quick"] is True and result["seeds"] == [0]
    assert result["command"].startswith("python benchmarks/sparse_rewards.py --quick")
    assert result["machine"]["cores"] >= 1 and result["date"]

    # The exact values of the two baselines on the slippery 4x4 lake.
    assert result["exact"]["random"] == pytest.approx(0.0139, abs=0.001)
    assert result["exact"]["optimal"] == pytest.approx(0.740, abs=0.002)
    for name in ("random", "optimal"):
        assert 0.0 <= result["baselines"][name] <= 1.0

    [(name, row)] = result["summary"].items()
    assert name == "ppo" and row["seeds"] == [0]
    assert row["command"] == "python benchmarks/sparse_rewards.py --quick --only ppo"
    assert 0.0 <= row["success"] <= 1.0 and 0.0 <= row["invalid_rate"] <= 1.0
    assert row["episodes"] >= 64 and row["wall_seconds"] > 0

    [run] = result["runs"]
    assert run["setup"] == "ppo" and run["eval_episodes"] == 20
    assert 0.0 <= run["success"] <= 1.0 and run["updates"] >= 1
    assert len(run["training_success"]) == run["updates"]
    assert all(0.0 <= share <= 1.0 for share in run["training_success"])
    assert set(run["baselines"]) == {"random", "optimal"}
