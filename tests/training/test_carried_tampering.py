"""A checkpoint's episodes in progress are data: a carried turn that is not what the
engine records (an index outside its choices, log-probabilities or candidates of the
wrong number) is refused when the run resumes, in one line naming the field, exit 2,
with every file of the run as it was."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from llamagym.training.checkpoint import store as checkpoints

FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--checkpoint-every", "1",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1",
]

# Each tampering of the first carried turn, and the words its refusal must hold.
TAMPERINGS: dict[str, tuple[Callable[[dict], None], str]] = {
    "no log-probability": (lambda t: t.update(logprobs=[]), "logprobs"),
    "3 log-probabilities for one choice": (
        lambda t: t.update(logprobs=[-0.1, -0.2, -0.3]), "logprobs"),
    "3 candidates for 2 legal actions": (
        lambda t: t.update(candidates=[*t["candidates"], t["candidates"][0]]), "candidates"),
    "action_index 99": (lambda t: t.update(action_index=99), "action_index"),
    "action_index -1": (lambda t: t.update(action_index=-1), "action_index"),
    "action_index null": (lambda t: t.update(action_index=None), "action_index"),
    "no candidates": (lambda t: t.update(candidates=[]), "candidates"),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A CartPole run of 2 updates whose last checkpoint carries episodes in progress."""
    import sys

    from llamagym.cli import main

    run_dir = tmp_path_factory.mktemp("carried") / "run"
    argv = sys.argv
    sys.argv = ["llamagym", "run", "cartpole", "--episodes", "16", "-o", str(run_dir), *FAST]
    try:
        with pytest.raises(SystemExit) as stopped:
            main()
    finally:
        sys.argv = argv
    assert stopped.value.code in (None, 0)
    return run_dir


def _digest(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("case", list(TAMPERINGS))
def test_a_tampered_carried_turn_is_refused_at_load(case, trained, tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    checkpoint = checkpoints.find_checkpoint(run_dir)
    meta_file = checkpoint / checkpoints.META
    meta = json.loads(meta_file.read_text())
    slots = meta["state"]["engine"]["carried"]["slots"]
    episode = next(s["episode"] for s in slots if s is not None and s["episode"]["turns"])
    tamper, field = TAMPERINGS[case]
    tamper(episode["turns"][0])
    meta_file.write_text(json.dumps(meta))
    before = _digest(run_dir)

    code, _, err = cli("run", "cartpole", "--episodes", "24", "--resume", run_dir, "--quiet")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in err
    assert _digest(run_dir) == before


def test_a_carried_turn_that_is_not_its_steps_is_refused(trained, tmp_path, cli) -> None:
    """A turn that claims another of its legal actions than the one its step played is
    found when the episode is played again, and refused in one line."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    meta_file = checkpoints.find_checkpoint(run_dir) / checkpoints.META
    meta = json.loads(meta_file.read_text())
    slots = meta["state"]["engine"]["carried"]["slots"]
    turn = next(s["episode"]["turns"][0] for s in slots if s is not None and s["episode"]["turns"])
    turn["action_index"] = 1 - turn["action_index"]  # CartPole: the other push
    meta_file.write_text(json.dumps(meta))
    weights = (checkpoints.find_checkpoint(run_dir) / checkpoints.WEIGHTS).read_bytes()

    code, _, err = cli("run", "cartpole", "--episodes", "24", "--resume", run_dir, "--quiet")
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "action_index is not the action its step took" in lines[0]
    assert [p.name for p in checkpoints.list_checkpoints(run_dir)] == [
        p.name for p in checkpoints.list_checkpoints(trained)]
    assert (checkpoints.find_checkpoint(run_dir) / checkpoints.WEIGHTS).read_bytes() == weights
