"""Every file a run writes survives a full disk and a read-only directory: the command
stops in one line saying which file, why and what to do; the files are as they were
before the failed write (a JSONL file holds only whole lines) and no temporary file is
left. The full disk is simulated: the write raises ENOSPC as the kernel would."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

from llamagym.testing import one_error_line
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.records.run_lock import LOCK

FAST = [
    "--num-envs", "4", "--threads", "1", "--episodes", "24", "--eval-episodes", "8",
    "--quiet", "--checkpoint-every", "1",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1",
]
DISK_FULL = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    from typer.testing import CliRunner

    from llamagym.cli.app import app

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    result = CliRunner().invoke(app, ["run", "blackjack", *FAST, "-o", str(run_dir)])
    assert result.exit_code == 0, (result.output, result.exception)
    return run_dir


@pytest.fixture
def run_copy(finished_run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(finished_run, tmp_path / "run"))


def leftovers(directory: Path) -> list[str]:
    """Hidden files left behind, but the run directory's lock file (kept on purpose: an
    advisory lock is held on it, not by its existence)."""
    return sorted(
        str(p.relative_to(directory)) for p in directory.rglob(".*") if p.name != LOCK
    )


def fill_disk_at_sync_of(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """The disk is full when a replacement of ``name`` is flushed (delayed allocation
    reports ENOSPC there)."""
    real_fsync = os.fsync

    def fsync(descriptor: int) -> None:
        if os.readlink(f"/proc/self/fd/{descriptor}").rsplit("/", 1)[-1].startswith(f".{name}."):
            raise DISK_FULL
        real_fsync(descriptor)

    monkeypatch.setattr(os, "fsync", fsync)


def whole_lines(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    assert text.endswith("\n")
    return [json.loads(line) for line in text.splitlines()]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
@pytest.mark.parametrize("name", ["config.yaml", "transcripts.jsonl", "plugins.json"])
def test_a_full_disk_while_a_run_file_is_replaced_is_one_line(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    run_dir = tmp_path / "run"
    fill_disk_at_sync_of(monkeypatch, name)
    code, out, err = cli("run", "blackjack", *FAST, "-o", run_dir)
    assert code == 2
    line = one_error_line(err)
    assert line.startswith(f"error: could not write {str(run_dir / name)!r}: the disk is full ")
    assert "(No space left on device); free space on that disk, then " in line
    assert leftovers(run_dir) == [], "no temporary file is left"
    assert not (run_dir / name).exists()
    written = checkpoints.list_checkpoints(run_dir)
    if name == "plugins.json":  # written after the first update's checkpoint
        assert [path.name for path in written] == ["update-000001"]
        assert line.endswith(
            f"then continue with --resume {run_dir}; the previous checkpoint is intact at "
            f"{str(written[0])!r}"
        )
    else:  # config.yaml at the start, transcripts.jsonl before the first checkpoint
        assert written == []
        assert line.endswith("then start the run again (it has no earlier checkpoint)")


def test_a_full_disk_mid_line_leaves_metrics_of_whole_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    run_dir = tmp_path / "run"
    real_write = os.write

    def write(descriptor: int, data) -> int:
        # The second update's record: half of it reaches the disk, then it is full.
        if bytes(data[:40]).startswith(b'{"kind": "update", "update": 2,'):
            real_write(descriptor, bytes(data[: len(data) // 2]))
            raise DISK_FULL
        return real_write(descriptor, data)

    monkeypatch.setattr(os, "write", write)
    code, _, err = cli("run", "blackjack", *FAST, "-o", run_dir)
    assert code == 2
    line = one_error_line(err)
    assert f"could not write {str(run_dir / 'metrics.jsonl')!r}: the disk is full" in line
    assert f"continue with --resume {run_dir};" in line
    assert [record["update"] for record in whole_lines(run_dir / "metrics.jsonl")] == [1]
    assert leftovers(run_dir) == []

    monkeypatch.setattr(os, "write", real_write)  # space freed: the run goes on
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 0, err
    updates = [r["update"] for r in whole_lines(run_dir / "metrics.jsonl") if r["kind"] == "update"]
    assert updates == [1, 2, 3]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc/self/fd")
def test_a_full_disk_while_the_report_is_written_keeps_the_old_one(
    run_copy: Path, monkeypatch: pytest.MonkeyPatch, cli
) -> None:
    report = run_copy / "report.md"
    before = report.read_text()
    report.write_text(before + "\nedited")
    fill_disk_at_sync_of(monkeypatch, "report.md")
    code, _, err = cli("report", run_copy)
    assert code == 2
    line = one_error_line(err)
    assert line == (
        f"error: could not write {str(report)!r}: the disk is full (No space left on "
        "device); free space on that disk"
    )
    assert report.read_text() == before + "\nedited"
    assert leftovers(run_copy) == []


def test_report_in_a_read_only_run_directory_is_one_line(run_copy: Path, cli) -> None:
    # A run received without its report; replacing a file needs a writable directory too.
    (run_copy / "report.md").unlink()
    (run_copy / "learning_curve.png").unlink()
    before = {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()}
    run_copy.chmod(0o555)
    try:
        if os.access(run_copy, os.W_OK):
            pytest.skip("this user writes into read-only directories (root)")
        code, out, err = cli("report", run_copy)
    finally:
        run_copy.chmod(0o755)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert line.startswith(f"error: could not write '{run_copy}/")
    assert line.endswith(f"Permission denied; make {str(run_copy)!r} writable")
    assert {p.name: p.read_bytes() for p in run_copy.iterdir() if p.is_file()} == before
