"""What every benchmark part shares: the machine description, result files, worker
subprocesses, and the median/min/max summary used for every repeated number.

Measurements run in fresh worker processes (``python -m benchmarks.<part> --worker
SPEC``) so one configuration's memory, caches and thread pools never leak into the
next; a worker prints its result as one ``BENCHMARK-RESULT {json}`` line on stdout.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.metadata
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

BENCHMARKS_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCHMARKS_DIR.parent
DEFAULT_RESULTS_DIR = BENCHMARKS_DIR / "results"
RESULT_MARKER = "BENCHMARK-RESULT "
WORKER_TIMEOUT_SECONDS = 4 * 3600
# One torch thread per process unless --threads says otherwise: on a shared machine,
# more threads than idle cores makes every side many times slower (and noisier).
DEFAULT_THREADS = 1


class BenchmarkError(RuntimeError):
    """A measurement could not be taken (a worker failed, a tool is missing)."""


# -- the machine ------------------------------------------------------------------------
def available_cores() -> int:
    """CPUs this process may run on (the affinity mask, not the host's total)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


#: The CPU flags that decide how fast a model runs here (fp32 FMA width, bfloat16 and
#: int8 dot products, matrix tiles): a number without them cannot be compared.
SPEED_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
               "amx_bf16", "amx_int8")


def cpu_flags() -> dict[str, bool | None]:
    """Which of :data:`SPEED_FLAGS` this CPU has, from ``/proc/cpuinfo``: every flag is
    a key, True or False, or None where the flags cannot be read (not Linux), so an
    unknown flag is never taken for a missing one."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return {flag: flag in have for flag in SPEED_FLAGS}
    except OSError:
        pass
    return dict.fromkeys(SPEED_FLAGS)


def _memory_gb() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024**2, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where a result was measured; written into every result file."""
    return {
        "cores": available_cores(),
        "logical_cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "memory_gb": _memory_gb(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
        "llamagym": _version("llamagym"),
        # A busy machine explains slow numbers; record how busy it was.
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def machine_label(machine: Mapping[str, Any]) -> str:
    """``"2 cores, Intel(R) Xeon(R) Processor"``: the table's machine column."""
    return f"{machine.get('cores', '?')} cores, {machine.get('cpu_model', 'unknown CPU')}"


def _git(directory: Path, *words: str) -> tuple[str | None, str]:
    """``git -C directory WORDS``: (its output, "") or (None, why it gave none)."""
    try:
        done = subprocess.run(["git", "-C", str(directory), *words], capture_output=True,
                              text=True, timeout=30)
    except FileNotFoundError:
        return None, "git is not installed"
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"git could not run ({error})"
    if done.returncode != 0:
        said = [line.strip() for line in done.stderr.splitlines() if line.strip()]
        return None, f"git: {said[0] if said else f'exit code {done.returncode}'}"
    return done.stdout.strip(), ""


def tree_state(directory: Path) -> dict[str, Any]:
    """The git tree ``directory`` is in: its top folder, commit and whether it has
    uncommitted changes to tracked files; ``unknown`` says why these cannot be known
    (no git, not a git tree, a tree git refuses to read)."""
    top, why = _git(directory, "rev-parse", "--show-toplevel")
    commit, why = (None, why) if top is None else _git(directory, "rev-parse", "HEAD")
    status, why = (None, why) if commit is None else _git(
        directory, "status", "--porcelain", "--untracked-files=no"
    )
    if status is None:
        return {"commit": commit, "dirty": None, "unknown": f"{directory}: {why}"}
    return {"top": top, "commit": commit, "dirty": bool(status)}


def code_source(package: Path, scripts: Path) -> dict[str, Any]:
    """The commit of the code a benchmark measures: the git tree of the ``llamagym``
    package that runs (``package``, its folder), and whether that tree has changes on
    top (then the numbers are of that commit plus those changes). ``dirty`` is None,
    and ``unknown`` says why, when that cannot be told, or when the benchmark scripts
    (``scripts``) come from another commit than the package they measure."""
    measured = tree_state(package)
    if "unknown" in measured:
        return measured
    own = tree_state(scripts)
    if own.get("top") != measured["top"] and own.get("commit") != measured["commit"]:
        return {
            "commit": measured["commit"],
            "dirty": None,
            "unknown": f"the benchmark scripts in {scripts} are not of commit "
            f"{measured['commit'][:12]}, which the llamagym they measure (in "
            f"{measured['top']}) runs; install this checkout (pip install -e .) or run "
            "that tree's benchmarks",
        }
    return {"commit": measured["commit"], "dirty": measured["dirty"]}


def source_commit() -> dict[str, Any]:
    """:func:`code_source` of the ``llamagym`` package this interpreter imports and of
    these scripts, as it was when this process first asked (:func:`refuse_dirty_tree`
    asks as a benchmark starts): a run of half an hour names the code it loaded, not a
    commit made in the tree while it ran."""
    return dict(_source_at_start())


@functools.cache
def _source_at_start() -> dict[str, Any]:
    import llamagym

    return code_source(Path(llamagym.__file__).resolve().parent, BENCHMARKS_DIR)


def today() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# -- numbers ----------------------------------------------------------------------------
def spread(values: Iterable[float | None]) -> dict[str, Any] | None:
    """Median, min and max of the repeats (``None`` entries dropped; ``None`` if empty)."""
    kept = [float(v) for v in values if v is not None]
    if not kept:
        return None
    return {
        "median": statistics.median(kept),
        "min": min(kept),
        "max": max(kept),
        "n": len(kept),
        "values": kept,
    }


#: Two-sided 95% Student t quantiles, by degrees of freedom (an interval over 2-5 seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776}


def ci95_over_seeds(values: Sequence[float]) -> float | None:
    """Half-width of the 95% interval of the mean over seeds (Student t); None for one."""
    n = len(values)
    if n < 2:
        return None
    return T95.get(n - 1, 1.96) * statistics.stdev(values) / math.sqrt(n)


def median_of(summary: Mapping[str, Any] | None) -> float | None:
    return None if summary is None else summary.get("median")


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024


# -- worker processes -------------------------------------------------------------------
def stop_process(process: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM ``process``, and SIGKILL it if it has not ended within ``grace`` seconds."""
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)


def worker_environment(threads: int) -> dict[str, str]:
    """The environment every worker (ours and the peer's) runs with."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONHASHSEED": "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "WANDB_MODE": "disabled",
            "TRANSFORMERS_VERBOSITY": "error",
            "PYTHONWARNINGS": "ignore",
        }
    )
    return env


def emit_result(data: Mapping[str, Any]) -> None:
    """A worker's answer: one marked JSON line on stdout, read by :func:`parse_result`."""
    sys.stdout.write(RESULT_MARKER + json.dumps(data) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None


def run_command(
    command: Sequence[str], threads: int, timeout: float = WORKER_TIMEOUT_SECONDS,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run one worker command (``env`` on top of :func:`worker_environment`) and return
    the JSON it printed."""
    try:
        completed = subprocess.run(
            list(command),
            cwd=REPO_ROOT,
            env={**worker_environment(threads), **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        shown = " ".join(command[:4])
        raise BenchmarkError(f"{shown} ... timed out after {timeout:.0f}s") from error
    result = parse_result(completed.stdout)
    if completed.returncode != 0 or result is None:
        tail = "\n".join((completed.stderr or completed.stdout).strip().splitlines()[-15:])
        raise BenchmarkError(
            f"worker {' '.join(command[:4])} ... exited with {completed.returncode}:\n{tail}"
        )
    return result


def run_worker(
    part: str, spec: Mapping[str, Any], threads: int, timeout: float = WORKER_TIMEOUT_SECONDS,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Run ``benchmarks.<part>``'s worker with ``spec`` in a fresh interpreter (as a
    module from the repository root: run as a file, the script's folder would come first
    on sys.path, and a neighbour such as ``textworld.py`` would shadow the package)."""
    command = [sys.executable, "-m", f"benchmarks.{part}", "--worker", json.dumps(dict(spec))]
    return run_command(command, threads, timeout, env)


def worker_main(argv: Sequence[str] | None, work: Any) -> int:
    """Entry point of ``python -m benchmarks.<part> --worker SPEC``."""
    parser = argparse.ArgumentParser(description="internal: one measurement, JSON out")
    parser.add_argument("--worker", required=True, help="the measurement, as JSON")
    spec = json.loads(parser.parse_args(argv).worker)
    threads = int(spec.get("threads") or DEFAULT_THREADS)
    import torch

    torch.set_num_threads(threads)
    emit_result(work(spec))
    return 0


def log(part: str, message: str) -> None:
    print(f"[{part}] {message}", file=sys.stderr, flush=True)


# -- options and result files -----------------------------------------------------------
def add_allow_dirty(parser: argparse.ArgumentParser) -> None:
    """``--allow-dirty``: the one option every benchmark entry point takes to measure a
    working tree with uncommitted changes (see :func:`refuse_dirty_tree`)."""
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="measure a working tree with uncommitted changes (the result file then says "
        '"dirty": true); without it a full run refuses to start on such a tree',
    )


def refuse_dirty_tree(name: str, quick: bool, allow_dirty: bool) -> None:
    """Stop before a full measurement of code no commit holds, or whose commit cannot be
    told: its result file could not name the code it measured. A ``--quick`` smoke run
    or ``--allow-dirty`` go ahead."""
    source = source_commit()  # the tree as the measurement starts, for its result file
    if quick or allow_dirty:
        return
    if source["dirty"] is None:
        raise SystemExit(
            f"{name}: cannot tell which commit would be measured ({source.get('unknown')}), "
            "so the result could not name it: fix that, or pass --allow-dirty to record "
            'numbers of code no commit names (the file then says "dirty": null)'
        )
    if source["dirty"]:
        raise SystemExit(
            f"{name}: the working tree has uncommitted changes on top of "
            f"{str(source['commit'])[:12]}, so the result would name a commit it did not "
            "measure: commit the changes first, or pass --allow-dirty to record numbers of "
            'uncommitted code (the file then says "dirty": true)'
        )


def add_result_arguments(
    parser: argparse.ArgumentParser,
    quick_help: str = "a smoke run (seconds, not minutes)",
    threads_help: str = "torch threads for every process, ours and the peer's (default: 1; on "
    "a shared machine more threads than idle cores makes every side many times slower)",
) -> None:
    """The options of a benchmark that writes with :func:`write_result`: ``--quick``,
    ``--threads``, ``--output-dir`` and ``--allow-dirty``."""
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--threads", type=int, default=None, help=threads_help)
    parser.add_argument(
        "--output-dir",
        type=Path,
        default=DEFAULT_RESULTS_DIR,
        help="where the result files go (default: benchmarks/results)",
    )
    add_allow_dirty(parser)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every part of ``python -m benchmarks`` takes."""
    add_result_arguments(parser)
    parser.add_argument(
        "--skip-peer", action="store_true", help="measure LlamaGym only (no original LlamaGym)"
    )
    parser.add_argument(
        "--peer-venv",
        type=Path,
        default=None,
        help="the original LlamaGym's venv (default: $LLAMAGYM_PEER_VENV or ../.peer-venv); "
        "created on first use",
    )


def threads_of(args: argparse.Namespace) -> int:
    return int(args.threads or DEFAULT_THREADS)


def part_command(part: str, args: argparse.Namespace, extra: Sequence[str] = ()) -> str:
    """The command line that reproduces one part's result file."""
    words = ["python", "-m", "benchmarks", part]
    if args.quick:
        words.append("--quick")
    if args.threads:
        words += ["--threads", str(args.threads)]
    if getattr(args, "skip_peer", False):
        words.append("--skip-peer")
    words += list(extra)
    return " ".join(words)


#: Options that only say where files go: left out of a recorded command.
LOCATION_OPTIONS = ("--output", "--output-dir", "--runs-dir", "--keep-runs", "--work-dir")
#: Flags that change no number (the result file records ``dirty`` itself): left out too.
UNRECORDED_FLAGS = ("--allow-dirty",)


def budget_arguments(episodes: int | None, minutes: float | None) -> list[str]:
    """``llamagym run``'s budget flag: ``--episodes K``, else ``--minutes M``. Either,
    given alone, is the run's only budget (an agent's default minutes do not end an
    episode budget's run first, so its numbers do not depend on the machine's load)."""
    if episodes is not None:
        return ["--episodes", str(int(episodes))]
    return ["--minutes", str(minutes)]


def recorded_arguments(argv: Sequence[str]) -> list[str]:
    """``argv`` without the options that only place files and the flags that change no
    number, so a recorded command reproduces the numbers anywhere."""
    words, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word in LOCATION_OPTIONS:
            skip = True
        elif word in UNRECORDED_FLAGS:
            continue
        elif not word.startswith(tuple(f"{option}=" for option in LOCATION_OPTIONS)):
            words.append(word)
    return words


def script_command(script: str, argv: Sequence[str]) -> str:
    """``python benchmarks/SCRIPT ARGS`` as run, with :func:`recorded_arguments` only."""
    return " ".join(["python", f"benchmarks/{script}", *recorded_arguments(argv)])


def running_script_command(argv: Sequence[str] | None = None) -> str:
    """The command of this process's script, as it was started: ``python -m
    benchmarks.NAME ARGS`` as a module, ``python benchmarks/NAME.py ARGS`` as a file
    (``argv``: its arguments, default ``sys.argv[1:]``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name.startswith("benchmarks."):
        return " ".join(["python", "-m", spec.name, *recorded_arguments(argv)])
    return script_command(Path(sys.argv[0]).name, argv)


def result_header(
    name: str, command: str, quick: bool, threads: int | None = None
) -> dict[str, Any]:
    """What every result file starts with: the result's name, the command that made it,
    when, the commit measured (and whether the tree had changes on top), whether it was a
    smoke run, the torch threads where the caller fixes them for the whole run, and the
    machine."""
    header: dict[str, Any] = {
        "benchmark": name,
        "command": command,
        "date": today(),
        **source_commit(),
        "quick": bool(quick),
    }
    if threads is not None:
        header["threads"] = threads
    header["machine"] = machine_info()
    return header


#: What a result file must say about where its numbers come from: the commit measured,
#: whether the tree had changes on top, and the CPU (its model and :data:`SPEED_FLAGS`).
PROVENANCE_KEYS = ("commit", "dirty", "machine")
MACHINE_KEYS = ("cpu_model", "cpu_flags")


def header_problems(header: Mapping[str, Any]) -> list[str]:
    """What ``header`` lacks of :data:`PROVENANCE_KEYS`, :data:`MACHINE_KEYS` and
    :data:`SPEED_FLAGS` (a value may be None where it cannot be known: a tree without git,
    flags on a system without ``/proc/cpuinfo``; the key is still there)."""
    problems = [f"no `{key}`" for key in PROVENANCE_KEYS if key not in header]
    machine = header.get("machine")
    if not isinstance(machine, Mapping):
        return problems if "machine" not in header else [*problems, "`machine` is no object"]
    problems += [f"no `machine.{key}`" for key in MACHINE_KEYS if key not in machine]
    flags = machine.get("cpu_flags")
    if isinstance(flags, Mapping):
        problems += [f"no `machine.cpu_flags.{flag}`" for flag in SPEED_FLAGS if flag not in flags]
    elif "cpu_flags" in machine:
        problems.append("`machine.cpu_flags` is no object")
    return problems


def write_record(path: Path, header: Mapping[str, Any], data: Mapping[str, Any]) -> Path:
    """The one writer of result files: ``header`` (:func:`result_header`), then ``data``.
    Refuses a header that does not name the commit, the tree's state and the CPU
    (:func:`header_problems`), and data that would overwrite any of them."""
    problems = header_problems(header)
    problems += [f"the data overwrites `{key}`" for key in PROVENANCE_KEYS if key in data]
    if problems:
        raise ValueError(f"result file {path}: {'; '.join(problems)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**header, **data}, indent=2) + "\n", encoding="utf-8")
    return path


def write_script_result(
    script: str,
    quick: bool,
    output: Path | None,
    data: Mapping[str, Any],
    argv: Sequence[str] | None = None,
) -> Path:
    """Write a standalone script's result file: the header every result file has, then
    ``data``; to ``output`` if given, else to ``results/<script>[-quick].json``
    (``script`` names the result; the command names the file that ran, with ``argv``,
    default ``sys.argv[1:]``)."""
    header = result_header(script, running_script_command(argv), quick)
    return write_record(output or result_path(DEFAULT_RESULTS_DIR, script, quick), header, data)


def result_path(output_dir: Path, name: str, quick: bool) -> Path:
    """``<name>.json``, or ``<name>-quick.json`` for a smoke run, which so never
    overwrites a full result."""
    return Path(output_dir) / f"{name}{'-quick' if quick else ''}.json"


def write_result(
    name: str, data: Mapping[str, Any], args: argparse.Namespace, command: str
) -> Path:
    """Write ``<output-dir>/<name>[-quick].json`` with the header every result file has."""
    header = result_header(name, command, bool(args.quick), threads_of(args))
    return write_record(result_path(Path(args.output_dir), name, bool(args.quick)), header, data)


def pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (plots are skipped) if missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot", "matplotlib is not installed; skipping the PNG (pip install matplotlib)")
        return None
    return plt


def save_figure(fig: Any, path: Path, *, bbox_inches: str | None = "tight") -> Path:
    """Lay out, write (120 dpi) and close a pyplot figure; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches=bbox_inches)
    plt.close(fig)
    return path
