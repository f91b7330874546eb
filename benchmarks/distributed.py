"""Data-parallel training: env steps/s and seconds per update with 1 and 2 processes.

    python benchmarks/distributed.py            # seeds 0 and 1, 20 updates per run
    python benchmarks/distributed.py --quick    # a smoke run, under a minute

Each run is the command a user would type, ``llamagym run blackjack --num-processes N
--seed S --episodes E --eval-episodes 0 --quiet --output DIR``, with the same settings in
every process: the Blackjack defaults (PPO, score mode, the tiny model, 64 envs, 512
episodes per update; ``--quick``: 16 envs, 64 episodes), so N processes play N times the
episodes of one per update, and E is chosen for the same number of updates. From the
run's ``metrics.jsonl``: env steps per second over all processes and seconds per update,
both after the first update (warm-up), and the whole command's wall time (start-up
included). Prints JSON and writes ``benchmarks/results/distributed.json``
(``distributed-quick.json`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: python benchmarks/distributed.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    BenchmarkError,
    add_result_arguments,
    log,
    refuse_dirty_tree,
    running_script_command,
    spread,
    worker_environment,
    write_result,
)

PROCESSES = (1, 2)
FULL = {"seeds": (0, 1), "updates": 20, "num_envs": 64, "episodes_per_update": 512}
QUICK = {"seeds": (0,), "updates": 4, "num_envs": 16, "episodes_per_update": 64}
FIELDS = ("env_steps_per_second", "episodes_per_second", "seconds_per_update", "wall_seconds")


def measure(processes: int, seed: int, settings: dict[str, Any], threads: int) -> dict:
    """One ``llamagym run`` with ``processes`` processes; its throughput numbers."""
    per_update = settings["episodes_per_update"]
    with tempfile.TemporaryDirectory(prefix="llamagym-distributed-") as directory:
        run_dir = Path(directory) / "run"
        command = [
            *(sys.executable, "-m", "llamagym.cli", "run", "blackjack"),
            *("--num-processes", str(processes), "--seed", str(seed)),
            *("--num-envs", str(settings["num_envs"])),
            *("--set", f"algorithm.episodes_per_update={per_update}"),
            *("--episodes", str(processes * per_update * settings["updates"])),
            *("--eval-episodes", "0", "--checkpoint-every", "0", "--quiet"),
            *("--set", "output.report=false", "--output", str(run_dir)),
        ]
        started = time.perf_counter()
        completed = subprocess.run(
            command, env=worker_environment(threads), capture_output=True, text=True, check=False
        )
        wall = time.perf_counter() - started
        if completed.returncode != 0:
            tail = "\n".join(completed.stderr.strip().splitlines()[-10:])
            raise BenchmarkError(
                f"{processes} process(es), seed {seed}: exit code {completed.returncode}\n{tail}"
            )
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        updates = [r for r in map(json.loads, lines) if r["kind"] == "update"]
    first, last = updates[0], updates[-1]  # the first update is warm-up
    seconds = last["seconds"] - first["seconds"]
    return {
        "processes": processes,
        "seed": seed,
        "updates": len(updates),
        "episodes": last["total_episodes"],
        "env_steps_per_second": (last["env_steps"] - first["env_steps"]) / seconds,
        "episodes_per_second": (last["total_episodes"] - first["total_episodes"]) / seconds,
        "seconds_per_update": statistics.median(
            later["seconds"] - earlier["seconds"] for earlier, later in pairwise(updates)
        ),
        "wall_seconds": wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_result_arguments(parser, "a smoke run (under a minute)", "torch threads per process")
    args = parser.parse_args(argv)
    refuse_dirty_tree("distributed", args.quick, args.allow_dirty)
    settings = QUICK if args.quick else FULL
    threads = args.threads or 1
    runs = []
    try:
        for seed in settings["seeds"]:
            for processes in PROCESSES:  # alternate, so a noisy minute lands on both
                log("distributed", f"{processes} process(es), seed {seed}")
                runs.append(measure(processes, seed, settings, threads))
    except BenchmarkError as error:
        log("distributed", f"failed: {error}")
        return 1
    rows = []
    for processes in PROCESSES:
        mine = [run for run in runs if run["processes"] == processes]
        rows.append({"processes": processes, **{k: spread(r[k] for r in mine) for k in FIELDS}})
    one, two = (row["env_steps_per_second"]["median"] for row in rows)
    data = {
        "settings": {
            **settings,
            "seeds": list(settings["seeds"]),
            "agent": "blackjack",
            "algorithm": "ppo",
            "mode": "score",
            "model": "tiny",
        },
        "rows": rows,
        "runs": runs,
        "speedup_env_steps_per_second": two / one,
    }
    path = write_result("distributed", data, args, running_script_command(argv))
    print(json.dumps(json.loads(path.read_text()), indent=2))
    log("distributed", f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
