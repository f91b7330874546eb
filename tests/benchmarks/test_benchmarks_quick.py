"""The benchmark harness stays runnable: `python -m benchmarks throughput --quick` (our
side only; the original LlamaGym needs its own venv) writes a result file with the
documented fields, its plot, and a table row that names command, machine and commit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture
def benchmarks(monkeypatch):
    """The ``benchmarks`` package (a folder of the repository, not an installed one)."""
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.table
    import benchmarks.throughput

    return benchmarks


def test_throughput_quick_writes_documented_json(tmp_path, benchmarks):
    throughput, table = benchmarks.throughput, benchmarks.table
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "throughput", "--quick", "--skip-peer",
         "--batch-sizes", "1", "8", "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]

    result = json.loads((tmp_path / "throughput-quick.json").read_text())
    assert (tmp_path / "throughput-quick.png").stat().st_size > 0
    assert not (tmp_path / "throughput.json").exists()  # a smoke run keeps full results
    for key in ("benchmark", "command", "date", "quick", "threads", "machine",
                *throughput.TOP_FIELDS):
        assert key in result, key
    assert result["quick"] is True
    assert result["command"].startswith("python -m benchmarks throughput --quick")
    assert result["machine"]["cores"] >= 1 and result["machine"]["cpu_model"]
    # The code measured: the commit, and whether the tree had changes on top of it.
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                          text=True, check=False)
    if head.returncode == 0:
        assert result["commit"] == head.stdout.strip() and isinstance(result["dirty"], bool)
    else:  # sources without their git history: nothing to name
        assert result["commit"] is None and result["dirty"] is None
    assert result["peer"]["skipped"] is True and result["ratios"] == []

    rows = result["rows"]
    assert {(r["mode"], r["num_envs"]) for r in rows} == {
        (mode, n) for mode in throughput.MODES for n in (1, 8)
    }
    for row in rows:
        assert set(throughput.ROW_FIELDS) <= set(row), row
        assert row["side"] == "llamagym"
        steps = row["env_steps_per_second"]
        assert steps["min"] <= steps["median"] <= steps["max"] and steps["median"] > 0
        assert (row["generated_tokens_per_second"] is None) == (row["mode"] == "score")
        assert row["peak_rss_mb"]["median"] > 50
    assert {u["mode"] for u in result["updates"]} == set(throughput.MODES)
    for update in result["updates"]:
        assert set(throughput.UPDATE_FIELDS) <= set(update), update
        assert update["update_seconds"]["median"] > 0
        assert update["turns_per_update"]["median"] >= update["episodes_per_update"]

    markdown = table.render(tmp_path, quick=True)
    assert "### Throughput" in markdown
    throughput_rows = [line for line in markdown.splitlines() if "| LlamaGym |" in line]
    assert len(throughput_rows) == len(rows)
    for line in throughput_rows:
        assert "`python -m benchmarks throughput --quick" in line
        assert result["machine"]["cpu_model"] in line
        # The row is keyed by the commit measured, linked to its file; never by date alone.
        read = {**result, "result_file": "throughput-quick.json"}  # as the table reads it
        assert line.endswith(f" | {table._commit_cell(read, read)} |"), line
        assert not result["commit"] or f"[{result['commit'][:7]}](" in line


@pytest.mark.parametrize(
    ("script", "heading"), [("cartpole", "### CartPole-v1"), ("textworld", "### TextWorld")]
)
def test_env_benchmark_script_runs_from_a_cold_cache(tmp_path, benchmarks, script, heading):
    """Run as a user runs it (a file, not a module), with nothing cached: TextWorld's games
    are generated first, which imports the textworld library from the script."""
    output = tmp_path / f"{script}-quick.json"
    settings = ["--minutes", "0.05"] + (["--games", "1"] if script == "textworld" else [])
    completed = subprocess.run(
        [sys.executable, f"benchmarks/{script}.py", "--quick", *settings, "--output", output],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "LLAMAGYM_CACHE": str(tmp_path / "cache")},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["quick"] is True
    assert result["command"].startswith(f"python benchmarks/{script}.py --quick")
    assert result["machine"]["cores"] >= 1 and result["date"]
    assert len(result["runs"]) == 1
    markdown = benchmarks.table.render(tmp_path, quick=True)
    assert heading in markdown and result["machine"]["cpu_model"] in markdown


def test_algorithms_quick_runs_every_row(tmp_path, benchmarks):
    from benchmarks.algorithms import SETUPS

    output = tmp_path / "algorithms-quick.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/algorithms.py", "--quick", "--jobs", "2", "--output", output],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert list(result["summary"]) == [setup.name for setup in SETUPS]
    assert sorted(run["setup"] for run in result["runs"]) == sorted(s.name for s in SETUPS)
    for row in result["summary"].values():
        assert row["command"].startswith("python benchmarks/algorithms.py --quick")
        assert row["date"] and row["machine"]["cores"] >= 1
        assert -1.5 <= row["mean"] <= 1.5 and 0.0 <= row["invalid_rate"] <= 1.0
    assert "### Algorithms on Blackjack" in benchmarks.table.render(tmp_path, quick=True)


def test_every_part_runs_in_quick_mode(tmp_path):
    """`python -m benchmarks all --quick` for our four parts (the original LlamaGym needs its
    own venv; the scripts are tested above): each writes its result, then the table."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks", "all", "--quick", "--skip-peer", "--only-ours",
         "--output-dir", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    for part in ("throughput", "breakdown", "scaling", "learning"):
        result = json.loads((tmp_path / f"{part}-quick.json").read_text())
        assert result["quick"] is True and result["command"].startswith(
            f"python -m benchmarks {part} --quick"
        ), part
    table = (tmp_path / "table-quick.md").read_text()
    assert "### Learning per wall-clock" in table and "### Scaling with model size" in table


def test_trl_overhead_quick_measures_both_backends(tmp_path):
    """`benchmarks/trl_overhead.py --quick`: the tiny model's same batches under the native
    and the TRL backend, each split into rollout and optimisation, and TRL's profile."""
    pytest.importorskip("trl")
    output = tmp_path / "trl-overhead-quick.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/trl_overhead.py", "--quick", "--output", output],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["quick"] is True
    assert result["command"].startswith("python benchmarks/trl_overhead.py --quick")
    assert result["machine"]["cores"] >= 1 and result["date"]
    assert list(result["models"]) == ["tiny"]
    runs = result["models"]["tiny"]["runs"]
    assert set(runs) == {"native", "trl"}
    for backend, run in runs.items():
        assert run["backend"] == backend and run["updates"] >= 2
        assert run["seconds_per_update"] > 0, backend
        assert run["split"]["rollout"] > 0 and "optimisation" in run["split"], backend
        assert run["command"].startswith("llamagym run blackjack --model tiny")
    assert ("--backend trl" in runs["trl"]["command"]) and (
        "--backend" not in runs["native"]["command"]
    )
    assert runs["trl"]["grpo_config"]["num_generations"] == 8
    assert result["models"]["tiny"]["ratio"]["seconds_per_update"] > 0
    profile = result["profile_tiny_trl"]
    assert profile["seconds"] > 0 and profile["top_cumulative"]
    assert "trl" in profile["own_seconds_by_package"]


def test_every_script_all_runs_exists_and_takes_quick(benchmarks):
    """`python -m benchmarks all` skips a script that is not there: each one it names is,
    and its --help (with the script's own arguments) lists --quick and --allow-dirty,
    which `all` passes on."""
    import benchmarks.__main__ as harness

    assert any(script[0] == "real_model.py" for script in harness.SCRIPTS)
    for name in sorted({script[0] for script in harness.SCRIPTS}):
        path = REPO / "benchmarks" / name
        assert path.is_file(), name
        shown = subprocess.run(
            [sys.executable, str(path), "--help"], cwd=REPO, capture_output=True, text=True,
            timeout=120, check=False,
        )
        assert shown.returncode == 0 and "--quick" in shown.stdout, (name, shown.stderr[-500:])
        assert "--allow-dirty" in shown.stdout, name


def test_real_model_runs_an_experiment_of_its_table_through_its_workers(tmp_path):
    """`real_model.py blackjack` with the tiny model: the experiment its table names
    trains a run as a user types it, and its two measurements (the zero-shot model, the
    final checkpoint valued exactly over Blackjack's 280 states) each answer from a fresh
    process of `real_model_workers.py`, into the result file the table names."""
    output = tmp_path / "result.json"
    completed = subprocess.run(
        [sys.executable, "benchmarks/real_model.py", "blackjack", "--model", "tiny", "--quick",
         "--episodes", "32", "--threads", "1", "--keep-runs", str(tmp_path / "runs"),
         "--output", str(output)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["command"].startswith("python benchmarks/real_model.py blackjack")
    (seed,) = result["seeds"]
    assert seed["updates"] >= 1 and seed["episodes"] >= 32
    for measured in (result["zero_shot"], seed):
        assert -1.0 <= measured["exact"] <= 1.0
        hit = measured["hit_probability"]["dealer 10"]
        assert set(hit) == {str(total) for total in range(4, 21)}
        assert all(0.0 <= p <= 1.0 for p in hit.values())
    assert len(seed["transcript_greedy"]) == 5
