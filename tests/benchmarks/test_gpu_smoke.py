"""`benchmarks/gpu_smoke.py` on a machine without a GPU: its plan names all seven paths,
a run says there is no GPU and writes nothing, and every planned command is one the real
command line accepts (flags, `--set` keys and values, the TRL backend's batch rule for
the planned number of processes, accelerate's launcher options). Nothing trains and no
model loads."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer

from benchmarks import gpu_smoke
from llamagym.cli.app import app
from llamagym.cli.run_commands import resolve_run_config

pytestmark = pytest.mark.slow  # the benchmark's planned commands, each through the CLI

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_smoke.py"
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
NAMES = [
    "native-1",
    "native-n",
    "trl-1",
    "trl-vllm-colocate",
    "trl-zero2",
    "trl-zero3",
    "trl-fsdp2",
]
#: `llamagym run` options that `llamagym config show` takes as they are, and their settings.
SHOWN_OPTIONS = {
    "model": ("--model", "model.name"),
    "algorithm": ("--algorithm", "algorithm.name"),
    "mode": ("--mode", "rollout.mode"),
}
#: `llamagym run` options that `config show` lacks, as the settings they set.
RUN_ONLY_SETTINGS = {
    "episodes": "training.episodes",
    "eval_episodes": "training.eval_episodes",
    "num_envs": "rollout.num_envs",
    "seed": "training.seed",
    "checkpoint_every": "output.checkpoint_every",
    "quiet": "output.quiet",
    "output": "output.dir",
}


def script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=NO_GPU,
    )


def plan(*args: str) -> dict[str, Any]:
    done = script("--plan", *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def unavailable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def test_the_plan_lists_all_seven_paths_and_why_each_is_skipped() -> None:
    here = plan()  # this machine: no GPU
    assert here["gpus"] == 0
    assert [path["name"] for path in here["paths"]] == NAMES
    for path in here["paths"]:
        assert path["run"] is False and "no CUDA GPU" in path["skip_reason"]
        assert path["command"][1:4] in (
            ["-m", "llamagym.cli", "run"],
            ["-m", "accelerate.commands.launch", "--config_file"],
        )

    one = {path["name"]: path for path in plan("--gpus", "1")["paths"]}
    for name in ("native-n", "trl-zero2", "trl-zero3", "trl-fsdp2"):
        assert "at least 2" in one[name]["skip_reason"], one[name]
    assert one["native-1"]["run"] is True and one["native-1"]["processes"] == 1

    eight = {path["name"]: path for path in plan("--gpus", "8")["paths"]}
    assert eight["native-1"]["run"] and eight["trl-fsdp2"]["run"] == (not unavailable("trl"))
    assert [eight[name]["processes"] for name in NAMES] == [1, 8, 1, 1, 8, 8, 8]
    assert ("import vllm failed" in (eight["trl-vllm-colocate"]["skip_reason"] or "")) == (
        unavailable("vllm")
    )
    for name in ("trl-zero2", "trl-zero3"):
        assert ("import deepspeed failed" in (eight[name]["skip_reason"] or "")) == (
            unavailable("deepspeed")
        )
    fsdp2 = eight["trl-fsdp2"]["command"]
    assert fsdp2[fsdp2.index("--config_file") + 1].endswith("docs/accelerate/fsdp2.yaml")
    assert fsdp2[fsdp2.index("--num_processes") + 1] == "8"


def test_without_a_gpu_a_run_says_so_and_writes_nothing(tmp_path) -> None:
    output, work = tmp_path / "smoke.json", tmp_path / "work"
    done = script("--output", str(output), "--work-dir", str(work))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and "no CUDA GPU" in done.stdout
    assert not output.exists() and not work.exists()


def run_parameters(words: list[str]) -> dict[str, Any]:
    """``llamagym run ...``'s words parsed by the real command's parser (an unknown flag,
    a missing value or a bad type raises), without running it."""
    assert words[0] == "run", words
    command = typer.main.get_command(app)
    run = command.commands["run"]  # type: ignore[attr-defined]
    with run.make_context("run", list(words[1:])) as context:
        return dict(context.params)


def llamagym_words(command: list[str]) -> list[str]:
    """The ``llamagym`` arguments of a planned command; a launcher's own options are
    parsed by accelerate's parser on the way."""
    if command[1:3] == ["-m", "accelerate.commands.launch"]:
        from accelerate.commands.launch import launch_command_parser

        launcher = launch_command_parser().parse_args(command[3:])
        assert Path(launcher.config_file).is_file(), launcher.config_file
        assert launcher.module and launcher.training_script == "llamagym.cli"
        return list(launcher.training_script_args)
    assert command[1:3] == ["-m", "llamagym.cli"], command
    return command[3:]


@pytest.mark.parametrize("gpus", [2, 8])
def test_every_planned_command_is_accepted_by_the_cli(gpus, tmp_path, cli) -> None:
    from llamagym.trl_backend.settings import check_supported

    for path in plan("--gpus", str(gpus), "--work-dir", str(tmp_path))["paths"]:
        params = run_parameters(llamagym_words(path["command"]))
        shown = ["config", "show", params.pop("agent")]
        assignments = list(params.pop("assignments"))
        processes = params.pop("num_processes") or 1
        backend = params.pop("backend")
        if backend is not None:
            shown += ["--backend", backend]
        flags = {"training.backend": backend}
        for name, value in params.items():
            if value in (None, False):
                continue
            if name in SHOWN_OPTIONS:
                option, setting = SHOWN_OPTIONS[name]
                shown += [option, str(value)]
                flags[setting] = value
            else:
                assert name in RUN_ONLY_SETTINGS, f"{path['name']}: --{name} is not checked here"
                assignments.append(f"{RUN_ONLY_SETTINGS[name]}={str(value).lower()}")
        for assignment in assignments:
            shown += ["--set", assignment]
        code, out, err = cli(*shown)
        if "trl.use_vllm=true" in assignments and importlib.util.find_spec("vllm") is None:
            # The GPU machine has vLLM; this one refuses the setting up front, in one line.
            assert code == 2 and "vLLM is not installed here" in err, err
            continue
        assert code == 0, f"{path['name']}: {' '.join(shown)}\n{err}"
        assert "algorithm:\n" in out
        if backend == "trl":  # what `llamagym run` checks before it launches or loads
            _, resolved = resolve_run_config("blackjack", None, assignments, flags)
            processes = max(processes, path["processes"])  # under accelerate launch
            check_supported(resolved, processes)


def test_the_batch_rule_is_what_the_commands_are_checked_against() -> None:
    """A plan that broke the TRL backend's batch rule would fail the test above."""
    from llamagym.errors import ConfigError
    from llamagym.trl_backend.settings import check_supported

    settings = gpu_smoke.Settings(model="tiny")
    fsdp2 = next(path for path in gpu_smoke.PATHS if path.name == "trl-fsdp2")
    words = gpu_smoke.run_arguments(settings, fsdp2, 8, Path("run"))
    assignments = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    flags = {"training.backend": "trl", "algorithm.name": "grpo", "rollout.mode": "generate"}
    _, resolved = resolve_run_config("blackjack", None, assignments, flags)
    check_supported(resolved, 8)
    with pytest.raises(ConfigError, match="multiple of algorithm.minibatch_size x processes"):
        check_supported(resolved, 3)
