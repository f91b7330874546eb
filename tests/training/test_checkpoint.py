"""Checkpoints: exact resume, crash-safe writes, refusal of a foreign checkpoint, and
Ctrl-C/SIGTERM ending a run with a checkpoint."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from llamagym import hookimpl
from llamagym.errors import LlamaGymError
from llamagym.testing import temporary_plugin
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.checkpoint.errors import CheckpointWriteError
from llamagym.training.checkpoint.state import decode_state, encode_state
from llamagym.training.records.run_files import read_metrics, read_transcripts

# Small and single-threaded: fast, and bit-for-bit repeatable on CPU.
FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=2",
]
# Wall-clock fields are the only ones allowed to differ between two runs.
TIMING = {"seconds", "env_steps_per_second"}


def updates_of(run_dir: Path) -> list[dict]:
    return [
        {k: v for k, v in record.items() if k not in TIMING}
        for record in read_metrics(run_dir / "metrics.jsonl")
        if record["kind"] == "update"
    ]


def weights_of(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / checkpoints.WEIGHTS))


class SignalAt:
    """Sends this process ``signum`` when update ``update`` ends, like a Ctrl-C."""

    def __init__(self, update: int, signum: int = signal.SIGINT):
        self.update, self.signum = update, signum

    @hookimpl
    def llamagym_update_end(self, agent, update, metrics):
        if update == self.update:
            os.kill(os.getpid(), self.signum)


def test_state_encoding_round_trips_optimizer_and_random_states() -> None:
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(layer.parameters(), lr=0.01, betas=(0.8, 0.9))
    layer(torch.ones(4, 3)).sum().backward()
    optimizer.step()
    generator = np.random.default_rng(5)
    state = {
        "optimizer": optimizer.state_dict(),
        "python": random.Random(3).getstate(),
        "numpy": np.random.get_state(),
        "generator": generator.bit_generator.state,
        "torch": torch.get_rng_state(),
    }
    tensors: dict = {}
    encoded = json.loads(json.dumps(encode_state(state, tensors)))
    decoded = decode_state(encoded, tensors)

    restored = torch.optim.Adam(layer.parameters(), lr=0.5)
    restored.load_state_dict(decoded["optimizer"])
    assert restored.param_groups[0]["betas"] == (0.8, 0.9)
    for index, values in optimizer.state_dict()["state"].items():
        for key, tensor in values.items():
            assert torch.equal(decoded["optimizer"]["state"][index][key], tensor)
    python = random.Random()
    python.setstate(decoded["python"])
    assert python.random() == random.Random(3).random()
    np.random.set_state(decoded["numpy"])  # accepted as saved
    assert torch.equal(decoded["torch"], state["torch"])


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_resumed_run_repeats_the_unbroken_run(mode, tmp_path, monkeypatch, cli) -> None:
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    # 4 updates of 8 episodes; in generate mode the replies are sampled token by token.
    # The episodes in progress after update 2 carry into update 3: the checkpoint keeps
    # them and the resumed run plays them again.
    budget = ["--episodes", "32", "--mode", mode]

    code, _, _ = cli("run", "blackjack", *budget, *FAST, "-o", unbroken)
    assert code == 0
    if mode == "generate":  # sampled replies must vary, or this proves nothing
        transcripts = read_transcripts(unbroken / "transcripts.jsonl")
        replies = {turn["reply"] for record in transcripts for turn in record["turns"]}
        assert len(replies) > 1

    # The same run, stopped by Ctrl-C after update 2 ...
    with temporary_plugin(SignalAt(2), "ctrl-c"):
        code, _, err = cli("run", "blackjack", *budget, *FAST, "-o", broken)
    assert code == 130
    assert "stopped by SIGINT after update 2" in err
    assert f"llamagym run blackjack --resume {broken}" in err
    assert [p.name for p in checkpoints.list_checkpoints(broken)] == ["update-000002"]
    assert [r["update"] for r in updates_of(broken)] == [1, 2]
    # The episodes in progress (a Blackjack hand is often one step: some just dealt,
    # their seeds already drawn) are in the checkpoint.
    carried = checkpoints.read_meta(broken / "checkpoints" / "update-000002")["state"]["engine"]
    assert sum(slot is not None for slot in carried["carried"]["slots"]) == 4

    # ... then continued from its directory.
    code, out, _ = cli("run", "blackjack", "--resume", broken, "--quiet")
    assert code == 0, out
    assert updates_of(broken) == updates_of(unbroken)  # every metric, every update
    kinds = [r["kind"] for r in read_metrics(broken / "metrics.jsonl")]
    assert kinds == ["update", "update", "resume", "update", "update"]
    final_unbroken = weights_of(checkpoints.find_checkpoint(unbroken))
    final_resumed = weights_of(checkpoints.find_checkpoint(broken))
    assert final_unbroken.keys() == final_resumed.keys()
    assert all(torch.equal(final_unbroken[k], final_resumed[k]) for k in final_unbroken)

    if mode == "generate":
        return  # the rest does not depend on the mode
    # A checkpoint of another model or algorithm is refused, naming the field.
    code, _, err = cli("run", "blackjack", "--resume", broken, "--set", "model.lora=true")
    assert code == 2
    assert "model.lora" in err and "cannot resume" in err

    # An interrupted write leaves the previous checkpoint whole and loadable.
    interrupted_write_keeps_previous_checkpoint(broken, monkeypatch)


def interrupted_write_keeps_previous_checkpoint(run_dir: Path, monkeypatch) -> None:
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.config import RunConfig
    from llamagym.testing import tiny_agent

    previous = checkpoints.find_checkpoint(run_dir)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    meta = checkpoints.read_meta(previous)
    agent = tiny_agent(BlackjackAgent, **{k: meta["config"][k] for k in ("rollout", "algorithm")})
    checkpoints.restore_training_checkpoint(previous, agent.run)

    import safetensors.torch

    real_save = safetensors.torch.save_file
    calls = []

    def failing_save(tensors, path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 2:  # the weights are on disk, the value head is not
            raise OSError("disk full (simulated)")
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    counters = dict(meta["counters"], updates=meta["update"] + 1)
    with pytest.raises(CheckpointWriteError, match="simulated") as failed:
        checkpoints.save_training_checkpoint(
            run_dir, agent.run, counters, meta["config"], keep=1
        )
    message = str(failed.value)
    assert "\n" not in message and str(run_dir) in message
    assert f"the previous checkpoint is intact at {str(previous)!r}" in message
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)

    assert len(calls) == 2 and Path(calls[0]).parent.name.startswith(".update-")
    leftovers = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert leftovers == before  # no half checkpoint, no staging directory
    assert checkpoints.find_checkpoint(run_dir) == previous
    fresh = BlackjackAgent(config=RunConfig.model_validate(meta["config"]))
    checkpoints.load_checkpoint(fresh.policy, previous)
    saved = weights_of(previous)
    parameters = dict(fresh.policy.model.named_parameters())
    assert all(torch.equal(parameters[name], tensor) for name, tensor in saved.items())


def test_sigterm_stops_cleanly_with_a_checkpoint(tmp_path) -> None:
    from llamagym.testing import BanditAgent, tiny_agent
    from llamagym.training.loop.trainer import Trainer

    agent = tiny_agent(
        BanditAgent,
        training={"threads": 1, "episodes": 64},
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
        output={"dir": str(tmp_path), "quiet": True},
    )
    previous_handler = signal.getsignal(signal.SIGTERM)
    with temporary_plugin(SignalAt(1, signal.SIGTERM), "terminate"):
        summary = Trainer(agent, agent.session).run()
    assert summary.interrupted == "SIGTERM"
    assert summary.updates == 1 and summary.evaluation is None
    assert summary.checkpoint == tmp_path / "checkpoints" / "update-000001"
    assert checkpoints.read_meta(summary.checkpoint)["counters"]["episodes"] == 8
    assert signal.getsignal(signal.SIGTERM) is previous_handler  # handlers put back


def write_minimal_checkpoint(directory: Path) -> None:
    """A complete checkpoint with no tensors: a record and empty tensor files."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    (directory / checkpoints.META).write_text(json.dumps({"format": 1, "config": {}}))
    for name in (checkpoints.WEIGHTS, checkpoints.VALUE_HEAD):
        save_file({}, str(directory / name))


def test_checkpoint_discovery_and_pruning(tmp_path) -> None:
    run_dir = tmp_path / "run"
    for update in (1, 2, 3):
        write_minimal_checkpoint(run_dir / "checkpoints" / f"update-{update:06d}")
    # What a process killed mid-write leaves: a hidden staging directory.
    staging = run_dir / "checkpoints" / ".update-000004-abc123"
    staging.mkdir()
    (staging / checkpoints.WEIGHTS).write_bytes(b"partial")

    assert checkpoints.find_checkpoint(run_dir).name == "update-000003"
    newest = run_dir / "checkpoints" / "update-000003"
    assert checkpoints.find_checkpoint(newest) == newest
    assert checkpoints.run_dir_of(newest) == run_dir.resolve()
    checkpoints.prune_checkpoints(run_dir, keep=2)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "update-000002",
        "update-000003",
    ]
    shutil.rmtree(run_dir / "checkpoints")
    with pytest.raises(LlamaGymError, match="holds no checkpoint"):
        checkpoints.find_checkpoint(run_dir)


@pytest.mark.parametrize(
    ("field", "value"),
    [("agent.name", "cartpole"), ("algorithm.name", "grpo"), ("model.name", "Qwen/Qwen2-1.5B")],
)
def test_foreign_checkpoint_is_refused_naming_the_field(field, value, tmp_path) -> None:
    config = {
        "agent": {"name": "blackjack"},
        "algorithm": {"name": "ppo"},
        "model": {"name": "tiny", "lora": None, "lora_rank": None},
    }
    other = json.loads(json.dumps(config))
    section, key = field.split(".")
    other[section][key] = value
    with pytest.raises(LlamaGymError) as error:
        checkpoints.check_compatible({"config": config}, other, tmp_path)
    message = str(error.value)
    assert field in message and repr(value) in message and "\n" not in message
