"""The report made from a run's metrics.jsonl: report.md and learning_curve.png."""

from __future__ import annotations

import json
import math
import sys

import pytest
from PIL import Image

from llamagym.cli import main
from llamagym.training.records import report
from llamagym.training.records.report import records_until, write_report
from llamagym.training.records.run_files import read_metrics

BASELINES = [
    {"name": "random", "episodes": 400, "mean": -0.40, "ci95": 0.09, "invalid_rate": 0.0,
     "outcomes": {"win": 0.28, "draw": 0.04, "loss": 0.68}},
    {"name": "basic-strategy", "episodes": 400, "mean": -0.05, "ci95": 0.09,
     "invalid_rate": 0.0, "outcomes": {"win": 0.43, "draw": 0.09, "loss": 0.48}},
]
CONFIG = {
    "agent": {"name": "blackjack"},
    "algorithm": {"name": "ppo", "lr": 0.002},
    "model": {"name": "tiny"},
    "rollout": {"mode": "score", "num_envs": 16},
    "training": {"episodes": 3000, "minutes": None, "seed": 3},
    "output": {"dir": "/somewhere"},
}


def synthetic_records(updates: int = 30) -> list[dict]:
    records = []
    for k in range(1, updates + 1):
        trend = -0.4 + 0.35 * (1 - math.exp(-k / 8))
        records.append({
            "kind": "update", "update": k, "total_episodes": 100 * k, "env_steps": 140 * k,
            "seconds": 9.5 * k, "return_mean": trend + 0.1 * math.sin(k),
            "return_moving_average": trend, "invalid_rate": 0.0, "episode_length": 1.4,
            "env_steps_per_second": 15.0, "env_failures": 0, "policy_loss": -0.01,
        })
    records.append({
        "kind": "evaluation", "update": updates, "total_episodes": 100 * updates,
        "seconds": 12.0, "greedy": True, "name": "agent", "episodes": 400, "mean": -0.08,
        "ci95": 0.09, "invalid_rate": 0.0, "outcomes": {"win": 0.41, "draw": 0.1, "loss": 0.49},
        "baselines": BASELINES,
    })
    return records


def test_report_and_learning_curve(tmp_path) -> None:
    files = write_report(tmp_path, synthetic_records(), CONFIG)
    text = files.markdown.read_text()
    assert "# blackjack: ppo on tiny" in text
    assert "| **trained agent** | -0.080 | ±0.090 [-0.170, +0.010] | 41.0% / 10.0% / 49.0%" in text
    assert "| basic-strategy | -0.050 |" in text and "| random | -0.400 |" in text
    # Wall time: 30 updates x 9.5 s of training plus 12 s of evaluation.
    assert "Wall time 5.0 min (training 4.8 min, evaluation 12 s)" in text
    assert "Against the best baseline, basic-strategy: -0.030 (within the confidence" in text
    assert "Clearly above: random." in text
    assert f"Digest `{report.config_digest(CONFIG)}`" in text
    assert "| algorithm.lr | `0.002` |" in text  # differs from PPO's default
    assert "![Return during training](learning_curve.png)" in text

    png = files.curve
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        width, height = image.size
        assert image.format == "PNG"
        assert 1000 <= width <= 2500 and 400 <= height <= 1200 and width > height
        colours = image.convert("RGB").getcolors(maxcolors=1_000_000)
        assert colours is not None and len(colours) > 50  # lines and text, not a blank


def test_digest_ignores_the_output_directory() -> None:
    moved = json.loads(json.dumps(CONFIG))
    moved["output"]["dir"] = "/elsewhere"
    assert report.config_digest(moved) == report.config_digest(CONFIG)
    moved["algorithm"]["lr"] = 0.001
    assert report.config_digest(moved) != report.config_digest(CONFIG)


def test_report_without_evaluation_or_matplotlib(tmp_path, monkeypatch) -> None:
    def no_matplotlib(*args, **kwargs):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plot_learning_curve", no_matplotlib)
    records = [r for r in synthetic_records(3) if r["kind"] == "update"]
    files = write_report(tmp_path, records, CONFIG)
    assert files.curve is None and not (tmp_path / "learning_curve.png").exists()
    text = files.markdown.read_text()
    assert "None recorded" in text and "llamagym eval AGENT --checkpoint" in text
    assert "learning_curve.png)" not in text


def test_torn_last_line_is_skipped_and_resume_truncates(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps(r) for r in synthetic_records(4)]
    path.write_text("\n".join(lines[:-1]) + '\n{"kind": "upd')  # crash mid-line
    records = read_metrics(path)
    assert [r["update"] for r in records] == [1, 2, 3, 4]
    # Resuming from update 2 keeps its lines and none written after it.
    assert [r["update"] for r in records_until(records, 2)] == [1, 2]
    # An evaluation made at the end of update 4 belongs after it.
    assert records_until(synthetic_records(4), 4)[-1]["kind"] == "update"


def test_report_command_regenerates_from_files(tmp_path, monkeypatch, capsys) -> None:
    import yaml

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in synthetic_records(5))
    )
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    monkeypatch.setattr(sys, "argv", ["llamagym", "report", str(tmp_path)])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code in (0, None)
    out = capsys.readouterr().out
    assert f"report: {tmp_path / 'report.md'}" in out
    assert (tmp_path / "learning_curve.png").stat().st_size > 10_000
    assert "basic-strategy" in (tmp_path / "report.md").read_text()

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(sys, "argv", ["llamagym", "report", str(empty)])
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err
