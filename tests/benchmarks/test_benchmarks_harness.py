"""The benchmark harness refuses to measure uncommitted code unless told to, and every
result file starts with the same header, whichever writer made it. In-process and
fast: the tree's state is faked, nothing is measured."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import common

DIRTY = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True}
CLEAN = {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False}
HEADER = ["benchmark", "command", "date", "commit", "dirty", "quick"]


@pytest.fixture
def dirty_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(DIRTY))


def test_a_full_run_on_a_dirty_tree_stops_with_one_line_naming_the_fix(dirty_tree) -> None:
    with pytest.raises(SystemExit) as stopped:
        common.refuse_dirty_tree("parsers", quick=False, allow_dirty=False)
    message = str(stopped.value.code)
    assert "\n" not in message
    assert message.startswith("parsers: ") and "uncommitted changes" in message
    assert "0123456789ab" in message  # the commit the numbers would wrongly name
    assert "commit the changes" in message and "--allow-dirty" in message


@pytest.mark.parametrize(
    ("source", "quick", "allow_dirty"),
    [
        (DIRTY, False, True),  # told to: the file then records "dirty": true
        (DIRTY, True, False),  # a smoke run measures nothing worth keeping
        (CLEAN, False, False),
        ({"commit": None, "dirty": None, "unknown": "no git"}, False, True),
    ],
)
def test_the_check_lets_through(monkeypatch, source, quick, allow_dirty) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(source))
    common.refuse_dirty_tree("parsers", quick=quick, allow_dirty=allow_dirty)


# -- which code was measured: real git trees ---------------------------------------------
@pytest.fixture
def git_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """git reads no configuration of this machine (a safe.directory there would hide
    the ownership check)."""
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")


def make_tree(path: Path, text: str) -> str:
    """A git tree at ``path`` holding ``package/code.py`` and ``benchmarks/run.py``, one
    commit; returns the commit."""
    for name in ("package/code.py", "benchmarks/run.py"):
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    return subprocess.run(
        [*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()


def test_the_commit_recorded_is_the_measured_packages(git_env, tmp_path: Path) -> None:
    installed = make_tree(tmp_path / "installed", "x = 1\n")
    make_tree(tmp_path / "checkout", "x = 2\n")
    source = common.code_source(tmp_path / "installed/package", tmp_path / "checkout/benchmarks")
    assert source["commit"] == installed and source["dirty"] is None
    assert "pip install -e ." in source["unknown"]
    same = common.code_source(tmp_path / "installed/package", tmp_path / "installed/benchmarks")
    assert same == {"commit": installed, "dirty": False}
    (tmp_path / "installed/package/code.py").write_text("x = 3\n", encoding="utf-8")
    changed = common.code_source(tmp_path / "installed/package", tmp_path / "installed/benchmarks")
    assert changed == {"commit": installed, "dirty": True}

    # This interpreter's llamagym: its own tree's commit is the one recorded.
    import llamagym

    package = Path(llamagym.__file__).resolve().parent
    head = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"],
                          capture_output=True, text=True)
    if head.returncode == 0:
        assert common.source_commit()["commit"] == head.stdout.strip()


def refused_message(monkeypatch: pytest.MonkeyPatch, source: dict[str, Any]) -> str:
    monkeypatch.setattr(common, "source_commit", lambda: source)
    with pytest.raises(SystemExit) as stopped:
        common.refuse_dirty_tree("parsers", quick=False, allow_dirty=False)
    common.refuse_dirty_tree("parsers", quick=False, allow_dirty=True)
    return str(stopped.value.code)


def test_without_git_the_tree_is_not_taken_for_clean(git_env, tmp_path, monkeypatch) -> None:
    make_tree(tmp_path / "tree", "x = 1\n")
    (tmp_path / "tree/package/code.py").write_text("changed\n", encoding="utf-8")
    monkeypatch.setenv("PATH", str(tmp_path / "no-programs"))
    source = common.code_source(tmp_path / "tree/package", tmp_path / "tree/benchmarks")
    assert source["dirty"] is None and "git is not installed" in source["unknown"]
    message = refused_message(monkeypatch, source)
    assert "\n" not in message and "cannot tell which commit" in message
    assert "git is not installed" in message and "--allow-dirty" in message


@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="needs to chown a tree")
def test_a_tree_git_refuses_to_read_is_not_taken_for_clean(git_env, tmp_path, monkeypatch) -> None:
    make_tree(tmp_path / "tree", "x = 1\n")
    (tmp_path / "tree/package/code.py").write_text("changed\n", encoding="utf-8")
    for path in [tmp_path / "tree", *(tmp_path / "tree").rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)  # another user's clone
    source = common.code_source(tmp_path / "tree/package", tmp_path / "tree/benchmarks")
    assert source["dirty"] is None and "dubious ownership" in source["unknown"]
    message = refused_message(monkeypatch, source)
    assert "\n" not in message and "dubious ownership" in message


def fake_parsers_run(calls: list[bool]) -> Any:
    def run(quick: bool) -> dict[str, Any]:
        calls.append(quick)
        reply = {"reply": "x", "characters": 1}
        return {"worst_seconds": 0.0, "worst_reply": reply, "median_seconds": 0.0,
                "target_met": True}

    return run


def test_a_script_stops_before_measuring_and_runs_with_allow_dirty(
    dirty_tree, monkeypatch, tmp_path: Path
) -> None:
    from benchmarks import parsers

    calls: list[bool] = []
    monkeypatch.setattr(parsers, "run", fake_parsers_run(calls))
    with pytest.raises(SystemExit):
        parsers.main(["--output-dir", str(tmp_path)])
    assert calls == [] and list(tmp_path.iterdir()) == []

    assert parsers.main(["--allow-dirty", "--output-dir", str(tmp_path)]) == 0
    assert calls == [False]
    result = json.loads((tmp_path / "parsers.json").read_text(encoding="utf-8"))
    assert result["dirty"] is True and result["commit"] == DIRTY["commit"]
    assert "--allow-dirty" not in result["command"]  # it changes no number


def test_a_row_benchmark_stops_before_its_first_run(dirty_tree, monkeypatch) -> None:
    from benchmarks import many_actions, rows

    def no_runs(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        raise AssertionError("a run started on a dirty tree")

    monkeypatch.setattr(rows, "run_rows", no_runs)
    with pytest.raises(SystemExit) as stopped:
        many_actions.main(["--only", "ppo"])
    assert "--allow-dirty" in str(stopped.value.code)


def test_the_harness_checks_its_parts_and_passes_allow_dirty_on(dirty_tree, monkeypatch) -> None:
    import benchmarks.__main__ as harness

    for name in harness.PARTS:
        monkeypatch.setattr(harness._part(name), "run", lambda args: pytest.fail("a part ran"))
    for part in ("throughput", "all"):
        with pytest.raises(SystemExit) as stopped:
            harness.main([part])
        assert "--allow-dirty" in str(stopped.value.code), part

    commands: list[list[str]] = []

    class Done:
        returncode = 0

    def record(command: list[str], **kwargs: Any) -> Done:
        commands.append(command)
        return Done()

    monkeypatch.setattr(harness.subprocess, "run", record)
    assert harness.run_scripts(quick=False, allow_dirty=True) == []
    assert len(commands) == len(harness.SCRIPTS)
    assert all(command[-1] == "--allow-dirty" for command in commands)
    assert any("real_model.py" in command[1] for command in commands)


def test_every_writer_starts_with_the_same_header(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(CLEAN))
    args = common.argparse.Namespace(quick=True, threads=2, output_dir=tmp_path)
    part = common.write_result("part", {"rows": []}, args, "python -m benchmarks part --quick")
    script = common.write_script_result(
        "script", True, tmp_path / "script.json", {"rows": []}, ["--quick", "--allow-dirty"]
    )
    for path, extra in ((part, ["threads"]), (script, [])):
        record = json.loads(path.read_text(encoding="utf-8"))
        assert list(record)[: len(HEADER) + len(extra) + 1] == [*HEADER, *extra, "machine"]
        assert record["commit"] == CLEAN["commit"] and record["dirty"] is False
        assert record["machine"]["cores"] >= 1 and record["rows"] == []
    assert part.name == "part-quick.json"
    assert json.loads(script.read_text(encoding="utf-8"))["command"].endswith(" --quick")


#: The CPU flags a result's speed depends on, which every header must say yes or no to.
NAMED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")


def test_a_header_names_the_commit_the_tree_state_and_the_cpu(monkeypatch) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(DIRTY))
    header = common.result_header("part", "python -m benchmarks part", False)
    assert header["commit"] == DIRTY["commit"] and header["dirty"] is True
    machine = header["machine"]
    assert machine["cpu_model"] == common.cpu_model() and machine["cpu_model"]
    flags = machine["cpu_flags"]
    assert set(NAMED_FLAGS) <= set(common.SPEED_FLAGS) == set(flags)
    assert all(flags[flag] in (True, False, None) for flag in NAMED_FLAGS)
    assert common.header_problems(header) == []


def test_the_cpu_flags_are_all_named_where_they_cannot_be_read(monkeypatch) -> None:
    def unreadable(self, *args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(common.Path, "read_text", unreadable)
    assert common.cpu_flags() == dict.fromkeys(common.SPEED_FLAGS)


def _without(header: dict[str, Any], dotted: str) -> dict[str, Any]:
    """``header`` (a deep copy) without the key at ``dotted`` (``machine.cpu_flags.amx_int8``)."""
    copy = json.loads(json.dumps(header))
    *outer, last = dotted.split(".")
    where = copy
    for key in outer:
        where = where[key]
    del where[last]
    return copy


@pytest.mark.parametrize(
    "dropped",
    ["commit", "dirty", "machine", "machine.cpu_model", "machine.cpu_flags",
     *(f"machine.cpu_flags.{flag}" for flag in NAMED_FLAGS)],
)
def test_the_writer_refuses_a_header_without_a_provenance_field(
    monkeypatch, tmp_path: Path, dropped: str
) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(CLEAN))
    header = _without(common.result_header("part", "python -m benchmarks part", False), dropped)
    path = tmp_path / "part.json"
    with pytest.raises(ValueError, match=rf"no `{dropped}`"):
        common.write_record(path, header, {"rows": []})
    assert not path.exists()


@pytest.mark.parametrize("key", ["commit", "dirty", "machine"])
def test_the_writer_refuses_data_that_overwrites_the_provenance(
    monkeypatch, tmp_path: Path, key: str
) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(CLEAN))
    header = common.result_header("part", "python -m benchmarks part", False)
    with pytest.raises(ValueError, match=f"overwrites `{key}`"):
        common.write_record(tmp_path / "part.json", header, {key: None})


def test_a_written_file_keeps_every_provenance_field(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(common, "source_commit", lambda: dict(CLEAN))
    header = common.result_header("part", "python -m benchmarks part", False)
    record = json.loads(common.write_record(tmp_path / "p.json", header, {"rows": []})
                        .read_text(encoding="utf-8"))
    assert (record["commit"], record["dirty"]) == (CLEAN["commit"], False)
    assert record["machine"]["cpu_model"] == header["machine"]["cpu_model"]
    assert record["machine"]["cpu_flags"] == header["machine"]["cpu_flags"]
    assert set(NAMED_FLAGS) <= set(record["machine"]["cpu_flags"])


def test_a_result_names_the_commit_its_run_started_on(monkeypatch) -> None:
    """A commit made while a long benchmark runs is not the code it loaded: the tree is
    read once, when the run starts, and the result file names that."""
    states = iter([{"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": False}])
    monkeypatch.setattr(common, "code_source", lambda *_: next(states))
    common._source_at_start.cache_clear()
    try:
        common.refuse_dirty_tree("textworld", quick=False, allow_dirty=False)
        header = common.result_header("textworld", "python benchmarks/textworld.py", False)
    finally:
        common._source_at_start.cache_clear()
    assert header["commit"] == "a" * 40
