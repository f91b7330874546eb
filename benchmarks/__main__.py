"""``python -m benchmarks PART [--quick]``: run one part of the benchmarks, or all of them.

    python -m benchmarks all --quick      # every part as a smoke run
    python -m benchmarks all              # the full benchmark (hours: see README.md)
    python -m benchmarks throughput       # one part: throughput, breakdown, learning, scaling
    python -m benchmarks table            # results/*.json -> results/table.md
    python -m benchmarks table --results-doc   # ... and into docs/results.md
    python -m benchmarks peer-venv        # create the original LlamaGym's venv only

JSON and PNG files go to ``benchmarks/results/`` (``--output-dir`` to change it). A full
run (not ``--quick``) refuses to start on a working tree with uncommitted changes unless
``--allow-dirty`` is given; ``all`` passes that flag on to the scripts it runs.
"""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    BENCHMARKS_DIR,
    REPO_ROOT,
    BenchmarkError,
    add_common_arguments,
    log,
    refuse_dirty_tree,
)

# Our parts, in the order `all` runs them.
PARTS = {
    "throughput": "env steps/s, tokens/s, update time, memory: ours at 1-64 envs vs the peer",
    "breakdown": "where the rollout's time goes at 32 envs (forward, rendering, env, ...)",
    "scaling": "env steps/s and update time vs model size and prompt length",
    "learning": "Blackjack greedy return vs training time, ours vs the peer, 3 seeds",
}
# Parts kept as standalone scripts (a file and its arguments), each with its own --quick
# flag; run when present. The real model's are the README's SmolLM2 rows.
SCRIPTS: tuple[tuple[str, ...], ...] = (
    ("algorithms.py",),
    ("cartpole.py",),
    ("textworld.py",),
    ("reference_memory.py",),
    ("soak.py",),
    ("distributed.py",),
    ("parsers.py",),
    ("sparse_rewards.py",),
    ("many_actions.py",),
    ("trl_overhead.py",),
    ("real_model.py", "blackjack", "--mode", "score"),
    ("real_model.py", "blackjack", "--mode", "generate"),
    ("real_model.py", "cartpole", "--mode", "score"),
    ("real_model.py", "cartpole", "--mode", "generate"),
    ("real_model.py", "cost"),
    ("real_model.py", "episodepass"),
)


def _part(name: str):  # noqa: ANN202 - a module
    return importlib.import_module(f"benchmarks.{name}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="part", required=True)
    for name, summary in PARTS.items():
        sub = commands.add_parser(name, help=summary, description=_part(name).__doc__)
        sub.formatter_class = argparse.RawDescriptionHelpFormatter
        _part(name).add_arguments(sub)
    scripts = "\n".join(f"  python benchmarks/{' '.join(script)}" for script in SCRIPTS)
    everything = commands.add_parser(
        "all",
        help="every part, then the other scripts (real_model.py's SmolLM2 runs included), "
        "then the table",
        description=f"The parts ({', '.join(PARTS)}), then each script below (with --quick\n"
        f"and --allow-dirty when given; none with --only-ours), then the table:\n\n{scripts}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common_arguments(everything)
    everything.add_argument(
        "--only-ours",
        action="store_true",
        help=f"skip the other scripts ({', '.join(sorted({script[0] for script in SCRIPTS}))})",
    )
    table = commands.add_parser("table", help="results/*.json -> a markdown table")
    _part("table").add_arguments(table)
    venv = commands.add_parser("peer-venv", help="create the original LlamaGym's venv")
    venv.add_argument("--peer-venv", type=Path, default=None)
    return parser


def run_scripts(quick: bool, allow_dirty: bool = False) -> list[str]:
    """Run the other benchmark scripts that exist; return the names that failed."""
    failed = []
    flags = (["--quick"] if quick else []) + (["--allow-dirty"] if allow_dirty else [])
    for name, *arguments in SCRIPTS:
        script = BENCHMARKS_DIR / name
        if not script.exists():
            continue
        command = [sys.executable, str(script), *arguments, *flags]
        name = " ".join([name, *arguments])
        log("all", f"running {' '.join(command[1:])}")
        started = time.perf_counter()
        completed = subprocess.run(command, cwd=REPO_ROOT, check=False)
        log("all", f"{name} finished in {time.perf_counter() - started:.0f}s "
                   f"(exit code {completed.returncode})")
        if completed.returncode != 0:
            failed.append(name)
    return failed


def run_all(args: argparse.Namespace) -> int:
    failed: list[str] = []
    timings: dict[str, float] = {}
    for name in PARTS:
        started = time.perf_counter()
        log("all", f"running {name}")
        try:
            for path in _part(name).run(args):
                log("all", f"wrote {path}")
        except BenchmarkError as error:
            log("all", f"{name} failed: {error}")
            failed.append(name)
        timings[name] = time.perf_counter() - started
    if not args.only_ours:
        failed += run_scripts(args.quick, args.allow_dirty)
    table = _part("table")
    path = table.write_table(Path(args.output_dir), args.quick)
    log("all", f"wrote {path}")
    log("all", "seconds per part: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    if failed:
        log("all", f"failed: {', '.join(failed)}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.part in (*PARTS, "all"):
        refuse_dirty_tree(f"benchmarks {args.part}", args.quick, args.allow_dirty)
    if args.part == "all":
        return run_all(args)
    if args.part == "table":
        return _part("table").main_from_args(args)
    if args.part == "peer-venv":
        from benchmarks.peer import ensure_peer_venv, peer_versions

        venv = ensure_peer_venv(args.peer_venv)
        print(venv, peer_versions(venv))
        return 0
    try:
        for path in _part(args.part).run(args):
            log(args.part, f"wrote {path}")
    except BenchmarkError as error:
        log(args.part, f"failed: {error}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
