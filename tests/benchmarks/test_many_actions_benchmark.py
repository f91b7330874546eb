"""`python benchmarks/many_actions.py --quick` stays runnable: the scaffold's guessing
game rendered and registered, one row, one seed, a few seconds of training, and a result
file with the documented keys and numbers in range."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_many_actions_quick_writes_its_json(tmp_path: Path) -> None:
    output = tmp_path / "many-actions-quick.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/many_actions.py", "--quick", "--output", str(output)],
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
        "max_entropy",
        "exact",
        "baselines",
        "summary",
        "runs",
        "total_wall_seconds",
    ):
        assert key in result, key
    assert result["quick"] is True and result["seeds"] == [0]
    assert result["episodes_per_run"] == 64 and result["eval_episodes"] == 20
    assert result["command"].startswith("python benchmarks/many_actions.py --quick")
    assert result["machine"]["cores"] >= 1 and result["date"]

    # Exact values: random play guesses with replacement, binary search finds every secret.
    assert result["max_entropy"] == pytest.approx(math.log(16))
    assert result["exact"]["random"]["found"] == pytest.approx(1 - (15 / 16) ** 8)
    assert result["exact"]["binary-search"] == {"found": 1.0, "guesses": pytest.approx(3.375)}
    assert result["baselines"]["binary-search"]["found"] == 1.0
    assert 0.0 <= result["baselines"]["random"]["found"] <= 1.0
    for baseline in result["baselines"].values():
        assert 1.0 <= baseline["guesses"] <= 8.0

    [(name, row)] = result["summary"].items()
    assert name == "ppo" and row["seeds"] == [0] and row["settings"] == []
    assert row["command"] == "python benchmarks/many_actions.py --quick --only ppo"
    assert row["mean_return_per_seed"] == [row["mean_return"]]
    assert row["found"] == row["mean_return"]  # the game pays 1 once, for the right guess
    assert 1.0 <= row["guesses"] <= 8.0 and row["invalid_rate"] == 0.0
    assert 0.0 < row["entropy_start"] <= math.log(16) + 1e-6
    assert row["episodes"] >= 64 and row["wall_seconds"] > 0

    [run] = result["runs"]
    assert run["setup"] == "ppo" and run["eval_episodes"] == 20
    assert run["first_guess"] in {str(n) for n in range(1, 17)}
    assert run["updates"] >= 1 and len(run["training_found"]) == run["updates"]
    assert all(0.0 <= share <= 1.0 for share in run["training_found"])
    assert set(run["baselines"]) == {"random", "binary-search"}
    assert run["demonstrations"] is None
