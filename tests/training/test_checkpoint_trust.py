"""A checkpoint is data: loading one (``llamagym eval``, ``llamagym run --resume``,
``load_agent``) never runs code from it nor lets it turn on ``trust_remote_code``; its
tensors must fit the model and optimizer they load into; a damaged one is named, and a
run directory falls back to its newest intact checkpoint; a full disk while writing one
is one line naming the checkpoint to resume from. Each failure is one line with exit
code 2 and leaves the checkpoints on disk as they were."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llamagym import load_agent
from llamagym.testing import model_with_its_own_code, one_error_line
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    DamagedCheckpointError,
    UntrustedModelError,
)
from llamagym.training.records.run_files import read_metrics

FIRST, SECOND = "update-000001", "update-000002"
EVAL = ["-n", "4", "--num-envs", "2"]


# -- helpers -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished two-update Blackjack run on the tiny model, a checkpoint per update."""
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.testing import tiny_agent
    from llamagym.training.loop.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    agent = tiny_agent(
        BlackjackAgent,
        rollout={"num_envs": 4},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 16, "threads": 1},
        output={"dir": str(run_dir), "quiet": True, "checkpoint_every": 1, "report": False},
    )
    Trainer(agent, agent.session).run()
    assert [p.name for p in checkpoints.list_checkpoints(run_dir)] == [FIRST, SECOND]
    return run_dir


@pytest.fixture
def run_dir(trained_run, tmp_path) -> Path:
    """This test's own copy of the trained run."""
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under ``directory`` with the digest of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def checkpoint_dir(run_dir: Path, name: str = SECOND) -> Path:
    return run_dir / checkpoints.CHECKPOINTS / name


def edit_meta(checkpoint: Path, change) -> None:
    meta = json.loads((checkpoint / checkpoints.META).read_text())
    change(meta)
    (checkpoint / checkpoints.META).write_text(json.dumps(meta))


def edit_tensors(checkpoint: Path, file: str, change) -> None:
    tensors = load_file(str(checkpoint / file))
    change(tensors)
    save_file(tensors, str(checkpoint / file))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def point_at(model: Path | str, *, trust: bool):
    def change(meta: dict) -> None:
        meta["model"] = str(model)
        meta["config"]["model"]["name"] = str(model)
        meta["config"]["model"]["trust_remote_code"] = trust

    return change


class LoaderSpy:
    """Stands in for the model loader: records what it was asked and refuses, so no
    model (and no code of one) is ever loaded by it."""

    def __init__(self, monkeypatch, call_through: bool = False) -> None:
        import llamagym.run
        from llamagym.models import loading

        self.calls: list[dict] = []
        real = loading.load_model_and_tokenizer

        def spy(name, **kwargs):
            self.calls.append({"name": name, **kwargs})
            if call_through:
                return real(name, **kwargs)
            raise CheckpointError("the loader was reached (test stand-in)")

        # Both names of the loader: its module's, and the one the run builder imported.
        monkeypatch.setattr(loading, "load_model_and_tokenizer", spy)
        monkeypatch.setattr(llamagym.run, "load_model_and_tokenizer", spy)


# -- 1. trust_remote_code and the model a checkpoint names -------------------------------
def test_a_tampered_model_section_runs_no_code(run_dir, tmp_path, cli) -> None:
    model, marker = model_with_its_own_code(tmp_path)
    for name in (FIRST, SECOND):
        edit_meta(checkpoint_dir(run_dir, name), point_at(model, trust=True))
    before = snapshot(run_dir)

    for command in (
        ["eval", "blackjack", "--checkpoint", run_dir, *EVAL],
        ["run", "blackjack", "--resume", run_dir, "--quiet"],
    ):
        code, _, err = cli(*command)
        assert code == 2, err
        line = one_error_line(err)
        assert repr(str(model)) in line and "(auto_map: evil)" in line and "refused" in line
        assert "--trust-remote-code" in line and "--set" not in line
        assert not marker.exists()
        assert snapshot(run_dir) == before

    with pytest.raises(UntrustedModelError, match="auto_map"):
        load_agent(run_dir)
    assert not marker.exists()
    assert snapshot(run_dir) == before


def test_a_checkpoint_cannot_turn_on_trust_remote_code(run_dir, monkeypatch, caplog, cli):
    edit_meta(checkpoint_dir(run_dir), point_at("tiny", trust=True))
    spy = LoaderSpy(monkeypatch, call_through=True)
    before = snapshot(run_dir)

    agent = load_agent(run_dir)
    assert agent.config.model.trust_remote_code is False
    assert spy.calls and spy.calls[-1]["trust_remote_code"] is False
    assert any("records model.trust_remote_code = true" in m for m in warnings_of(caplog))

    code, out, err = cli("eval", "blackjack", "--checkpoint", run_dir, *EVAL)
    assert code == 0, err
    assert spy.calls[-1]["trust_remote_code"] is False
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("how", ["load_agent", "eval", "resume"])
def test_only_the_user_allows_model_code_and_is_warned(how, run_dir, tmp_path, monkeypatch,
                                                       caplog, cli) -> None:
    model, marker = model_with_its_own_code(tmp_path)
    edit_meta(checkpoint_dir(run_dir), point_at(model, trust=False))
    spy = LoaderSpy(monkeypatch)
    if how == "load_agent":
        with pytest.raises(CheckpointError, match="test stand-in"):
            load_agent(run_dir, trust_remote_code=True)
    elif how == "eval":
        code, _, err = cli("eval", "blackjack", "--checkpoint", run_dir, "--trust-remote-code",
                           *EVAL)
        assert code == 2 and "test stand-in" in one_error_line(err)
    else:
        code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet", "-n", "64",
                           "--trust-remote-code")
        assert code == 2 and "test stand-in" in one_error_line(err)
    assert spy.calls[-1]["name"] == str(model) and spy.calls[-1]["trust_remote_code"] is True
    loud = [m for m in warnings_of(caplog) if "trust_remote_code is on" in m]
    assert len(loud) == 1 and repr(str(model)) in loud[0] and "will run Python code" in loud[0]
    assert "\n" not in loud[0]
    assert not marker.exists()  # the stand-in loader loads nothing


# -- 2. the tensors must fit ---------------------------------------------------------------
def fresh_agent(run_dir: Path):
    """An untrained agent with the run's config, and a copy of its weights."""
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.config import RunConfig

    meta = checkpoints.read_meta(checkpoint_dir(run_dir))
    agent = BlackjackAgent(config=RunConfig.model_validate(meta["config"]))
    return agent, weights_of(agent)


def weights_of(agent) -> dict[str, torch.Tensor]:
    state = {n: p.detach().clone() for n, p in agent.policy.model.named_parameters()}
    state.update({f"head.{n}": t.clone() for n, t in agent.policy.value_head.state_dict().items()})
    return state


def unchanged(agent, before: dict[str, torch.Tensor]) -> bool:
    after = weights_of(agent)
    return after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in after)


def last_name(tensors: dict) -> str:
    """The tensor loaded last: a check that came after copying would be too late."""
    return sorted(tensors)[-1]


def reshape_last(tensors):
    name = last_name(tensors)
    tensors[name] = torch.zeros(tensors[name].numel() + 1)


def to_half(tensors):
    name = last_name(tensors)
    tensors[name] = tensors[name].to(torch.float16)


def put_nan(tensors):
    name = last_name(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = float("nan")


def put_inf(tensors):
    name = last_name(tensors)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[-1] = float("-inf")


@pytest.mark.parametrize(
    ("file", "change", "error", "words"),
    [
        (checkpoints.WEIGHTS, reshape_last, CheckpointMismatchError,
         ["has shape", "in the checkpoint", "in the model"]),
        (checkpoints.WEIGHTS, to_half, CheckpointMismatchError,
         ["is float16 in the checkpoint, float32 in the model", "not converted",
          "--set model.dtype=float16"]),
        (checkpoints.WEIGHTS, put_nan, DamagedCheckpointError, ["NaN or infinite"]),
        (checkpoints.VALUE_HEAD, put_inf, DamagedCheckpointError,
         ["value head tensor", "NaN or infinite"]),
        (checkpoints.VALUE_HEAD, to_half, CheckpointMismatchError,
         ["value head tensor", "is float16 in the checkpoint"]),
    ],
    ids=["shape", "dtype", "nan", "value-head-inf", "value-head-dtype"],
)
def test_weights_that_do_not_fit_are_refused_naming_the_tensor(file, change, error, words,
                                                               run_dir) -> None:
    checkpoint = checkpoint_dir(run_dir)
    name = last_name(load_file(str(checkpoint / file)))
    edit_tensors(checkpoint, file, change)
    before_disk = snapshot(run_dir)
    agent, before = fresh_agent(run_dir)
    with pytest.raises(error) as raised:
        checkpoints.load_checkpoint(agent.policy, checkpoint)
    message = str(raised.value)
    assert "\n" not in message and repr(str(checkpoint)) in message and repr(name) in message
    assert all(word in message for word in words), message
    assert unchanged(agent, before)  # nothing copied, not even the tensors that fit
    assert snapshot(run_dir) == before_disk


def test_eval_of_nan_weights_is_one_line(run_dir, cli) -> None:
    checkpoint = checkpoint_dir(run_dir)
    name = last_name(load_file(str(checkpoint / checkpoints.WEIGHTS)))
    edit_tensors(checkpoint, checkpoints.WEIGHTS, put_nan)
    before = snapshot(run_dir)
    code, _, err = cli("eval", "blackjack", "--checkpoint", run_dir, *EVAL)
    assert code == 2
    line = one_error_line(err)
    assert repr(str(checkpoint)) in line and repr(name) in line and "NaN" in line
    assert snapshot(run_dir) == before


def exp_avg_name(checkpoint: Path) -> str:
    """The name in state.safetensors of the first parameter's Adam ``exp_avg``."""
    meta = json.loads((checkpoint / checkpoints.META).read_text())
    first = meta["state"]["algorithm"]["optimizer"]["state"]["__items__"][0]
    return first[1]["exp_avg"]["__tensor__"]


def test_an_optimizer_state_that_does_not_fit_is_refused_at_load(run_dir, cli) -> None:
    checkpoint = checkpoint_dir(run_dir)
    moment = exp_avg_name(checkpoint)

    def widen(tensors):
        tensors[moment] = torch.zeros(tensors[moment].numel() + 3)

    edit_tensors(checkpoint, checkpoints.STATE_TENSORS, widen)
    before = snapshot(run_dir / checkpoints.CHECKPOINTS)
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet", "-n", "24")
    assert code == 2
    line = one_error_line(err)
    assert repr(str(checkpoint)) in line and "optimizer state 'exp_avg' of parameter" in line
    assert "has shape" in line
    assert snapshot(run_dir / checkpoints.CHECKPOINTS) == before
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


# -- 3. damaged checkpoints ------------------------------------------------------------------
def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(300))


DAMAGE = {
    "truncated-weights": (checkpoints.WEIGHTS, truncate, "weights.safetensors is truncated"),
    "garbage-weights": (checkpoints.WEIGHTS, garbage, "weights.safetensors is truncated"),
    "truncated-value-head": (checkpoints.VALUE_HEAD, truncate, "value_head.safetensors is"),
    "garbage-state": (checkpoints.STATE_TENSORS, garbage, "state.safetensors is truncated"),
    "missing-weights": (checkpoints.WEIGHTS, Path.unlink, "weights.safetensors is missing"),
    "binary-meta": (checkpoints.META, lambda p: p.write_bytes(b"\x00\xff\xfe" * 50),
                    "checkpoint.json is not text"),
    "list-meta": (checkpoints.META, lambda p: p.write_text("[1, 2, 3]"),
                  "checkpoint.json holds a JSON list, not an object"),
    "bad-json-meta": (checkpoints.META, lambda p: p.write_text('{"format": 1,'),
                      "checkpoint.json is not valid JSON"),
    "text-counter-meta": (checkpoints.META,
                          lambda p: p.write_text(json.dumps({
                              **json.loads(p.read_text()), "episodes": "many"})),
                          "checkpoint.json field 'episodes': Input should be a valid integer"),
    "two-models-meta": (checkpoints.META,
                        lambda p: p.write_text(json.dumps({
                            **json.loads(p.read_text()), "model": "someone/else"})),
                        "names two models"),
}


def damage(run_dir: Path, kind: str, name: str = SECOND) -> tuple[Path, str]:
    file, how, words = DAMAGE[kind]
    checkpoint = checkpoint_dir(run_dir, name)
    how(checkpoint / file)
    return checkpoint, words


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_eval_of_a_run_falls_back_to_its_newest_intact_checkpoint(kind, run_dir, caplog, cli):
    damaged, words = damage(run_dir, kind)
    before = snapshot(run_dir)
    code, out, err = cli("eval", "blackjack", "--checkpoint", run_dir, *EVAL, "--json")
    assert code == 0, err
    assert json.loads(out)["checkpoint"] == str(checkpoint_dir(run_dir, FIRST))
    skipped = [m for m in warnings_of(caplog) if "skipped" in m]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert repr(str(damaged)) in skipped[0] and words in skipped[0]
    assert str(checkpoint_dir(run_dir, FIRST)) in skipped[0]
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_eval_of_a_damaged_checkpoint_given_by_name_is_one_line(kind, run_dir, cli) -> None:
    damaged, words = damage(run_dir, kind)
    before = snapshot(run_dir)
    code, _, err = cli("eval", "blackjack", "--checkpoint", damaged, *EVAL)
    assert code == 2
    line = one_error_line(err)
    assert f"checkpoint {str(damaged)!r} is damaged" in line and words in line
    assert "newest intact one" in line
    assert snapshot(run_dir) == before


def test_resume_skips_a_damaged_checkpoint_and_keeps_it(run_dir, caplog, cli) -> None:
    damaged, words = damage(run_dir, "truncated-weights")
    kept = snapshot(damaged)
    first = snapshot(checkpoint_dir(run_dir, FIRST))
    code, out, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 0, err
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["kind"], r["update"]) for r in records] == [
        ("update", 1), ("resume", 1), ("update", 2)
    ]
    assert records[1]["checkpoint"] == str(checkpoint_dir(run_dir, FIRST))
    skipped = [m for m in warnings_of(caplog) if "skipped" in m]
    assert len(skipped) == 1 and repr(str(damaged)) in skipped[0] and words in skipped[0]
    # Update 2 was trained again and written; the damaged one is kept beside it.
    aside = damaged.with_name(f"{SECOND}.damaged")
    assert snapshot(aside) == kept
    assert checkpoints.check_intact(damaged)["update"] == 2
    assert snapshot(checkpoint_dir(run_dir, FIRST)) == first


@pytest.mark.parametrize("kind", ["garbage-state", "list-meta", "text-counter-meta"])
def test_resume_of_a_damaged_checkpoint_given_by_name_is_one_line(kind, run_dir, cli) -> None:
    damaged, words = damage(run_dir, kind)
    before = snapshot(run_dir)
    code, _, err = cli("run", "blackjack", "--resume", damaged, "--quiet")
    assert code == 2
    line = one_error_line(err)
    assert f"checkpoint {str(damaged)!r} is damaged" in line and words in line
    assert snapshot(run_dir) == before


def test_a_run_with_no_intact_checkpoint_is_one_line(run_dir, cli) -> None:
    damage(run_dir, "garbage-weights", FIRST)
    damaged, words = damage(run_dir, "binary-meta", SECOND)
    before = snapshot(run_dir)
    for command in (
        ["eval", "blackjack", "--checkpoint", run_dir, *EVAL],
        ["run", "blackjack", "--resume", run_dir, "--quiet"],
    ):
        code, _, err = cli(*command)
        assert code == 2
        line = one_error_line(err)
        assert f"{str(run_dir)!r} holds no intact checkpoint" in line
        assert repr(str(damaged)) in line and words in line and "1 older damaged" in line
        assert snapshot(run_dir) == before


def newer_format(meta: dict) -> None:
    meta["format"] = checkpoints.FORMAT_VERSION + 1
    meta["llamagym_version"] = "99.0"


def test_resume_refuses_a_newer_format_naming_both_versions(run_dir, cli) -> None:
    from llamagym import __version__

    edit_meta(checkpoint_dir(run_dir), newer_format)
    before = snapshot(run_dir)
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 2
    line = one_error_line(err)
    newer = checkpoints.FORMAT_VERSION + 1
    assert f"format {newer} (llamagym 99.0)" in line
    assert f"this llamagym {__version__} reads format {checkpoints.FORMAT_VERSION}" in line
    assert repr(str(checkpoint_dir(run_dir))) in line and "upgrade llamagym" in line
    assert snapshot(run_dir) == before


def test_eval_accepts_a_newer_format_whose_weights_load(run_dir, caplog, cli) -> None:
    edit_meta(checkpoint_dir(run_dir), newer_format)
    before = snapshot(run_dir)
    code, out, err = cli("eval", "blackjack", "--checkpoint", run_dir, *EVAL, "--json")
    assert code == 0, err
    assert json.loads(out)["checkpoint"] == str(checkpoint_dir(run_dir))
    assert any("checkpoint format 2 (llamagym 99.0)" in m for m in warnings_of(caplog))
    assert snapshot(run_dir) == before


# -- 4. a full disk while writing ------------------------------------------------------------
def _disk_full_from_safetensors() -> Exception:
    from safetensors import SafetensorError

    return SafetensorError(
        "Error while serializing: I/O error: No space left on device (os error 28) at path "
        '"/somewhere/.tmpX"'
    )


@pytest.mark.parametrize(
    "failure",
    [_disk_full_from_safetensors, lambda: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))],
    ids=["safetensors", "os"],
)
def test_a_full_disk_while_checkpointing_is_one_line(failure, tmp_path, monkeypatch, cli):
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def save(tensors, path, *args, **kwargs):
        if SECOND in str(Path(path).parent.name):
            raise failure()
        return real_save(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save)
    run_dir = tmp_path / "run"
    code, _, err = cli(
        "run", "blackjack", "-n", "16", "-o", run_dir, "--quiet", "--num-envs", "4",
        "--threads", "1", "--eval-episodes", "0", "--checkpoint-every", "1",
        "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
        "--set", "algorithm.epochs=1",
    )
    assert code == 2
    line = one_error_line(err)
    first = checkpoint_dir(run_dir, FIRST)
    assert f"could not write checkpoint {SECOND} of run {str(run_dir)!r}" in line
    assert "the disk is full (No space left on device)" in line
    assert f"free space on that disk, then continue with --resume {run_dir}" in line
    assert f"the previous checkpoint is intact at {str(first)!r}" in line
    # Nothing half written; the previous checkpoint is whole.
    assert sorted(p.name for p in (run_dir / checkpoints.CHECKPOINTS).iterdir()) == [FIRST]
    assert checkpoints.find_checkpoint(run_dir) == first
    assert checkpoints.check_intact(first)["update"] == 1
