"""A run directory is data: what `report`, `export`, `eval`, `play --kept` and `run
--resume` read back from one (metrics.jsonl, transcripts.jsonl, plugins.json, the run's
config.yaml, checkpoint.json) is checked on the way in. A malformed file is one line
naming the file and the line or field (exit code 2, nothing on disk changed) where the
command needs it, and one warning where the command goes on without it. What a model, an
env or a file wrote is shown, never obeyed: no raw control character reaches the
terminal, and nothing closes the report's code blocks."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamagym.testing import one_error_line
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.checkpoint.errors import DamagedCheckpointError

FIRST, SECOND = "update-000001", "update-000002"
EVAL = ["-n", "2", "--num-envs", "2"]
ESCAPES = ("\x1b", "\x07", "\x9b", "\x9d")  # ESC, BEL, CSI and OSC as C1 codes
#: Clears the screen, sets the window title and writes the clipboard (OSC 52).
HOSTILE = "\x1b[2J\x1b[H\x1b]0;pwned\x07\x1b]52;c;cm0gLXJmIH4=\x07\x9b31m[red]loud[/red]"


# -- helpers ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    """A finished two-update Blackjack run on the tiny model in generate mode: a
    checkpoint per update, its metrics with a final evaluation, transcripts with replies,
    plugins.json and config.yaml."""
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.testing import tiny_agent
    from llamagym.training.loop.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("trained") / "run"
    agent = tiny_agent(
        BlackjackAgent,
        rollout={"num_envs": 4, "mode": "generate"},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 16, "threads": 1, "eval_episodes": 2},
        output={"dir": str(run_dir), "quiet": True, "checkpoint_every": 1, "report": False},
    )
    Trainer(agent, agent.session).run()
    for name in ("metrics.jsonl", "transcripts.jsonl", "plugins.json", "config.yaml"):
        assert (run_dir / name).is_file()
    return run_dir


@pytest.fixture
def run_dir(trained_run, tmp_path) -> Path:
    """This test's own copy of the trained run."""
    return Path(shutil.copytree(trained_run, tmp_path / "run"))


def snapshot(directory: Path, leave_out: tuple[str, ...] = ()) -> dict[str, str]:
    """Every file under ``directory`` (but those named in ``leave_out``) with the digest
    of its bytes."""
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in leave_out
    }


#: What `llamagym report` writes; everything else stays as it was.
REPORT_FILES = ("report.md", "learning_curve.png")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def lines_of(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


def edit_line(path: Path, number: int, change: Callable[[dict], None]) -> None:
    """Change the JSON record on line ``number`` (from 1) of a JSON-lines file."""
    lines = lines_of(path)
    record = json.loads(lines[number - 1])
    change(record)
    lines[number - 1] = (json.dumps(record) + "\n").encode()
    path.write_bytes(b"".join(lines))


def put_line(path: Path, number: int, raw: bytes) -> None:
    lines = lines_of(path)
    lines.insert(number - 1, raw + b"\n")
    path.write_bytes(b"".join(lines))


def set_field(key: str, value) -> Callable[[dict], None]:
    return lambda record: record.__setitem__(key, value)


# -- metrics.jsonl -----------------------------------------------------------------------
# Line 1 and 2: updates; line 3: the final evaluation.
METRICS_DAMAGE: dict[str, tuple[Callable[[Path], None], int, str]] = {
    "a-json-list": (lambda p: put_line(p, 2, b"[1, 2, 3]"), 2, "holds a JSON list, not an object"),
    "update-x": (lambda p: edit_line(p, 2, set_field("update", "x")), 2, "field 'update'"),
    "binary-garbage": (lambda p: put_line(p, 2, b"\x00\xff\xfe\x9b\x1b[2J" * 20), 2,
                       "is not UTF-8 text"),
    "mean-a-string": (lambda p: edit_line(p, 3, set_field("mean", "high")), 3, "field 'mean'"),
    "baselines-not-a-list": (lambda p: edit_line(p, 3, set_field("baselines", {"random": 1})),
                             3, "field 'baselines'"),
}


def damage_metrics(run_dir: Path, kind: str) -> tuple[Path, str]:
    how, line, words = METRICS_DAMAGE[kind]
    path = run_dir / "metrics.jsonl"
    how(path)
    return path, f"{str(path)!r} line {line} {words}"


@pytest.mark.parametrize("kind", sorted(METRICS_DAMAGE))
def test_report_skips_a_damaged_metrics_record_with_one_warning(kind, run_dir, caplog, cli):
    path, words = damage_metrics(run_dir, kind)
    before = snapshot(run_dir, leave_out=REPORT_FILES)
    code, out, err = cli("report", run_dir)
    assert code == 0, err
    assert "Traceback" not in err
    skipped = [m for m in warnings_of(caplog) if str(path) in m]
    assert len(skipped) == 1 and "\n" not in skipped[0]
    assert "skipped 1 damaged record(s)" in skipped[0] and words.split("' ", 1)[1] in skipped[0]
    text = (run_dir / "report.md").read_text()
    assert "## Training" in text and "\x1b" not in text
    assert snapshot(run_dir, leave_out=REPORT_FILES) == before


@pytest.mark.parametrize("kind", sorted(METRICS_DAMAGE))
def test_resume_refuses_a_damaged_metrics_file_in_one_line(kind, run_dir, cli) -> None:
    _, words = damage_metrics(run_dir, kind)
    before = snapshot(run_dir)
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 2
    line = one_error_line(err)
    assert words in line and "restore it from a copy, or delete that line" in line
    assert "\x1b" not in line
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("kind", ["a-json-list", "mean-a-string", "baselines-not-a-list"])
def test_export_refuses_a_damaged_metrics_file_in_one_line(kind, run_dir, tmp_path, cli):
    _, words = damage_metrics(run_dir, kind)
    before = snapshot(run_dir)
    code, _, err = cli("export", run_dir, "--to", tmp_path / "exported")
    assert code == 2
    assert words in one_error_line(err)
    assert not (tmp_path / "exported").exists() and snapshot(run_dir) == before


def test_a_torn_last_line_is_skipped_everywhere(run_dir, caplog, cli) -> None:
    path = run_dir / "metrics.jsonl"
    path.write_bytes(path.read_bytes() + b'{"kind": "upd')  # a crash mid-write
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet", "-n", "24")
    assert code == 0, err
    assert any("line 4 is cut short" in m for m in warnings_of(caplog))


def test_a_metrics_line_of_100_mb_is_never_held_in_memory(tmp_path, caplog) -> None:
    import tracemalloc

    from llamagym.training.records.run_files import read_metrics

    path = tmp_path / "metrics.jsonl"
    good = json.dumps({"kind": "update", "update": 1}).encode()
    with path.open("wb") as handle:
        handle.write(b'{"kind": "update", "update": 0, "x": "')
        block = b"a" * (1 << 20)
        for _ in range(100):
            handle.write(block)
        handle.write(b'"}\n' + good + b"\n")
    tracemalloc.start()
    try:
        records = read_metrics(path, on_damage="skip")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert records == [{"kind": "update", "update": 1}]
    assert peak < 16 << 20
    assert any("line 1 is longer than 1,048,576 bytes" in m for m in warnings_of(caplog))


def test_a_metrics_file_of_hundreds_of_mb_is_refused_unread(run_dir, cli) -> None:
    path = run_dir / "metrics.jsonl"
    with path.open("r+b") as handle:
        handle.truncate(600 << 20)  # sparse: costs no disk
    started = time.perf_counter()
    code, _, err = cli("report", run_dir)
    assert code == 2 and time.perf_counter() - started < 30
    line = one_error_line(err)
    assert f"{str(path)!r} is 629,145,600 bytes, more than the" in line


def test_a_damaged_metrics_file_is_a_typed_error_from_python(tmp_path) -> None:
    from llamagym.errors import LlamaGymError, RunFileError
    from llamagym.training.records.run_files import read_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"kind": "update", "update": "x"}\n')
    with pytest.raises(RunFileError) as raised:
        read_metrics(path)
    assert isinstance(raised.value, LlamaGymError)
    assert "line 1 field 'update': Input should be a valid integer, got 'x'" in str(raised.value)
    assert read_metrics(path, on_damage="skip") == []


# -- plugins.json and config.yaml ---------------------------------------------------------
def test_report_goes_on_without_a_plugins_record_that_is_an_object(run_dir, caplog, cli):
    path = run_dir / "plugins.json"
    path.write_text(json.dumps({"name": "agent", "hooks": ["x"]}))
    code, _, err = cli("report", run_dir)
    assert code == 0, err
    [warning] = [m for m in warnings_of(caplog) if str(path) in m]
    assert "holds a JSON object, expected a list of plugins" in warning
    text = (run_dir / "report.md").read_text()
    assert "## Training" in text and "## Plugins" not in text


def test_report_goes_on_without_a_run_config_that_is_a_list(run_dir, caplog, cli) -> None:
    path = run_dir / "config.yaml"
    path.write_text("- agent\n- model\n")
    code, _, err = cli("report", run_dir)
    assert code == 0, err
    [warning] = [m for m in warnings_of(caplog) if str(path) in m]
    assert "holds a list, not a mapping of sections" in warning
    assert "config.yaml not found" in (run_dir / "report.md").read_text()


def test_report_refuses_a_yaml_alias_bomb_at_once(run_dir) -> None:
    """The report command in a process of its own: without the bound it never returns."""
    from llamagym.errors import RunFileError
    from llamagym.training.records.run_files import read_run_config

    bomb = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for level in range(1, 10):  # 10**10 values once expanded
        bomb.append(f"{chr(97 + level)}: &{chr(97 + level)} " + "[" + ", ".join(
            [f"*{chr(96 + level)}"] * 10) + "]")
    path = run_dir / "config.yaml"
    path.write_text("\n".join(bomb) + "\n")
    started = time.perf_counter()
    with pytest.raises(RunFileError, match="more than 100,000 keys and values"):
        read_run_config(path)
    assert time.perf_counter() - started < 30  # unbounded: 10**10 values, never
    done = subprocess.run(
        [sys.executable, "-m", "llamagym.cli", "report", str(run_dir)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "more than 100,000 keys and values" in done.stderr
    assert "config.yaml not found" in (run_dir / "report.md").read_text()


# -- checkpoint.json counters -------------------------------------------------------------
COUNTERS_DAMAGE = {
    "updates-x": (("counters", "updates"), "x", "field 'counters.updates'"),
    "episodes-many": (("episodes",), "many", "field 'episodes'"),
}


def damage_counters(run_dir: Path, kind: str) -> str:
    """Every checkpoint of the run gets the same wrong counter."""
    keys, value, words = COUNTERS_DAMAGE[kind]
    for checkpoint in checkpoints.list_checkpoints(run_dir):
        meta = json.loads((checkpoint / checkpoints.META).read_text())
        node = meta
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
        (checkpoint / checkpoints.META).write_text(json.dumps(meta))
    return words


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
@pytest.mark.parametrize("kind", sorted(COUNTERS_DAMAGE))
def test_checkpoint_counters_of_the_wrong_type_are_one_line(kind, command, run_dir, tmp_path,
                                                            cli):
    words = damage_counters(run_dir, kind)
    before = snapshot(run_dir)
    arguments = {
        "eval": ("eval", "blackjack", "--checkpoint", run_dir, *EVAL),
        "export": ("export", run_dir, "--to", tmp_path / "exported"),
        "resume": ("run", "blackjack", "--resume", run_dir, "--quiet"),
    }[command]
    code, _, err = cli(*arguments)
    assert code == 2
    line = one_error_line(err)
    assert "holds no intact checkpoint" in line and words in line
    assert snapshot(run_dir) == before


def test_checkpoint_counters_of_the_wrong_type_are_a_typed_error_from_python(run_dir) -> None:
    from llamagym import load_agent

    damage_counters(run_dir, "episodes-many")
    with pytest.raises(DamagedCheckpointError, match="field 'episodes'"):
        load_agent(run_dir / checkpoints.CHECKPOINTS / SECOND)


# -- transcripts.jsonl --------------------------------------------------------------------
def test_play_kept_skips_a_transcript_whose_reward_is_text(run_dir, caplog, cli) -> None:
    path = run_dir / "transcripts.jsonl"
    count = len(lines_of(path))

    def reward_abc(record: dict) -> None:
        record["turns"][0]["reward"] = "abc"

    edit_line(path, count, reward_abc)
    before = snapshot(run_dir)
    code, out, err = cli("play", run_dir, "--kept", "-n", "2")
    assert code == 0, err
    assert out.count("return:") == 2  # the last two that can be read
    [warning] = [m for m in warnings_of(caplog) if str(path) in m]
    assert f"line {count} field 'turns.0.reward'" in warning and "'abc'" in warning
    code, _, err = cli("report", run_dir)
    assert code == 0, err
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--quiet")
    assert code == 2
    assert f"{str(path)!r} line {count} field 'turns.0.reward'" in one_error_line(err)
    assert snapshot(run_dir, leave_out=REPORT_FILES) == before


def test_play_kept_of_transcripts_none_can_read_is_one_line(run_dir, cli) -> None:
    (run_dir / "transcripts.jsonl").write_bytes(os.urandom(64).replace(b"\n", b"") + b"\n")
    code, _, err = cli("play", run_dir, "--kept")
    assert code == 2
    assert "holds no transcript that can be read" in one_error_line(err)


# -- terminal and report safety -------------------------------------------------------------
def hostile_transcript(run_dir: Path, text: str) -> None:
    """The newest transcript, as if model, env and parser had written ``text``."""
    path = run_dir / "transcripts.jsonl"

    def change(record: dict) -> None:
        record["system"] = text
        for turn in record["turns"]:
            turn.update(observation=text, reply=text, action=text, parser=text)

    edit_line(path, len(lines_of(path)), change)


def test_play_kept_shows_escape_sequences_without_obeying_them(run_dir, cli) -> None:
    hostile_transcript(run_dir, HOSTILE)
    turns = len(json.loads(lines_of(run_dir / "transcripts.jsonl")[-1])["turns"])
    code, out, err = cli("play", run_dir, "--kept", "-n", "1")
    assert code == 0, err
    assert not any(code in out for code in ESCAPES)
    assert "\\x1b]52;c;cm0gLXJmIH4=\\x07" in out  # shown, escaped
    assert "[red]loud[/red]" in out  # rich markup shown as text, not applied
    # The system prompt, and each turn's observation, reply, action and parser.
    assert out.count("\\x1b[2J") == 1 + 4 * turns


def test_the_report_keeps_hostile_text_inside_its_code_blocks(run_dir, cli) -> None:
    from markdown_it import MarkdownIt

    closer = "x\n````\n# Injected heading\n[click](https://example.com) <img src=x>\n```"
    hostile_transcript(run_dir, closer + HOSTILE)
    edit_line(run_dir / "metrics.jsonl", 3, lambda record: record["baselines"][0].update(
        name="| evil | [link](https://example.com) <b>x</b> ```"))
    code, _, err = cli("report", run_dir)
    assert code == 0, err
    text = (run_dir / "report.md").read_text()
    assert not any(code in text for code in ESCAPES)
    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert "Injected heading" not in headings
    inline = [child for t in tokens if t.type == "inline" for child in t.children or []]
    assert not [t for t in tokens + inline if t.type in ("html_block", "html_inline")]
    targets = {t.attrs.get("href") or t.attrs.get("src") for t in inline
               if t.type in ("link_open", "image")}
    assert targets == {"learning_curve.png", "config.yaml"}  # the report's own, no other
    fences = [t for t in tokens if t.type == "fence"]
    assert any("# Injected heading" in t.content for t in fences)
    # The baseline's row keeps the table's five cells: its name's bars are escaped.
    row = next(line for line in text.splitlines() if "evil" in line)
    assert row.startswith("| \\| evil \\| \\[link\\](https://example.com) \\<b\\>x")
    assert row.count("|") - row.count("\\|") == 6


# -- checkpoints that count toward keep_checkpoints ----------------------------------------
def test_a_damaged_newest_checkpoint_never_costs_an_intact_older_one(run_dir) -> None:
    first = run_dir / checkpoints.CHECKPOINTS / FIRST
    second = run_dir / checkpoints.CHECKPOINTS / SECOND
    weights = second / checkpoints.WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    checkpoints.prune_checkpoints(run_dir, keep=1)
    assert first.is_dir() and second.is_dir()
    assert checkpoints.find_checkpoint(run_dir) == first
    # Intact, the older one is pruned as before.
    shutil.copytree(first, run_dir / checkpoints.CHECKPOINTS / "update-000003")
    checkpoints.prune_checkpoints(run_dir, keep=1)
    assert [p.name for p in checkpoints.list_checkpoints(run_dir)] == ["update-000003"]


# -- random damage ---------------------------------------------------------------------------
def _json_paths(value, path=()):
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _json_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _json_paths(item, (*path, index))


OTHER_VALUES = ["x", -1, 2.5, None, True, [], {}, [1, "a"], {"k": "v"}, 10**30, "\x1b[2J"]


def _mutate_json(value, rng: random.Random):
    """``value`` with one randomly chosen part given another type, or deleted."""
    paths = [p for p in _json_paths(value) if p]
    if not paths:
        return rng.choice(OTHER_VALUES)
    path = rng.choice(paths)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(OTHER_VALUES)
    return value


def mutate(data: bytes, how: str, rng: random.Random) -> bytes:
    if how == "truncate":
        return data[: rng.randrange(len(data) + 1)]
    if how == "flip bytes":
        changed = bytearray(data)
        for _ in range(rng.randint(1, 8)):
            changed[rng.randrange(len(changed))] = rng.randrange(256)
        return bytes(changed)
    if how == "garbage line":
        lines = data.splitlines(keepends=True)
        garbage = bytes(rng.randrange(256) for _ in range(rng.randint(1, 80)))
        lines.insert(rng.randrange(len(lines) + 1), garbage.replace(b"\n", b"") + b"\n")
        return b"".join(lines)
    # "change a JSON value": one line of a JSON-lines file, or the whole JSON file
    lines = data.splitlines(keepends=True)
    index = rng.randrange(len(lines)) if len(lines) > 1 else 0
    try:
        value = json.loads(lines[index])
    except ValueError:
        return data
    lines[index] = (json.dumps(_mutate_json(value, rng)) + "\n").encode()
    return b"".join(lines)


#: Each run file and the commands that read it.
READERS = {
    "metrics.jsonl": ("report", "export", "resume"),
    "transcripts.jsonl": ("report", "play", "resume"),
    "plugins.json": ("report",),
    "config.yaml": ("report",),
    f"checkpoints/{SECOND}/checkpoint.json": ("eval", "export", "resume"),
}


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    file=st.sampled_from(sorted(READERS)),
    how=st.sampled_from(["truncate", "flip bytes", "garbage line", "change a JSON value"]),
    seed=st.integers(0, 2**32 - 1),
)
@pytest.mark.slow  # many damaged files, each read
def test_random_damage_to_run_files_is_never_a_traceback(trained_run, tmp_path, cli, file,
                                                         how, seed) -> None:
    run_dir = Path(tempfile.mkdtemp(dir=tmp_path)) / "run"  # one per example
    shutil.copytree(trained_run, run_dir)
    path = run_dir / file
    path.write_bytes(mutate(path.read_bytes(), how, random.Random(seed)))
    for command in READERS[file]:
        arguments = {
            "report": ("report", run_dir),
            "play": ("play", run_dir, "--kept"),
            "eval": ("eval", "blackjack", "--checkpoint", run_dir, *EVAL),
            "export": ("export", run_dir, "--to", run_dir.parent / "exported", "--overwrite"),
            "resume": ("run", "blackjack", "--resume", run_dir, "--quiet"),
        }[command]
        code, out, err = cli(*arguments)  # an exception other than exit would fail here
        assert code in (0, 2), (command, file, how, seed, err)
        assert "Traceback" not in out + err
        if code == 2:
            one_error_line(err)


# -- a run writes only inside its own directory --------------------------------------------
#: Every file and folder a run writes in its directory, and what may stand there instead.
OWN_FILES = (".llamagym.writer", ".llamagym.lock", "metrics.jsonl", "transcripts.jsonl",
             "plugins.json", "config.yaml", "report.md", "learning_curve.png")
OWN_FOLDERS = ("checkpoints", f"checkpoints/{SECOND}", ".ranks", "tensorboard")
RESUME = ("run", "blackjack", "--quiet", "--episodes", "24")  # one more update


@contextlib.contextmanager
def at_most(seconds: int) -> Iterator[None]:
    """Fails the test, instead of hanging it, when the body blocks (on a FIFO, say)."""

    def blocked(signum, frame):
        raise AssertionError(f"blocked for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def put_in_place(path: Path, kind: str, outside: Path, folder: bool) -> str:
    """Put a ``kind`` at ``path`` instead of what was there: a link to a file or folder
    in ``outside`` (a copy of what was there, as another run's would be), a link to
    nothing there yet, or a FIFO. Returns what the refusal calls it."""
    target = outside / ("victim" if kind == "link" else "nothing-yet")
    if kind == "link" and folder:
        shutil.copytree(path, target) if path.is_dir() else target.mkdir()
    elif kind == "link":
        shutil.copy(path, target) if path.is_file() else target.write_text("precious\n")
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
        return "a FIFO"
    path.symlink_to(target)
    return f"a symbolic link (to {str(target)!r})"


def everything_under(root: Path) -> dict[str, bytes]:
    """Each file under ``root`` (links not followed, FIFOs not opened) and its bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            found[str(path.relative_to(root))] = f"-> {os.readlink(path)}".encode()
        elif path.is_file():
            found[str(path.relative_to(root))] = path.read_bytes()
    return found


#: (name, what stands there): a link out of the run (to a file or folder, as another
#: run's would be, or to nothing yet), or a FIFO where a file belongs.
PLANTED = [(name, kind) for name in OWN_FILES for kind in ("link", "dangling-link", "fifo")]
PLANTED += [(name, kind) for name in OWN_FOLDERS for kind in ("link", "dangling-link")]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
@pytest.mark.parametrize(("name", "kind"), PLANTED)
def test_resume_writes_through_no_link_and_waits_on_no_fifo(name, kind, run_dir, tmp_path,
                                                            cli) -> None:
    """Whatever stands where a run's own file or folder belongs (a link out of the run,
    to a file or to nothing yet, or a FIFO) is refused in one line naming it, at once,
    and nothing is written, in the run or outside it."""
    folder = name in OWN_FOLDERS
    outside = tmp_path / "outside"
    outside.mkdir()
    what = put_in_place(run_dir / name, kind, outside, folder)
    before, elsewhere = everything_under(run_dir), everything_under(outside)
    with at_most(60):
        code, out, err = cli(*RESUME, "--resume", run_dir)
    assert code == 2, out + err
    line = one_error_line(err)
    assert f"{str(run_dir / name)!r} is {what}" in line
    assert "remove it or put a real" in line
    assert everything_under(run_dir) == before and everything_under(outside) == elsewhere


@pytest.mark.parametrize("name", ["metrics.jsonl", ".ranks", "checkpoints"])
def test_a_new_run_writes_through_no_link_out_of_its_directory(name, tmp_path, cli) -> None:
    """A link to a place that does not exist yet, in the directory a new run is given:
    the run would have created its file (or folder) there."""
    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    outside.mkdir()
    (run_dir / name).symlink_to(outside / "made-by-the-run")
    code, out, err = cli("run", "blackjack", "--num-envs", "4", "--episodes", "8", "--quiet",
                         "--set", "output.rank_records=true", "-o", run_dir)
    assert code == 2, out + err
    assert f"{str(run_dir / name)!r} is a symbolic link" in one_error_line(err)
    assert list(outside.iterdir()) == [] and [p.name for p in run_dir.iterdir()] == [name]


def test_a_metrics_line_is_never_appended_through_a_link(tmp_path) -> None:
    """The one place run files are appended to opens them with O_NOFOLLOW: a link put in
    place after every check is refused too."""
    from llamagym.errors import UnsafeFileError
    from llamagym.paths import append_line

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(UnsafeFileError, match="is a symbolic link"):
        append_line(tmp_path / "metrics.jsonl", "{}\n")
    assert victim.read_text() == "precious\n"


def test_resume_removes_what_an_interrupted_write_left(run_dir, cli) -> None:
    """A run killed while it replaced a file leaves its hidden temporary copy; the next
    writer of the directory (holding its lock) removes every one, and nothing else."""
    left = [".transcripts.jsonl.k3j4h5g6.tmp", ".config.yaml.abcdefgh.tmp",
            ".plugins.json.a_b_c_d_.tmp", ".llamagym-write-test.zzzz1234.tmp"]
    for name in left:
        (run_dir / name).write_text('{"half": ')
    mine = [".my-notes.tmp", ".notes.abcdefgh.tmp"]  # names LlamaGym does not write
    for name in mine:
        (run_dir / name).write_text("mine\n")
    code, out, err = cli(*RESUME, "--eval-episodes", "0", "--resume", run_dir)
    assert code == 0, out + err
    assert not [name for name in left if (run_dir / name).exists()]
    assert all((run_dir / name).read_text() == "mine\n" for name in mine)
