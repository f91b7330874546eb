"""The first thing to run on a new GPU machine: every way to scale a run out, for a few
updates each, with a small real model.

    python benchmarks/gpu_smoke.py                      # all paths, a few minutes
    python benchmarks/gpu_smoke.py --plan               # the commands, run or skipped, as JSON
    python benchmarks/gpu_smoke.py --model smollm2-135m --updates 5 --work-dir /scratch/smoke

The paths, each ``llamagym run blackjack --algorithm grpo --mode generate`` with the same
small budget:

1. ``native-1``: the native backend in one process;
2. ``native-n``: the native backend in N processes (``--num-processes N``, N = GPUs);
3. ``trl-1``: the TRL backend in one process (``--backend trl``);
4. ``trl-vllm-colocate``: the TRL backend generating with vLLM in the training process
   (``--set trl.use_vllm=true --set trl.vllm_mode=colocate``);
5. ``trl-zero2``, 6. ``trl-zero3``, 7. ``trl-fsdp2``: the TRL backend under
   ``accelerate launch --config_file docs/accelerate/{zero2,zero3,fsdp2}.yaml
   --num_processes N``.

A path is skipped, with the reason, when the machine cannot run it: fewer than two GPUs
for the multi-process paths, ``import vllm`` failing for 4, ``import deepspeed`` failing
for 5 and 6, ``import trl`` failing for 3 to 7. Every path runs as its own subprocess
(its process group is stopped after ``--timeout`` seconds: a hang is a result too) in
its own run directory, and records its status (passed, failed, skipped, timed out),
wall seconds, the last lines of stderr when it did not pass, the updates and the last
``return_mean`` in its ``metrics.jsonl``, and whether ``RUN/model`` (the trained model;
a native run is exported there with ``llamagym export`` first) loads with plain
``transformers.AutoModelForCausalLM.from_pretrained``, in a subprocess of its own.

Every process of a path trains ``--episodes-per-update`` episodes per update (groups of
4 episodes from one seed, minibatches of 4), so N processes train N times the episodes
of one, under both backends. The result goes to ``benchmarks/results/gpu-smoke.json``
(``gpu-smoke-quick.json`` with ``--quick``, or ``--output``); the exit code is 1 when a
path failed, timed out or left a model that does not load. Without a CUDA GPU nothing
runs and nothing is written (exit code 0), except ``--plan``, which writes nothing
either and prints every path's command as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/gpu_smoke.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_allow_dirty,
    log,
    refuse_dirty_tree,
    write_script_result,
)

NAME = "gpu-smoke"
DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
ACCELERATE_CONFIGS = REPO_ROOT / "docs" / "accelerate"
#: Episodes sharing a start seed, and episodes (TRL) or turns (native) per gradient step.
GROUP_SIZE = 4
MINIBATCH_SIZE = 4
#: Full and --quick budgets.
FULL = {"updates": 3, "episodes_per_update": 8, "eval_episodes": 16}
QUICK = {"updates": 2, "episodes_per_update": 8, "eval_episodes": 4}
DEFAULT_TIMEOUT_SECONDS = 900.0
#: Seconds for an import probe, an export or a model load; and for the model's download.
PROBE_TIMEOUT_SECONDS = 300.0
DOWNLOAD_TIMEOUT_SECONDS = 1800.0
STDERR_TAIL_LINES = 25
#: The work directory --plan shows without --work-dir (a run makes a temporary one).
PLACEHOLDER_WORK_DIR = Path("<temporary directory>")


@dataclass(frozen=True)
class SmokePath:
    """One way to run: its name, what it shows, and what it needs."""

    name: str
    description: str
    backend: str  # native or trl
    multi_process: bool  # one process per GPU (N), else one
    accelerate_config: str | None = None  # a file of docs/accelerate/, under accelerate launch
    extra_sets: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # modules that must import


PATHS: tuple[SmokePath, ...] = (
    SmokePath("native-1", "native backend, 1 process", "native", False),
    SmokePath("native-n", "native backend, N processes (--num-processes)", "native", True),
    SmokePath("trl-1", "TRL backend, 1 process", "trl", False, needs=("trl",)),
    SmokePath(
        "trl-vllm-colocate",
        "TRL backend, 1 process, vLLM colocated",
        "trl",
        False,
        extra_sets=("trl.use_vllm=true", "trl.vllm_mode=colocate"),
        needs=("trl", "vllm"),
    ),
    SmokePath(
        "trl-zero2",
        "TRL backend, accelerate launch, DeepSpeed ZeRO-2, N processes",
        "trl",
        True,
        accelerate_config="zero2.yaml",
        needs=("trl", "deepspeed"),
    ),
    SmokePath(
        "trl-zero3",
        "TRL backend, accelerate launch, DeepSpeed ZeRO-3, N processes",
        "trl",
        True,
        accelerate_config="zero3.yaml",
        needs=("trl", "deepspeed"),
    ),
    SmokePath(
        "trl-fsdp2",
        "TRL backend, accelerate launch, FSDP2, N processes",
        "trl",
        True,
        accelerate_config="fsdp2.yaml",
        needs=("trl",),
    ),
)


@dataclass(frozen=True)
class Settings:
    """What every path trains: the same agent, model and budget per process."""

    model: str = DEFAULT_MODEL
    updates: int = FULL["updates"]
    episodes_per_update: int = FULL["episodes_per_update"]  # per process
    eval_episodes: int = FULL["eval_episodes"]
    num_envs: int = 8
    seed: int = 0
    mixed_precision: str | None = None  # accelerate launch's; None: the config file's


# -- the commands (pure) ------------------------------------------------------------------
def processes_of(path: SmokePath, gpus: int) -> int:
    """Processes a path runs: one per GPU for a multi-process path (at least 2, the
    smallest such run, when the plan is for fewer GPUs), else one."""
    return max(gpus, 2) if path.multi_process else 1


def run_arguments(settings: Settings, path: SmokePath, processes: int, run_dir: Path) -> list[str]:
    """The ``llamagym run`` arguments of ``path`` in ``processes`` processes.

    Every process trains ``settings.episodes_per_update`` episodes per update. The native
    backend counts ``algorithm.episodes_per_update`` per process, the TRL backend over
    all processes together (TRL's ``generation_batch_size``); both count the episode
    budget over all processes."""
    per_update = settings.episodes_per_update * (processes if path.backend == "trl" else 1)
    episodes = settings.updates * settings.episodes_per_update * processes
    arguments = [
        "blackjack",
        *("--model", settings.model, "--algorithm", "grpo", "--mode", "generate"),
        *("--episodes", str(episodes), "--eval-episodes", str(settings.eval_episodes)),
        *("--num-envs", str(settings.num_envs), "--seed", str(settings.seed)),
        *("--checkpoint-every", "0", "--quiet", "--output", str(run_dir)),
    ]
    if path.backend == "trl":
        arguments += ["--backend", "trl"]
    if path.multi_process and path.accelerate_config is None:
        arguments += ["--num-processes", str(processes)]
    assignments = (
        f"algorithm.group_size={GROUP_SIZE}",
        f"algorithm.minibatch_size={MINIBATCH_SIZE}",
        f"algorithm.microbatch_size={MINIBATCH_SIZE}",
        f"algorithm.episodes_per_update={per_update}",
        *path.extra_sets,
    )
    for assignment in assignments:
        arguments += ["--set", assignment]
    return arguments


def command_of(
    settings: Settings, path: SmokePath, processes: int, run_dir: Path, python: str = sys.executable
) -> list[str]:
    """The whole command line of ``path``: ``llamagym run ...``, under ``accelerate
    launch`` for a path with an accelerate config file."""
    run = ["-m", "llamagym.cli", "run", *run_arguments(settings, path, processes, run_dir)]
    if path.accelerate_config is None:
        return [python, *run]
    launcher = [
        *(python, "-m", "accelerate.commands.launch"),
        *("--config_file", str(ACCELERATE_CONFIGS / path.accelerate_config)),
        *("--num_processes", str(processes), "--num_machines", "1"),
        # A free port of the launcher's choosing: a path that timed out never blocks the next.
        *("--main_process_port", "0"),
    ]
    if settings.mixed_precision is not None:
        launcher += ["--mixed_precision", settings.mixed_precision]
    return [*launcher, *run]


def skip_reason(path: SmokePath, gpus: int, missing: Mapping[str, str]) -> str | None:
    """Why ``path`` cannot run on a machine with ``gpus`` GPUs and the modules in
    ``missing`` (module -> why it does not import), or None."""
    reasons = []
    if gpus == 0:
        reasons.append("no CUDA GPU")
    elif path.multi_process and gpus < 2:
        reasons.append(f"{gpus} GPU: one process per GPU needs at least 2")
    for module in path.needs:
        if module in missing:
            reasons.append(f"import {module} failed: {missing[module]}")
    return "; ".join(reasons) or None


def build_plan(
    settings: Settings,
    gpus: int,
    missing: Mapping[str, str],
    work_dir: Path,
    python: str = sys.executable,
) -> list[dict[str, Any]]:
    """Every path with its processes, run directory, command and skip reason."""
    plan = []
    for path in PATHS:
        processes = processes_of(path, gpus)
        run_dir = work_dir / path.name
        command = command_of(settings, path, processes, run_dir, python)
        reason = skip_reason(path, gpus, missing)
        plan.append(
            {
                "name": path.name,
                "description": path.description,
                "backend": path.backend,
                "processes": processes,
                "run_dir": str(run_dir),
                "command": command,
                "shell": shlex.join(command),
                "run": reason is None,
                "skip_reason": reason,
            }
        )
    return plan


# -- the machine ----------------------------------------------------------------------------
def child_environment() -> dict[str, str]:
    """The environment of every subprocess: this one's (the model may need the Hub),
    without progress bars or loggers that call out."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_MODE": "disabled",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def python_probe(code: str, *arguments: str, timeout: float = PROBE_TIMEOUT_SECONDS):
    """Run ``python -c CODE ARGUMENTS``: (exit code or None after a timeout, stdout,
    stderr)."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *arguments],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=child_environment(),
            cwd=REPO_ROOT,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout, done.stderr


GPU_PROBE = """
import json, torch
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({
    "count": count,
    "names": [torch.cuda.get_device_name(i) for i in range(count)],
    "memory_gb": [round(torch.cuda.get_device_properties(i).total_memory / 1024**3, 1)
                  for i in range(count)],
    "torch_cuda": torch.version.cuda,
}))
"""


def detect_gpus() -> dict[str, Any]:
    """The CUDA GPUs torch sees, probed in a subprocess (this process never holds a CUDA
    context the paths' processes could use)."""
    code, out, err = python_probe(GPU_PROBE)
    if code != 0:
        return {"count": 0, "names": [], "error": last_line(err)}
    return json.loads(out.strip().splitlines()[-1])


def missing_modules(modules: Sequence[str]) -> dict[str, str]:
    """Each of ``modules`` whose ``import`` fails, with the error's last line."""
    missing = {}
    for module in modules:
        code, _, err = python_probe(f"import {module}")
        if code != 0:
            missing[module] = last_line(err)
    return missing


def package_versions() -> dict[str, str | None]:
    import importlib.metadata

    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "accelerate", "trl", "peft", "deepspeed", "vllm"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


# -- running a path ------------------------------------------------------------------------
def stop_group(process: subprocess.Popen) -> None:
    """Stop a process and everything it started (its own session): TERM, then KILL."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_logged(command: Sequence[str], log_base: Path, timeout: float) -> dict[str, Any]:
    """Run ``command`` in a session of its own, stdout and stderr to ``log_base``.out and
    .err; exit code (None after a timeout), wall seconds and stderr's last lines."""
    out_path, err_path = log_base.with_suffix(".out"), log_base.with_suffix(".err")
    started = time.perf_counter()
    with out_path.open("w") as out, err_path.open("w") as err:
        process = subprocess.Popen(
            list(command),
            stdout=out,
            stderr=err,
            cwd=REPO_ROOT,
            env=child_environment(),
            start_new_session=True,
        )
        try:
            code: int | None = process.wait(timeout)
        except subprocess.TimeoutExpired:
            stop_group(process)
            code = None
    wall = time.perf_counter() - started
    lines = err_path.read_text(errors="replace").rstrip().splitlines()
    return {"exit_code": code, "wall_seconds": round(wall, 1), "tail": lines[-STDERR_TAIL_LINES:]}


def metrics_summary(run_dir: Path) -> dict[str, Any]:
    """Updates, the last ``return_mean`` and the final evaluation's mean in
    ``run_dir/metrics.jsonl`` (what is there: a failed run may have written some)."""
    path = run_dir / "metrics.jsonl"
    records = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    updates = [r for r in records if r.get("kind") == "update"]
    evaluations = [r for r in records if r.get("kind") == "evaluation"]
    return {
        "updates": len(updates),
        "last_return_mean": updates[-1].get("return_mean") if updates else None,
        "total_episodes": updates[-1].get("total_episodes") if updates else None,
        "evaluation_mean": evaluations[-1].get("mean") if evaluations else None,
    }


LOAD_PROBE = """
import sys
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__, sum(p.numel() for p in model.parameters()))
"""


def check_model(run_dir: Path, backend: str, log_base: Path) -> dict[str, Any]:
    """Whether ``run_dir/model`` loads with plain transformers; a native run, which keeps
    checkpoints of its own, is exported there first (``llamagym export``)."""
    model_dir = run_dir / "model"
    result: dict[str, Any] = {"model_dir": str(model_dir)}
    if backend == "native" and not model_dir.exists():
        export = [sys.executable, "-m", "llamagym.cli", "export", str(run_dir)]
        done = run_logged(
            [*export, "--to", str(model_dir)],
            log_base.with_name(log_base.name + "-export"),
            PROBE_TIMEOUT_SECONDS,
        )
        result["export"] = "passed" if done["exit_code"] == 0 else "failed"
        if done["exit_code"] != 0:
            result.update(model_loads=False, model_error="\n".join(done["tail"]))
            return result
    if not model_dir.is_dir():
        return {**result, "model_loads": False, "model_error": f"no {model_dir}"}
    code, out, err = python_probe(LOAD_PROBE, str(model_dir))
    if code == 0:
        return {**result, "model_loads": True, "model_loaded": last_line(out)}
    return {**result, "model_loads": False, "model_error": last_line(err)}


def run_path(entry: Mapping[str, Any], settings: Settings, logs: Path, timeout: float) -> dict:
    """Run one planned path; its record for the result file."""
    record: dict[str, Any] = {
        key: entry[key] for key in ("name", "description", "backend", "processes", "shell")
    }
    record["command"] = record.pop("shell")
    if not entry["run"]:
        return {**record, "status": "skipped", "reason": entry["skip_reason"]}
    run_dir = Path(entry["run_dir"])
    done = run_logged(entry["command"], logs / entry["name"], timeout)
    metrics = metrics_summary(run_dir)
    record.update(wall_seconds=done["wall_seconds"], **metrics)
    record["expected_updates"] = settings.updates
    if done["exit_code"] is None:
        record.update(status="timed out", reason=f"timed out after {timeout:.0f} s")
    elif done["exit_code"] != 0:
        record.update(status="failed", reason=f"exit code {done['exit_code']}")
    elif metrics["updates"] == 0:
        record.update(status="failed", reason="exit code 0, but no update in metrics.jsonl")
    else:
        record["status"] = "passed"
    if record["status"] != "passed":
        record["stderr_tail"] = done["tail"]
        return record
    record.update(check_model(run_dir, entry["backend"], logs / entry["name"]))
    return record


def prefetch_model(model: str) -> dict[str, Any]:
    """Download the model once before the paths (so no path's time or timeout includes
    the download): a registry name is looked up, a local directory or ``tiny`` is used
    as it is."""
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "name = sys.argv[1]\n"
        "if name == 'tiny' or Path(name).exists():\n"
        "    print(name)\n"
        "    raise SystemExit(0)\n"
        "from llamagym.models.registry import get_model_entry\n"
        "entry = get_model_entry(name)\n"
        "hub_id = entry.hub_id if entry is not None and entry.hub_id else name\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "AutoTokenizer.from_pretrained(hub_id)\n"
        "AutoModelForCausalLM.from_pretrained(hub_id)\n"
        "print(hub_id)\n"
    )
    started = time.perf_counter()
    exit_code, out, err = python_probe(code, model, timeout=DOWNLOAD_TIMEOUT_SECONDS)
    seconds = round(time.perf_counter() - started, 1)
    if exit_code == 0:
        return {"status": "passed", "seconds": seconds, "source": last_line(out)}
    return {"status": "failed", "seconds": seconds, "error": last_line(err)}


# -- the command line -----------------------------------------------------------------------
def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def whole_groups(text: str) -> int:
    value = positive(text)
    if value % GROUP_SIZE or value % MINIBATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"must be a multiple of the group size {GROUP_SIZE} and the minibatch size "
            f"{MINIBATCH_SIZE}, got {value}"
        )
    return value


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"default: {DEFAULT_MODEL}")
    parser.add_argument("--quick", action="store_true", help="fewer updates and eval episodes")
    parser.add_argument(
        "--updates", type=positive, default=None, help="updates per path (default: 3; --quick 2)"
    )
    parser.add_argument(
        "--episodes-per-update",
        type=whole_groups,
        default=None,
        help="episodes per update of each process (default: 8; a multiple of 4)",
    )
    parser.add_argument(
        "--eval-episodes",
        type=int,
        default=None,
        help="final greedy evaluation episodes per path (default: 16; --quick 4; 0: none)",
    )
    parser.add_argument(
        "--gpus",
        type=positive,
        default=None,
        help="processes of the multi-process paths (default: every GPU torch sees; with "
        "--plan, any number on any machine)",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("no", "fp16", "bf16"),
        default=None,
        help="accelerate launch's --mixed_precision for paths 5-7 (default: the config "
        "file's, bf16)",
    )
    parser.add_argument(
        "--only", nargs="+", choices=[path.name for path in PATHS], help="run these paths only"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        help=f"seconds per path before it is stopped (default: {DEFAULT_TIMEOUT_SECONDS:.0f})",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="where the paths' run directories and logs go, kept (new or empty; default: "
        "a temporary directory, removed at the end)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help="the result file (default: benchmarks/results/gpu-smoke.json)",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print every path's command and whether it would run, as JSON; run nothing",
    )
    add_allow_dirty(parser)
    return parser.parse_args(argv)


def settings_of(args: argparse.Namespace) -> Settings:
    budget = QUICK if args.quick else FULL
    return Settings(
        model=args.model,
        updates=args.updates or budget["updates"],
        episodes_per_update=args.episodes_per_update or budget["episodes_per_update"],
        eval_episodes=budget["eval_episodes"] if args.eval_episodes is None else args.eval_episodes,
        mixed_precision=args.mixed_precision,
    )


def select(plan: list[dict[str, Any]], only: Sequence[str] | None) -> list[dict[str, Any]]:
    """``--only``: the other paths are skipped, and say so."""
    if not only:
        return plan
    return [
        entry
        if entry["name"] in only
        else {**entry, "run": False, "skip_reason": "not selected (--only)"}
        for entry in plan
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_arguments(argv)
    settings = settings_of(args)
    gpu_info = detect_gpus()
    detected = int(gpu_info["count"])
    if not args.plan and detected == 0:
        why = f" ({gpu_info['error']})" if gpu_info.get("error") else ""
        print(f"gpu_smoke: no CUDA GPU on this machine{why}; nothing run, nothing written")
        return 0
    if not args.plan and args.gpus is not None and args.gpus > detected:
        print(f"gpu_smoke: --gpus {args.gpus}, but torch sees {detected} GPU(s)", file=sys.stderr)
        return 2
    gpus = args.gpus if args.gpus is not None else detected
    missing = missing_modules(("trl", "vllm", "deepspeed"))
    if args.plan:
        work_dir = args.work_dir or PLACEHOLDER_WORK_DIR
        plan = select(build_plan(settings, gpus, missing, work_dir), args.only)
        print(
            json.dumps(
                {
                    "gpus": gpus,
                    "detected_gpus": gpu_info,
                    "settings": asdict(settings),
                    "paths": plan,
                },
                indent=2,
            )
        )
        return 0

    refuse_dirty_tree(NAME, args.quick, args.allow_dirty)
    if args.work_dir is not None:
        if args.work_dir.exists() and any(args.work_dir.iterdir()):
            print(f"gpu_smoke: --work-dir {args.work_dir} is not empty", file=sys.stderr)
            return 2
        args.work_dir.mkdir(parents=True, exist_ok=True)
        work_dir = args.work_dir.resolve()
    else:
        work_dir = Path(tempfile.mkdtemp(prefix="llamagym-gpu-smoke-"))
    logs = work_dir / "logs"
    logs.mkdir()
    plan = select(build_plan(settings, gpus, missing, work_dir), args.only)
    data: dict[str, Any] = {
        "gpus": {**gpu_info, "used": gpus},
        "packages": package_versions(),
        "settings": asdict(settings),
        "work_dir": str(work_dir) if args.work_dir is not None else None,
        "complete": False,
    }
    try:
        log(NAME, f"{gpus} GPU(s); downloading {settings.model} if needed")
        data["prefetch"] = prefetch_model(settings.model)
        records: list[dict[str, Any]] = []
        for entry in plan:
            if entry["run"]:
                log(NAME, f"{entry['name']}: {entry['shell']}")
            record = run_path(entry, settings, logs, args.timeout)
            records.append(record)
            shown = record.get("reason") or (
                f"{record['wall_seconds']} s, {record['updates']} updates, model loads: "
                f"{record.get('model_loads')}"
            )
            log(NAME, f"{entry['name']}: {record['status']} ({shown})")
            data["paths"] = records
            write_script_result(NAME, args.quick, args.output, data, argv)  # kept after a crash
        data["complete"] = True
        data["summary"] = {
            status: [r["name"] for r in records if r["status"] == status]
            for status in ("passed", "failed", "timed out", "skipped")
        }
        data["model_does_not_load"] = [
            r["name"] for r in records if r["status"] == "passed" and not r.get("model_loads")
        ]
        path = write_script_result(NAME, args.quick, args.output, data, argv)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work_dir, ignore_errors=True)
    print(json.dumps(data["summary"], indent=2))
    log(NAME, f"wrote {path}")
    bad = data["summary"]["failed"] + data["summary"]["timed out"] + data["model_does_not_load"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
