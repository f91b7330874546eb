"""The peer: the original LlamaGym 0.1.1, in a virtual environment of its own.

Its pins (``peer-constraints.txt``, a copy of ``shared/peer/``) conflict with ours
(TRL 0.7, transformers 4.38, numpy < 2), so it can never share our venv. This module
creates that venv when it is missing, hands the peer our tiny model in a form its older
libraries read, and runs ``peer_agent.py`` inside it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks.common import (
    BENCHMARKS_DIR,
    REPO_ROOT,
    WORKER_TIMEOUT_SECONDS,
    BenchmarkError,
    log,
    run_command,
)

PEER_VENV_ENV_VAR = "LLAMAGYM_PEER_VENV"
PEER_TORCH = "torch==2.13.0"  # the torch our own venv runs, so both sides use the same kernels
PEER_PACKAGE = "llamagym==0.1.1"
CONSTRAINTS = BENCHMARKS_DIR / "peer-constraints.txt"
PEER_SCRIPT = BENCHMARKS_DIR / "peer_agent.py"
# The peer model's max_position_embeddings (ours: 2048). No weight depends on it, but
# transformers 4.38, which the peer is pinned to, builds a mask of that size squared on
# every forward pass; see peer_agent.load_model.
PEER_MAX_POSITIONS = 512
# What a working peer venv imports; its versions go into every peer result.
_CHECK = (
    "import importlib.metadata as m, json, llamagym, trl, torch, transformers, peft; "
    "print(json.dumps({d: m.version(d) for d in "
    "('llamagym', 'trl', 'transformers', 'torch', 'peft', 'gymnasium')}))"
)


def default_peer_venv() -> Path:
    """``$LLAMAGYM_PEER_VENV``, else ``.peer-venv`` beside the repository (never inside it)."""
    override = os.environ.get(PEER_VENV_ENV_VAR)
    return Path(override).expanduser() if override else REPO_ROOT.parent / ".peer-venv"


def peer_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def peer_versions(venv: Path) -> dict[str, str] | None:
    """The peer venv's package versions, or None if it is missing or broken."""
    python = peer_python(venv)
    if not python.exists():
        return None
    completed = subprocess.run(
        [str(python), "-P", "-c", _CHECK],
        capture_output=True,
        text=True,
        check=False,
        cwd=venv,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    if completed.returncode != 0:
        return None
    try:
        return json.loads(completed.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _base_python() -> str:
    """A Python to create the venv from: the interpreter our venv was made from."""
    base = getattr(sys, "_base_executable", None)
    return base if base and Path(base).exists() else (shutil.which("python3") or sys.executable)


def ensure_peer_venv(venv: Path | None = None) -> Path:
    """Return the peer venv, creating it first if it is missing or does not import.

    Runs ``python3 -m venv VENV``, ``pip install torch==2.13.0``, then
    ``pip install -c peer-constraints.txt llamagym==0.1.1`` (a few minutes; needs pip
    access to a package index).
    """
    venv = Path(venv or default_peer_venv()).expanduser().resolve()
    if peer_versions(venv) is not None:
        return venv
    if venv.is_relative_to(REPO_ROOT):
        raise BenchmarkError(f"the peer venv must live outside the repository, not at {venv}")
    log("peer", f"creating the original LlamaGym's venv at {venv} (a few minutes)")
    if venv.exists():
        shutil.rmtree(venv)
    steps = (
        [_base_python(), "-m", "venv", str(venv)],
        [str(peer_python(venv)), "-m", "pip", "install", "--quiet", PEER_TORCH],
        [str(peer_python(venv)), "-m", "pip", "install", "--quiet",
         "-c", str(CONSTRAINTS), PEER_PACKAGE],
    )
    for step in steps:
        completed = subprocess.run(step, capture_output=True, text=True, check=False)
        if completed.returncode != 0:
            tail = "\n".join(completed.stderr.strip().splitlines()[-10:])
            raise BenchmarkError(f"creating the peer venv failed at {' '.join(step)}:\n{tail}")
    versions = peer_versions(venv)
    if versions is None:
        raise BenchmarkError(f"the peer venv at {venv} was created but `import llamagym` fails")
    log("peer", f"peer venv ready: {versions}")
    return venv


def export_peer_model(directory: Path, seed: int = 0) -> Path:
    """Write our tiny model where the peer's transformers 4.38 can rebuild it.

    ``peer_model.json`` holds the LlamaConfig dimensions and special tokens,
    ``model.safetensors`` the very weights ``tiny`` starts from, and ``tokenizer.json``
    our tokenizer with its BPE merges written the way tokenizers 0.15 reads them
    (``"a b"`` strings; newer releases write ``["a", "b"]`` pairs).
    """
    from llamagym.models.tiny import build_tiny_model

    source = build_tiny_model(seed=seed)
    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    rope = config.get("rope_parameters") or {}
    dimensions = {
        key: config[key]
        for key in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "tie_word_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id",
            "pad_token_id", "hidden_act",
        )
        if key in config
    }
    dimensions["rope_theta"] = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    spec = {
        "config": dimensions,
        "tokens": {
            "pad_token": tokenizer_config["pad_token"],
            "eos_token": tokenizer_config["eos_token"],
            "bos_token": tokenizer_config.get("bos_token") or tokenizer_config["eos_token"],
        },
        "source": str(source),
        "seed": seed,
    }
    tokenizer = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    model = tokenizer["model"]
    model["merges"] = [
        merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]
    ]
    model.pop("ignore_merges", None)  # unknown to tokenizers 0.15
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    (directory / "peer_model.json").write_text(json.dumps(spec, indent=2), encoding="utf-8")
    shutil.copyfile(source / "model.safetensors", directory / "model.safetensors")
    return directory


def run_peer(
    venv: Path,
    spec: Mapping[str, Any],
    threads: int,
    timeout: float = WORKER_TIMEOUT_SECONDS,
) -> dict[str, Any]:
    """Run ``peer_agent.py`` with ``spec`` in the peer venv and return its JSON.

    ``-P`` keeps ``benchmarks/`` off the peer's ``sys.path``: that folder holds modules
    (``profile.py``) that would shadow the standard library's.
    """
    command = [str(peer_python(venv)), "-P", str(PEER_SCRIPT), "--spec", json.dumps(dict(spec))]
    result = run_command(command, threads, timeout)
    result["versions"] = peer_versions(venv)
    return result
