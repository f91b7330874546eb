"""A model accelerate shards with FSDP2, on two CPU processes over gloo: the TRL backend's
multi-turn rollout, a training step and the end of a run (tests/trl_backend/fsdp2_worker.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llamagym.testing import free_port

pytest.importorskip("trl")

pytestmark = pytest.mark.slow  # several processes under torchrun

WORKER = Path(__file__).with_name("fsdp2_worker.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("fsdp2")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), str(WORKER), str(out)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    found = [json.loads(line[len("RESULT "):]) for line in lines]
    return {entry["rank"]: entry for entry in found}


@pytest.mark.slow
def test_processes_play_different_numbers_of_passes_on_a_sharded_model(ranks) -> None:
    """Each process plays its own episodes (2 against 12) inside one gathering of the
    parameters: they run different numbers of forward passes and neither waits for the
    other; the sharded model trains afterwards."""
    assert ranks[0]["played"] == 2 and ranks[1]["played"] == 12
    passes = ranks[0]["forward_passes"]
    assert passes == ranks[1]["forward_passes"]
    assert passes[0] != passes[1] and min(passes) > 0
    assert ranks[0]["weights_changed"]


@pytest.mark.slow
def test_a_sharded_run_ends_with_one_gathered_model_that_plain_transformers_loads(ranks) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    whole = ranks[0]["whole_digests"]
    assert whole[0] == whole[1] == ranks[1]["whole_digests"][0]
    assert ranks[0]["gathered_digest"] == whole[0]
    assert ranks[0]["evaluated"] == 6  # the main process played alone, the other had left
    model = AutoModelForCausalLM.from_pretrained(ranks[0]["export"])
    sha = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        sha.update(name.encode())
        sha.update(parameter.detach().to(torch.float32).clone().numpy().tobytes())
    assert sha.hexdigest() == whole[0]
