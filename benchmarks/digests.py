"""Digests of seeded training runs: what a refactor must leave unchanged.

    python benchmarks/digests.py                         # tiny-model runs, ~2 min
    python benchmarks/digests.py --smollm2               # and a SmolLM2-135M run
    python benchmarks/digests.py --against results/digests.json

Each run is the CLI a user would type, seeded, on one thread. For each, the digest of its
metrics (every record, with the fields that measure time left out) and of its final
weights (every tensor of the last checkpoint, by name). Two trees that train alike give
the same digests; ``--against`` compares with an earlier result and exits 1 on a
difference, naming the runs that differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_script_result  # noqa: E402

TEXTWORLD = ["--set", "agent.games=2", "--set", "agent.max_episode_steps=8",
             "--set", "algorithm.episodes_per_update=8"]
RUNS: dict[str, list[str]] = {
    "blackjack-ppo": ["blackjack", "--episodes", "1024"],
    "blackjack-grpo": ["blackjack", "--algorithm", "grpo", "--episodes", "512"],
    "cartpole-ppo": ["cartpole", "--episodes", "32", "--set", "algorithm.episodes_per_update=16"],
    "textworld-ppo": ["textworld", "--episodes", "16", *TEXTWORLD],
}
SMOLLM2_RUNS: dict[str, list[str]] = {
    "smollm2-blackjack-ppo": ["blackjack", "--model", "smollm2-135m", "--episodes", "64",
                              "--set", "algorithm.episodes_per_update=32"],
}


def metrics_digest(path: Path) -> str:
    """sha256 of the metrics records without the fields that measure time."""
    digest = hashlib.sha256()
    for line in path.read_text().splitlines():
        record = json.loads(line)
        kept = {key: value for key, value in record.items()
                if "second" not in key and "rss" not in key}
        digest.update(json.dumps(kept, sort_keys=True).encode())
    return digest.hexdigest()


def weights_digest(run_dir: Path) -> str:
    """sha256 over every tensor of the last checkpoint, files and tensors by name."""
    import torch
    from safetensors import safe_open

    last = sorted((run_dir / "checkpoints").glob("update-*"))[-1]
    digest = hashlib.sha256()
    for file in sorted(last.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            for name in sorted(tensors.keys()):
                tensor = tensors.get_tensor(name).contiguous()
                digest.update(f"{file.name}:{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.view(-1).view(dtype=torch.uint8).numpy())
    return digest.hexdigest()


def run_digest(arguments: list[str], output: Path) -> dict[str, str]:
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    line = [executable, "run", *arguments, "--seed", "0", "--threads", "1",
            "--eval-episodes", "0", "--quiet", "--output", str(output),
            "--set", "output.report=false"]
    completed = subprocess.run(line, capture_output=True, text=True)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(line)} failed:\n{completed.stderr[-2000:]}")
    return {"metrics": metrics_digest(output / "metrics.jsonl"),
            "weights": weights_digest(output)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", action="store_true", help="Add a SmolLM2-135M run.")
    parser.add_argument("--against", type=Path, help="An earlier result to compare with.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    args = parser.parse_args()
    runs = {**RUNS, **(SMOLLM2_RUNS if args.smollm2 else {})}
    digests: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="llamagym-digests-") as scratch:
        for name, arguments in runs.items():
            digests[name] = run_digest(arguments, Path(scratch) / name)
            print(f"{name}: metrics {digests[name]['metrics'][:16]} "
                  f"weights {digests[name]['weights'][:16]}", flush=True)
    path = write_script_result("digests", False, args.output, {"runs": digests})
    print(f"written to {path}")
    if args.against:
        earlier = json.loads(args.against.read_text())["runs"]
        differ = [name for name in digests if name in earlier and earlier[name] != digests[name]]
        for name in differ:
            print(f"differs from {args.against}: {name}")
        if differ:
            sys.exit(1)
        compared = [name for name in digests if name in earlier]
        print(f"same digests as {args.against} for {len(compared)} runs")


if __name__ == "__main__":
    main()
