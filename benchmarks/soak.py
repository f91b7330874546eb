"""Soak: a long Blackjack run with its peak RSS sampled every minute.

Memory must stay flat after warm-up: no growth from caches, histories or logs. Runs
``llamagym run blackjack`` in a child process for MINUTES and samples the child's
resident set size (from /proc) every SAMPLE seconds; prints and writes JSON to
``benchmarks/results/soak.json`` (``soak-quick.json`` with ``--quick``).

    python -m benchmarks.soak [--minutes 30] [--sample 60] [--quick]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    refuse_dirty_tree,
    write_script_result,
)


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample", type=float, default=60.0, help="seconds between samples")
    parser.add_argument("--quick", action="store_true", help="1 minute, a sample every 10 s")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree("soak", args.quick, args.allow_dirty)
    minutes, sample = (1.0, 10.0) if args.quick else (args.minutes, args.sample)
    with tempfile.TemporaryDirectory(prefix="llamagym-soak-") as run_dir:
        command = [
            sys.executable,
            "-m",
            "llamagym.cli",
            "run",
            "blackjack",
            "--quiet",
            "--minutes",
            str(minutes),
            "--eval-episodes",
            "0",
            "--output",
            f"{run_dir}/run",
        ]
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        started, samples = time.time(), []
        while child.poll() is None:
            time.sleep(sample)
            value = rss_mb(child.pid)
            if value is not None:
                samples.append({"minute": round((time.time() - started) / 60, 2), "rss_mb": value})
        stderr = child.stderr.read().decode() if child.stderr else ""
        episodes = 0
        metrics = Path(run_dir) / "run" / "metrics.jsonl"
        if metrics.exists():
            lines = [json.loads(line) for line in metrics.read_text().splitlines() if line]
            episodes = max((r.get("total_episodes", 0) for r in lines), default=0)
    after_warmup = [s["rss_mb"] for s in samples[len(samples) // 4 :]] or [0.0]
    result = {
        "minutes": minutes,
        "sample_seconds": sample,
        "exit_code": child.returncode,
        "episodes": episodes,
        "samples": samples,
        "rss_after_warmup_min_mb": min(after_warmup),
        "rss_after_warmup_max_mb": max(after_warmup),
        "growth_after_warmup_mb": after_warmup[-1] - after_warmup[0],
        "stderr_tail": stderr[-500:],
    }
    path = write_script_result("soak", args.quick, None, result)
    print(json.dumps(result, indent=2))
    print(f"written to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
