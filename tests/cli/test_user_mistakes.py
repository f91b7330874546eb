"""Every mistake a user can make in a config or on the command line is one line on
stderr naming the problem and the fix, exit code 2, no traceback, and nothing on disk
changed: hostile or broken config files and ``--set`` values (aliases that expand to
billions, runaway nesting, binary data, bad syntax), seeds numpy cannot take,
non-finite or absurd floats, odd agent names, environments no package registers and
run directories that cannot be written."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from llamagym import hookimpl
from llamagym.agent import Agent
from llamagym.cli.run_commands import resolve_run_config
from llamagym.config import MAX_SEED
from llamagym.config.files import (
    MAX_CONFIG_BYTES,
    MAX_CONFIG_DEPTH,
    MAX_CONFIG_VALUES,
    parse_assignment,
    read_config_file,
)
from llamagym.errors import ConfigError
from llamagym.training.loop.run_directory import default_output_dir

DEEP = 100_000  # levels of nesting that overflowed the parsers' stacks
ALGORITHMS = ["ppo", "grpo", "rloo", "reinforce"]
FAST = [
    "--num-envs", "4", "--episodes", "16", "--eval-episodes", "0",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.epochs=1",
]


def one_error(result: tuple[int, str, str]) -> str:
    """The one error line of a refused command (plugin warnings aside)."""
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line and not line.startswith("warning:")]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    return lines[0]


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    """Every file and folder under ``root`` with its modification time and content."""
    return {
        str(path.relative_to(root)): (
            path.stat().st_mtime_ns,
            path.read_bytes() if path.is_file() else b"<dir>",
        )
        for path in sorted(root.rglob("*"))
    }


def billion_laughs(levels: int = 9, width: int = 10) -> str:
    """About 600 bytes of YAML that expand to ``width ** levels`` strings."""
    lines = ['lol0: &lol0 "lol"']
    for level in range(1, levels + 1):
        aliases = ", ".join([f"*lol{level - 1}"] * width)
        lines.append(f"lol{level}: &lol{level} [{aliases}]")
    return "\n".join(lines) + "\n"


# -- 1. what a config may expand to ------------------------------------------------------
def test_a_billion_laughs_file_is_refused_at_once(tmp_path, cli) -> None:
    path = tmp_path / "laughs.yaml"
    path.write_text(billion_laughs())
    assert path.stat().st_size < 1024
    before = snapshot(tmp_path)
    started = time.perf_counter()
    line = one_error(cli("run", "blackjack", "--config", path, "-o", tmp_path / "run"))
    assert time.perf_counter() - started < 30  # it used to hang, expanding 10**9 values
    assert f"config file {str(path)!r}" in line
    assert f"more than {MAX_CONFIG_VALUES:,} keys and values" in line
    assert "aliases" in line and "without aliases" in line  # the problem and the fix
    assert snapshot(tmp_path) == before


def test_a_billion_laughs_set_value_is_refused(cli) -> None:
    anchors = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for level in range(1, 9):
        anchors.append(f"&a{level} [" + ", ".join([f"*a{level - 1}"] * 10) + "]")
    line = one_error(cli("config", "show", "blackjack", "--set", f"agent.x=[{', '.join(anchors)}]"))
    assert line.startswith("error: --set 'agent.x=[&a0") and "aliases" in line


def test_a_self_referring_alias_is_refused(tmp_path) -> None:
    path = tmp_path / "loop.yaml"
    path.write_text("agent: &a {x: *a}\n")
    with pytest.raises(ConfigError, match=r"the alias \*a refers to a value that holds it"):
        read_config_file(path)


def test_aliases_within_the_limit_still_work(tmp_path) -> None:
    path = tmp_path / "aliases.yaml"
    path.write_text("rollout: {temperature: &t 0.7, final_temperature: *t}\n")
    _, resolved = resolve_run_config("blackjack", path, [], {})
    assert resolved.config.rollout.final_temperature == 0.7


@pytest.mark.parametrize(
    ("suffix", "text"),
    [
        (".yaml", "agent: {x: " + "[" * DEEP + "]" * DEEP + "}\n"),
        (".json", '{"agent": {"x": ' + "[" * DEEP + "]" * DEEP + "}}"),
        (".toml", "[agent]\nx = " + "[" * DEEP + "]" * DEEP + "\n"),
        (".toml", "[" + ".".join(["a"] * 1000) + "]\nx = 1\n"),  # nested by dotted keys
    ],
)
def test_deeply_nested_files_are_one_line(suffix, text, tmp_path, cli) -> None:
    path = tmp_path / f"deep{suffix}"
    path.write_text(text)
    before = snapshot(tmp_path)
    line = one_error(cli("run", "blackjack", "--config", path, "-o", tmp_path / "run"))
    assert f"config file {str(path)!r} nests deeper than {MAX_CONFIG_DEPTH} levels" in line
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize(
    "assignment",
    ["agent.x=" + "[" * DEEP + "]" * DEEP, "agent.x=" + "{a: " * 2000 + "1" + "}" * 2000,
     ".".join(["agent"] * 100) + "=1"],
    ids=["deep-list", "deep-mapping", "deep-key"],
)
def test_deeply_nested_set_values_are_one_line(assignment, cli) -> None:
    line = one_error(cli("config", "show", "blackjack", "--set", assignment))
    assert line.startswith("error: --set '") and f"deeper than {MAX_CONFIG_DEPTH} levels" in line


def test_the_depth_limit_is_exact(tmp_path) -> None:
    # {"agent": {"x": [[...]]}}: two mappings, then the lists.
    within = "agent.x=" + "[" * (MAX_CONFIG_DEPTH - 2) + "]" * (MAX_CONFIG_DEPTH - 2)
    parse_assignment(within)
    beyond = "agent.x=" + "[" * (MAX_CONFIG_DEPTH - 1) + "]" * (MAX_CONFIG_DEPTH - 1)
    with pytest.raises(ConfigError, match="nests deeper than 64 levels"):
        parse_assignment(beyond)
    for suffix, template in [(".json", '{"x": %s}'), (".yaml", "x: %s\n")]:
        path = tmp_path / f"nested{suffix}"
        lists = MAX_CONFIG_DEPTH - 1
        path.write_text(template % ("[" * lists + "]" * lists))
        read_config_file(path)
        path.write_text(template % ("[" * (lists + 1) + "]" * (lists + 1)))
        with pytest.raises(ConfigError, match="nests deeper than 64 levels"):
            read_config_file(path)


def test_too_many_values_or_bytes(tmp_path) -> None:
    many = tmp_path / "many.json"
    many.write_text(json.dumps({"agent": {"x": [0] * MAX_CONFIG_VALUES}}))
    with pytest.raises(ConfigError, match=f"more than {MAX_CONFIG_VALUES:,} keys and values"):
        read_config_file(many)
    large = tmp_path / "large.yaml"
    large.write_text("agent:\n  x: '" + "x" * MAX_CONFIG_BYTES + "'\n")
    with pytest.raises(ConfigError, match=f"larger than {MAX_CONFIG_BYTES:,} bytes"):
        read_config_file(large)


# -- 2. syntax, encoding and shape ---------------------------------------------------------
def test_a_set_value_that_is_not_yaml_names_the_item_and_the_fix(tmp_path, cli) -> None:
    output = tmp_path / "run"
    line = one_error(cli("run", "blackjack", "--set", "algorithm.lr=[", "-o", output))
    assert line.startswith("error: --set 'algorithm.lr=[': the value is not valid YAML")
    assert "put quotes around text" in line
    assert not output.exists()


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (bytes(range(256)) * 4, "holds binary data (a NUL byte at offset 0)"),
        ('rollout: {reply_prefix: "café"}\n'.encode("latin-1"), "is not UTF-8 text"),
        (b"- 1\n- 2\n", "holds a list, not a mapping of sections"),
        (b"hello\n", "holds the single value 'hello', not a mapping of sections"),
        (b"rollout:\n  num_envs: [4\n  mode: score\n", "is not valid YAML (line 3"),
        (b"x: 2001-13-45\n", "is not valid YAML (month must be in 1..12)"),
    ],
    ids=["binary", "latin-1", "list", "scalar", "syntax", "no-such-date"],
)
def test_unusable_config_files_are_one_line(content, says, tmp_path, cli) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    before = snapshot(tmp_path)
    line = one_error(cli("run", "blackjack", "--config", path, "-o", tmp_path / "run"))
    assert line.startswith(f"error: config file {str(path)!r} {says}"), line
    fixes = ("save it as UTF-8", "pass the config file itself", "write sections such as",
             "correct it there")
    assert any(fix in line for fix in fixes)
    assert snapshot(tmp_path) == before


def test_a_folder_given_as_config_file(tmp_path, cli) -> None:
    line = one_error(cli("config", "show", "blackjack", "--config", tmp_path))
    assert "is not a file; pass a YAML, TOML or JSON config file" in line


# -- 3. seeds and floats -------------------------------------------------------------------
@pytest.mark.parametrize(
    "arguments",
    [["--seed", "-1"], ["--set", "training.seed=-1"], ["--seed", str(MAX_SEED + 1)]],
)
def test_a_seed_numpy_cannot_take_is_refused(arguments, tmp_path, cli) -> None:
    output = tmp_path / "run"
    line = one_error(cli("run", "blackjack", "-o", output, *arguments))
    assert line.startswith("error: training.seed: got ")
    assert f"a seed must be from 0 to {MAX_SEED} (2**32 - 1" in line
    assert not output.exists()


def test_the_largest_seed_is_taken(cli) -> None:
    code, out, _ = cli("config", "show", "blackjack", "--set", f"training.seed={MAX_SEED}")
    assert code == 0 and f"seed: {MAX_SEED}" in out


@pytest.mark.parametrize(
    "command", [["record", "blackjack", "-b", "random"], ["check", "blackjack"]]
)
def test_other_commands_refuse_a_bad_seed_too(command, tmp_path, cli) -> None:
    output = tmp_path / "demos.jsonl"
    arguments = [*command, "--seed", "-1"] + (["-o", output] if command[0] == "record" else [])
    line = one_error(cli(*arguments))
    assert line.startswith("error: --seed: got -1; a seed must be from 0 to")
    assert not output.exists()


def test_check_refuses_a_bad_set_value_as_the_users_mistake(cli) -> None:
    line = one_error(cli("check", "blackjack", "--set", "algorithm.lr=-1"))
    assert line.startswith("error: algorithm.lr: got -1;"), line


def test_a_long_bad_value_is_shown_cut_with_its_length(cli) -> None:
    line = one_error(cli("check", "blackjack", "--set", "rollout.mode=" + "x" * 5000))
    assert line.startswith("error: rollout.mode: got 'xxx"), line
    assert "(5,000 characters)" in line and len(line) < 300, line


def resolve(algorithm: str, assignment: str) -> None:
    resolve_run_config("blackjack", None, [assignment], {"algorithm.name": algorithm})


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("key", ["lr", "warm_start.lr", "kl_coef", "clip_range", "max_grad_norm"])
@pytest.mark.parametrize("value", [".inf", "inf", "-.inf", ".nan", "nan"])
def test_non_finite_algorithm_floats_are_refused(algorithm, key, value) -> None:
    with pytest.raises(ConfigError) as refused:
        resolve(algorithm, f"algorithm.{key}={value}")
    message = str(refused.value)
    assert message.startswith(f"algorithm.{key}: got ") and "must be a finite number" in message


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("key", ["lr", "warm_start.lr"])
@pytest.mark.parametrize("value", ["1e308", "1.0e+308", "11"])
def test_absurd_learning_rates_are_refused(algorithm, key, value) -> None:
    with pytest.raises(ConfigError, match=rf"^algorithm\.{key}: got .*less than or equal to 10"):
        resolve(algorithm, f"algorithm.{key}={value}")


@pytest.mark.parametrize(
    "assignment",
    ["rollout.temperature=.inf", "training.minutes=.nan", "rollout.invalid_action.penalty=-.inf",
     "rollout.top_p=nan"],
)
def test_non_finite_run_settings_are_refused(assignment) -> None:
    with pytest.raises(ConfigError, match="must be a finite number"):
        resolve_run_config("blackjack", None, [assignment], {})


def test_a_non_finite_learning_rate_on_the_command_line(tmp_path, cli) -> None:
    output = tmp_path / "run"
    line = one_error(cli("run", "blackjack", "--set", "algorithm.lr=inf", "-o", output))
    assert line == "error: algorithm.lr: got 'inf'; must be a finite number"
    assert not output.exists()
    code, out, _ = cli("config", "show", "blackjack", "--set", "algorithm.lr=1e-4")
    assert code == 0 and "lr: 0.0001  # from --set" in out


# -- 4. names, environments and run directories ---------------------------------------------
@pytest.mark.parametrize("name", ["weird name/../x", "../../etc", "/abs/path", "...", "", "a\\b:c"])
def test_the_default_run_directory_is_one_plain_folder(name) -> None:
    directory = default_output_dir(name)
    assert directory.parent == Path("runs")
    assert re.fullmatch(r"[A-Za-z0-9_-]+-\d{8}-\d{6}", directory.name), directory


def test_an_agent_name_that_is_a_path_is_refused(tmp_path, monkeypatch, cli) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_error(cli("run", "x/../y"))
    assert "unknown agent 'x/../y'" in line and "blackjack" in line
    assert list(tmp_path.iterdir()) == []


class GhostAgent(Agent):
    """An agent whose environment no installed package registers (default make_env)."""

    action_names = ("left", "right")


class GhostPlugin:
    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register("ghost", f"{__name__}:GhostAgent", env_id="LlamaGymNoSuchEnv-v0")


def test_an_agent_whose_env_is_not_registered(tmp_path, monkeypatch, register_plugin, cli) -> None:
    register_plugin(GhostPlugin(), "ghost-plugin")
    monkeypatch.chdir(tmp_path)
    line = one_error(cli("run", "ghost", *FAST))
    assert "agent 'ghost'" in line and "'LlamaGymNoSuchEnv-v0'" in line
    assert "install the package that registers it" in line and "llamagym list" in line
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, no run directory


@pytest.fixture
def locked(tmp_path):
    """``locked(path)`` makes a directory read-only (immutable for root) until the test
    ends; skips where neither is possible."""
    undo: list[list[str]] = []

    def lock(path: Path) -> None:
        if os.geteuid() != 0:
            path.chmod(0o555)
            undo.append(["chmod", "755", str(path)])
            return
        done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
        if done.returncode != 0:
            pytest.skip("root cannot make a directory read-only here (no chattr)")
        undo.append(["chattr", "-i", str(path)])

    yield lock
    for command in undo:
        subprocess.run(command, check=False)


def test_resuming_in_a_read_only_run_directory(tmp_path, locked, cli) -> None:
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, "-o", run_dir)
    assert code == 0, err
    locked(run_dir)
    before = snapshot(run_dir)
    line = one_error(cli("run", "blackjack", "--resume", run_dir, *FAST[:2], "-n", "32"))
    assert f"run directory {str(run_dir)!r} cannot be written" in line
    assert "make it writable, or continue the run elsewhere with --output NEW_DIR" in line
    assert snapshot(run_dir) == before


def test_a_file_in_the_way_of_the_run_directory(tmp_path, cli) -> None:
    in_the_way = tmp_path / "run"
    in_the_way.write_text("notes\n")
    line = one_error(cli("run", "blackjack", *FAST, "-o", in_the_way))
    assert f"run directory {str(in_the_way)!r}" in line and "choose another --output" in line
    assert in_the_way.read_text() == "notes\n"


# -- paths no command can use ------------------------------------------------------------
def bad_path(kind: str, root: Path) -> Path:
    """A path under ``root`` that no command can use: a name of 300 bytes (the limit is
    255), a symbolic link that leads to itself, or a file where a folder belongs."""
    if kind == "too-long":
        return root / ("x" * 300) / "run"
    if kind == "link-loop":
        (root / "loop").symlink_to(root / "loop")
        return root / "loop" / "run"
    (root / "a-file").write_text("notes\n")
    return root / "a-file" / "run"


#: Every command that takes a path, with the path at each place it takes one.
PATH_COMMANDS = {
    "run --model": lambda p, out: ("run", "blackjack", *FAST, "--model", p, "-o", out),
    "run --config": lambda p, out: ("run", "blackjack", *FAST, "--config", p, "-o", out),
    "run --output": lambda p, out: ("run", "blackjack", *FAST, "-o", p),
    "run --resume": lambda p, out: ("run", "blackjack", *FAST, "--resume", p),
    "run demonstrations": lambda p, out: (
        "run", "blackjack", *FAST, "--set", f"algorithm.warm_start.demonstrations={p}",
        "-o", out),
    "eval --checkpoint": lambda p, out: ("eval", "blackjack", "--checkpoint", p, "-n", "2"),
    "eval --model": lambda p, out: ("eval", "blackjack", "--model", p, "-n", "2"),
    "config show --config": lambda p, out: ("config", "show", "blackjack", "--config", p),
    "record --output": lambda p, out: ("record", "blackjack", "-b", "random", "-n", "2",
                                       "-o", p),
    "record --config": lambda p, out: ("record", "blackjack", "-b", "random", "-n", "2",
                                       "-o", out, "--config", p),
    "play": lambda p, out: ("play", p, "-n", "1"),
    "play --kept": lambda p, out: ("play", p, "--kept"),
    "report": lambda p, out: ("report", p),
    "export": lambda p, out: ("export", p, "--to", out),
    "export --to": lambda p, out: ("export", out, "--to", p),
    "export --checkpoint": lambda p, out: ("export", p, "--to", out, "--checkpoint", "1"),
    "new-plugin --dir": lambda p, out: ("new-plugin", "lake", "--dir", p),
}


def everything_in(root: Path) -> dict[str, str]:
    """Each entry under ``root``, links not followed, with what it is or holds."""
    found = {}
    for folder, folders, files in os.walk(root):
        for name in folders + files:
            path = Path(folder) / name
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = f"-> {os.readlink(path)}"
            else:
                found[key] = path.read_text("latin-1") if path.is_file() else "<folder>"
    return found


@pytest.mark.parametrize("kind", ["too-long", "link-loop", "under-a-file"])
@pytest.mark.parametrize("command", sorted(PATH_COMMANDS))
def test_a_path_no_command_can_use_is_one_line(command, kind, tmp_path, monkeypatch,
                                               cli) -> None:
    """Each path a command takes, made unusable each way, is one line naming it (exit code
    2, no traceback) and nothing is written anywhere."""
    monkeypatch.chdir(tmp_path)
    path = bad_path(kind, tmp_path)
    before = everything_in(tmp_path)
    line = one_error(cli(*PATH_COMMANDS[command](path, tmp_path / "out")))
    assert str(path.parent) in line or "'lake'" in line, line
    assert everything_in(tmp_path) == before


@pytest.mark.parametrize(
    "arguments",
    [("run", "blackjack", *FAST, "-o", "out", "--model", "~nosuchuser/model"),
     ("eval", "blackjack", "-n", "2", "--model", "~nosuchuser/model"),
     ("new-plugin", "lake", "--dir", "~nosuchuser/plugins")],
)
def test_a_home_folder_of_no_user_is_one_line(arguments, tmp_path, monkeypatch, cli) -> None:
    monkeypatch.chdir(tmp_path)
    line = one_error(cli(*arguments))
    assert "there is no user 'nosuchuser' on this machine" in line
    assert "write the path out in full" in line
    assert list(tmp_path.iterdir()) == []


# -- `new-plugin --dir` that cannot take a package ---------------------------------------
def unusable_folder(kind: str, tmp_path: Path, locked, monkeypatch) -> tuple[Path, str]:
    """A ``--dir`` of ``kind`` and what its refusal says."""
    if kind == "a-file":
        (tmp_path / "notes").write_text("mine\n")
        return tmp_path / "notes", "is not a folder"
    if kind == "dev-null":
        return Path(os.devnull), "is not a folder"
    if kind == "link-loop":
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        return tmp_path / "loop", "Too many levels of symbolic links"
    if kind == "link-to-nothing":
        (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
        return tmp_path / "gone", "is a symbolic link to nothing"
    if kind == "read-only":
        (tmp_path / "shelf").mkdir()
        locked(tmp_path / "shelf")
        return tmp_path / "shelf", "nothing was left behind"
    real_write = Path.write_text
    written: list[Path] = []

    def fill_disk(self: Path, text: str, *args, **kwargs) -> int:
        if len(written) == 3:  # the disk fills up half-way through the package
            real_write(self, text[: len(text) // 2], *args, **kwargs)
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        written.append(self)
        return real_write(self, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", fill_disk)
    return tmp_path / "new" / "plugins", "the disk is full: free space on that disk"


@pytest.mark.parametrize(
    "kind", ["a-file", "dev-null", "link-loop", "link-to-nothing", "read-only", "full-disk"]
)
def test_new_plugin_into_a_folder_that_cannot_take_it(kind, tmp_path, locked, monkeypatch,
                                                      cli) -> None:
    """One line naming ``--dir`` and the fix, and no package, part of one, or folder made
    for it is left behind."""
    monkeypatch.chdir(tmp_path)
    folder, says = unusable_folder(kind, tmp_path, locked, monkeypatch)
    before = everything_in(tmp_path)
    line = one_error(cli("new-plugin", "lake", "--dir", folder))
    assert str(folder) in line and says in line
    assert everything_in(tmp_path) == before
