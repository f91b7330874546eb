"""`llamagym run`, `eval` and `report` end to end on Blackjack with the tiny model: what
a run writes (config.yaml, metrics.jsonl with its documented fields, checkpoints, the
report), what it prints, and that W&B stays out unless asked for."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from llamagym.cli.app import app
from llamagym.cli.run_commands import resolve_run_config
from llamagym.training.records.report import EVALUATION_FIELDS, UPDATE_FIELDS
from llamagym.training.records.run_files import read_metrics

FAST = [
    "--num-envs", "4", "--threads", "1", "--episodes", "16", "--eval-episodes", "40",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1", "--set", "rollout.final_temperature=0.5",
]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, str]:
    """One real run (progress bar on), shared by the tests of this module."""
    import logging

    run_dir = tmp_path_factory.mktemp("runs") / "blackjack"
    root, package = logging.getLogger(), logging.getLogger("llamagym")
    handlers, level = list(root.handlers), package.level
    try:
        result = CliRunner().invoke(app, ["run", "blackjack", *FAST, "-o", str(run_dir)])
    finally:
        root.handlers[:] = handlers
        package.setLevel(level)
    assert result.exit_code == 0, (result.output, result.exception)
    return run_dir, result.output


def test_run_writes_config_metrics_checkpoint_and_report(finished_run) -> None:
    run_dir, output = finished_run
    assert "llamagym run blackjack: ppo on tiny (score mode, 4 envs), seed 0" in output
    assert "budget: 16 episodes (--episodes)" in output
    assert "update 2: return" in output and "steps/s" in output  # the live stats line
    assert "trained 16 episodes" in output and "2 updates" in output
    for name in ("trained agent", "basic-strategy", "random", "95% CI", "win / draw / loss"):
        assert name in output
    assert f"report: {run_dir / 'report.md'}" in output

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["agent"]["name"] == "blackjack"
    assert config["rollout"]["num_envs"] == 4
    assert config["algorithm"]["clip_range"] == 0.2  # the algorithm's defaults too
    assert "# Adam learning rate." in (run_dir / "config.yaml").read_text()
    checkpoint = run_dir / "checkpoints" / "update-000002"
    assert {p.name for p in checkpoint.iterdir()} >= {
        "weights.safetensors", "value_head.safetensors", "state.safetensors",
        "checkpoint.json", "config.yaml",
    }
    assert "trained agent" in (run_dir / "report.md").read_text()
    assert (run_dir / "learning_curve.png").stat().st_size > 10_000
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))


def test_metrics_lines_carry_the_documented_fields(finished_run) -> None:
    run_dir, _ = finished_run
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    updates = [r for r in records if r["kind"] == "update"]
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    assert [r["update"] for r in updates] == [1, 2] and len(evaluations) == 1
    for record in updates:
        assert set(UPDATE_FIELDS) <= set(record)
        assert all(isinstance(record[k], (int, float)) for k in UPDATE_FIELDS if k != "kind")
        assert "policy_loss" in record  # and the algorithm's own
    assert [r["total_episodes"] for r in updates] == [8, 16]
    assert [r["temperature"] for r in updates] == [1.0, 0.75]  # annealed over the budget
    evaluation = evaluations[0]
    assert set(EVALUATION_FIELDS) <= set(evaluation)
    assert evaluation["episodes"] == 40 and evaluation["greedy"] is True
    assert {b["name"] for b in evaluation["baselines"]} == {
        "random", "always-stick", "hit-below-17", "basic-strategy",
    }
    for baseline in evaluation["baselines"]:
        assert {"name", "episodes", "mean", "ci95", "outcomes"} <= set(baseline)


def test_written_config_reproduces_the_run(finished_run) -> None:
    run_dir, _ = finished_run
    _, again = resolve_run_config("blackjack", run_dir / "config.yaml", [], {})
    written = yaml.safe_load((run_dir / "config.yaml").read_text())
    # A native run's config.yaml leaves out the settings only the TRL backend reads.
    assert again.config.model_dump(mode="json", exclude={"trl"}) == written


def test_eval_command_matches_the_runs_final_evaluation(finished_run, cli) -> None:
    run_dir, _ = finished_run
    code, out, _ = cli("eval", "blackjack", "--checkpoint", run_dir, "--episodes", "40", "--json",)
    assert code == 0
    result = json.loads(out)
    final = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "evaluation"][0]
    # Same checkpoint, seeds and greedy actions: the same numbers.
    assert result["mean"] == final["mean"] and result["ci95"] == final["ci95"]
    assert [b["mean"] for b in result["baselines"]] == [b["mean"] for b in final["baselines"]]

    code, out, _ = cli("eval", "blackjack", "--checkpoint", run_dir, "-n", "8", "--sample")
    assert code == 0
    assert "8 episodes (sampled)" in out and "basic-strategy" in out
    assert "95% CI [" in out and "invalid replies" in out

    code, _, err = cli("eval", "cartpole", "--checkpoint", run_dir)
    assert code == 2 and "agent.name = 'blackjack'" in err


def test_eval_of_a_model_untrained_in_either_mode(finished_run, cli) -> None:
    run_dir, _ = finished_run
    code, out, _ = cli(
        "eval", "blackjack", "--model", "tiny", "-n", "12", "--mode", "generate", "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert (result["model"], result["mode"], result["episodes"]) == ("tiny", "generate", 12)
    assert "checkpoint" not in result and len(result["baselines"]) == 4

    code, out, _ = cli("eval", "blackjack", "--model", "tiny", "-n", "12")
    assert code == 0
    assert "model tiny untrained (zero-shot), score mode" in out
    assert "untrained model" in out and "trained agent" not in out

    code, _, err = cli("eval", "blackjack", "--model", "tiny", "--checkpoint", run_dir)
    assert code == 2 and "not both" in err
    code, _, err = cli("eval", "blackjack")
    assert code == 2 and "--model NAME" in err and "--checkpoint RUN_DIR" in err


def test_report_command_and_a_second_run_into_the_same_directory(finished_run, cli) -> None:
    run_dir, _ = finished_run
    (run_dir / "report.md").unlink()
    code, out, _ = cli("report", run_dir)
    assert code == 0 and (run_dir / "report.md").is_file()

    code, _, err = cli("run", "blackjack", *FAST, "-o", run_dir)
    assert code == 2 and "already holds a run" in err and "--resume" in err


def test_resuming_a_run_that_used_its_budget_says_how_to_go_on(finished_run, cli) -> None:
    run_dir, _ = finished_run
    files = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 2 and "has used its budget (16 of 16 episodes)" in err
    assert "--episodes 32" in err and f"llamagym eval blackjack --checkpoint {run_dir}" in err
    assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")} == files


class FakeWandbRun:
    def __init__(self, calls: list):
        self.calls = calls

    def log(self, metrics, step):
        self.calls.append(("log", step, dict(metrics)))

    def finish(self):
        self.calls.append(("finish",))


def test_wandb_logs_only_when_its_project_is_set(tmp_path, monkeypatch) -> None:
    from llamagym.config import RunConfig
    from llamagym.plugin_runtime.registry import RunContext
    from llamagym_builtins.loggers import WandbLogger

    calls: list = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(("init", kwargs)) or FakeWandbRun(calls)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    agent = types.SimpleNamespace(config=RunConfig())
    run = RunContext(tmp_path)
    logger = WandbLogger()

    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    logger.llamagym_update_end(agent=agent, update=1, metrics={"return_mean": 0.5}, run=run)
    assert calls == []

    monkeypatch.setenv("WANDB_PROJECT", "blackjack-runs")
    logger.llamagym_update_end(agent=agent, update=2, metrics={"return_mean": 0.25}, run=run)
    # An update with transcripts also logs them as a table.
    fake.Table = lambda columns, data: ("table", tuple(columns), data)
    record = {"kind": "training", "update": 3, "seed": 7, "return": 1.0, "system": "s",
              "turns": [{"observation": "o", "action": "hit", "reward": 1.0}]}
    (tmp_path / "transcripts.jsonl").write_text(json.dumps(record) + "\n")
    logger.llamagym_update_end(agent=agent, update=3, metrics={"return_mean": 1.0}, run=run)
    logger.close()
    assert calls[0][0] == "init" and calls[0][1]["project"] == "blackjack-runs"
    assert calls[1] == ("log", 2, {"return_mean": 0.25}) and calls[3] == ("finish",)
    name, step, logged = calls[2]
    assert (name, step, logged["return_mean"]) == ("log", 3, 1.0)
    kind, columns, data = logged["transcripts"]
    assert columns[-1] == "transcript" and data[0][2] == 7 and "action: hit" in data[0][-1]


@pytest.mark.slow  # a whole run in a fresh process
def test_wandb_is_never_imported_without_wandb_project(tmp_path) -> None:
    """A whole run in a fresh process: every logger plugin loaded, ``wandb`` untouched.
    A fake ``wandb`` first on the path fails loudly if anything imports it."""
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text("raise RuntimeError('wandb was imported')\n")
    run_dir = tmp_path / "run"
    script = textwrap.dedent(
        f"""
        import sys
        from llamagym.plugin_runtime.manager import get_plugins
        from llamagym.testing import tiny_agent
        from llamagym.training.loop.trainer import Trainer

        assert "wandb-logger" in {{i.name for i in get_plugins().plugin_infos()}}
        agent = tiny_agent(
            training={{"episodes": 8, "threads": 1}},
            rollout={{"num_envs": 4}},
            algorithm={{"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1}},
            output={{"dir": {str(run_dir)!r}, "quiet": True}},
        )
        Trainer(agent, agent.session).run()
        print("wandb" in sys.modules)
        """
    )
    environment = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(fake), *filter(None, [environment.get("PYTHONPATH")])]
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert len(read_metrics(run_dir / "metrics.jsonl")) == 1  # the other loggers did run
