"""`llamagym new-plugin`: names are checked, nothing is overwritten, the files are valid,
and a generated package installs, is listed, passes `llamagym check` and trains; one
with an env of its own (`--env-class`) installs, passes `llamagym check` and its own
tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from typer.testing import CliRunner

from llamagym.cli.app import app
from llamagym.devtools.scaffold import (
    ScaffoldError,
    llamagym_requirement,
    validate_name,
    write_plugin,
)
from llamagym.testing import one_error_line

LLAMAGYM = [sys.executable, "-m", "llamagym.cli"]


@pytest.mark.parametrize("name", ["frozen_lake", "taxi2", "a"])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize(
    ("name", "suggestion"),
    [("frozen-lake", "'frozen_lake'"), ("Taxi", "'taxi'"), ("2048", "'env_2048'"),
     ("class", None), ("", None)],
)
def test_invalid_names_say_what_to_type(name: str, suggestion: str | None) -> None:
    with pytest.raises(ScaffoldError, match="lowercase letters, digits and underscores") as error:
        validate_name(name)
    if suggestion:
        assert f"try {suggestion}" in str(error.value)


def test_a_bad_name_is_one_line_and_exit_code_2(tmp_path: Path) -> None:
    result = subprocess.run(
        [*LLAMAGYM, "new-plugin", "frozen-lake", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: plugin name 'frozen-lake' is not valid")
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []


def test_never_overwrites(tmp_path: Path) -> None:
    write_plugin("lake", directory=tmp_path)
    readme = tmp_path / "llamagym-lake" / "README.md"
    readme.write_text("mine")
    with pytest.raises(ScaffoldError, match="already exists"):
        write_plugin("lake", directory=tmp_path)
    assert readme.read_text() == "mine"


def test_requirement_is_the_release_series() -> None:
    assert llamagym_requirement("0.2.0") == "llamagym>=0.2,<0.3"
    assert llamagym_requirement("1.4.2") == "llamagym>=1.4,<2"


@pytest.mark.parametrize(
    ("name", "options", "module"),
    [
        ("lake", {}, "agent"),
        ("cliff", {"env_id": "CliffWalking-v1"}, "agent"),
        ("steps", {"kind": "algorithm"}, "algorithm"),
        ("guess", {"env_class": True}, "env"),
    ],
)
def test_generated_packages_are_complete(tmp_path: Path, name, options, module) -> None:
    spec, root = write_plugin(name, directory=tmp_path, **options)
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    assert project["name"] == f"llamagym-{name}"
    assert project["entry-points"]["llamagym"] == {name: f"llamagym_{name}.plugin"}
    assert llamagym_requirement() in project["dependencies"]
    package = root / "src" / f"llamagym_{name}"
    for path in [*package.glob("*.py"), root / "tests" / f"test_{name}.py"]:
        compile(path.read_text(), str(path), "exec")  # a template typo fails here
    assert (package / f"{module}.py").is_file() and (root / "README.md").is_file()
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if Path(ruff).exists():  # generated code is as clean as ours, under its own config
        lint = subprocess.run([ruff, "check", "-q", "."], cwd=root, capture_output=True,
                              text=True, timeout=60)
        assert lint.returncode == 0, lint.stdout
    if name == "cliff":  # the env's own documentation is quoted where it helps
        agent = (package / "agent.py").read_text()
        assert '"action 0",  # Move up' in agent and "current_row * ncols" in agent
    if name == "guess":  # the env is the package's own, registered by plugin.py
        assert spec.env_id == "Guess-v0" and (package / "agent.py").is_file()
        plugin = (package / "plugin.py").read_text()
        assert 'env_id="Guess-v0"' in plugin
        assert 'entry_point="llamagym_guess.env:GuessEnv"' in plugin
        assert "def llamagym_register_envs(" in plugin and "# @hookimpl" not in plugin
        assert "llamagym check guess" in (root / "README.md").read_text()


def test_an_unknown_env_id_points_to_env_class(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError) as error:
        write_plugin("mine", directory=tmp_path, env_id="MyEnv-v0")
    message = str(error.value)
    assert "'MyEnv-v0'" in message and "Gymnasium does not know this id" in message
    assert "for an environment of your own: llamagym new-plugin mine --env-class" in message
    assert "\n" not in message and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"env_id": "Taxi-v4"}, "give one of them, not both"),
        ({"env_id": "FrozenLake-v1"}, "give one of them, not both"),
        ({"kind": "algorithm"}, "--env-class applies to --kind env only"),
    ],
)
def test_env_class_refuses_other_env_options(tmp_path: Path, options, message) -> None:
    with pytest.raises(ScaffoldError, match=message) as error:
        write_plugin("guess", directory=tmp_path, env_class=True, **options)
    assert "\n" not in str(error.value) and list(tmp_path.iterdir()) == []


def test_env_class_refuses_a_name_gymnasium_uses(tmp_path: Path) -> None:
    # cart_pole would register CartPole-v0, which Gymnasium already has.
    with pytest.raises(ScaffoldError, match="already has an env of that name"):
        write_plugin("cart_pole", directory=tmp_path, env_class=True)
    assert list(tmp_path.iterdir()) == []


def test_env_template_refuses_continuous_actions(tmp_path: Path) -> None:
    with pytest.raises(ScaffoldError, match="Discrete"):
        write_plugin("pendulum", directory=tmp_path, env_id="Pendulum-v1")
    assert list(tmp_path.iterdir()) == []


def test_new_plugin_command_prints_the_next_steps(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["new-plugin", "lake", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "src/llamagym_lake/agent.py" in result.output
    assert "llamagym check lake" in result.output


def test_new_plugin_command_writes_an_env_class(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["new-plugin", "guess", "--env-class", "--dir",
                                      str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "its own env Guess-v0" in result.output
    assert "src/llamagym_guess/env.py" in result.output
    both = CliRunner().invoke(app, ["new-plugin", "other", "--env-class", "--env-id",
                                    "Taxi-v4", "--dir", str(tmp_path)])
    assert isinstance(both.exception, ScaffoldError)
    assert not (tmp_path / "llamagym-other").exists()


@pytest.mark.slow  # a whole run in fresh processes: `make test` runs it, `make test-fast` does not
def test_a_new_plugin_installs_lists_checks_and_trains(tmp_path: Path) -> None:
    """The whole path of a plugin author, each step in its own process: generate,
    install (into a directory of its own, so nothing stays installed), list, check, run."""
    run = subprocess.run(
        [*LLAMAGYM, "new-plugin", "lake", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "--target", str(site),
         str(tmp_path / "llamagym-lake")],
        check=True, capture_output=True, timeout=300,
    )
    # One torch thread per process: the machine's cores are shared.
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}

    def llamagym(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*LLAMAGYM, *args], capture_output=True, text=True,
                              timeout=600, env=env)

    listing = llamagym("list")
    assert listing.returncode == 0, listing.stderr
    row = next(line for line in listing.stdout.splitlines() if " lake " in line)
    assert "llamagym-lake" in row

    check = llamagym("check", "lake", "--episodes", "2")
    assert check.returncode == 0, check.stdout + check.stderr
    assert "9 checks: 9 passed, 0 failed, 0 skipped" in check.stdout

    output = tmp_path / "run"
    trained = llamagym("run", "lake", "--episodes", "8", "--eval-episodes", "4", "--quiet",
                       "--threads", "1", "--output", str(output))
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "trained 16 episodes" in trained.stdout  # one update of the agent's batch
    assert (output / "report.md").is_file() and any((output / "checkpoints").iterdir())
    assert "route" in (output / "report.md").read_text()  # the baseline was evaluated


@pytest.mark.slow
def test_a_new_plugin_with_its_own_env_installs_checks_and_passes_its_tests(
    tmp_path: Path,
) -> None:
    """`new-plugin NAME --env-class`, each step in its own process: generate, install
    (into a directory of its own, so nothing stays installed), check, then run the
    package's own tests as they were generated."""
    run = subprocess.run(
        [*LLAMAGYM, "new-plugin", "guess", "--env-class", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )
    assert run.returncode == 0, run.stderr
    root = tmp_path / "llamagym-guess"
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
         "--no-deps", "--no-build-isolation", "--target", str(site), str(root)],
        check=True, capture_output=True, timeout=300,
    )
    # One torch thread per process: the machine's cores are shared.
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}

    check = subprocess.run([*LLAMAGYM, "check", "guess", "--episodes", "2"],
                           capture_output=True, text=True, timeout=600, env=env)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "9 checks: 9 passed, 0 failed, 0 skipped" in check.stdout
    assert "make_env() gives GuessEnv" in check.stdout  # the env of env.py, registered

    tests = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=root, capture_output=True, text=True, timeout=600, env=env,
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert " passed" in tests.stdout and "skipped" not in tests.stdout


# -- names pip installs, and no installed plugin holds ------------------------------------
@pytest.mark.parametrize("name", ["abc_", "lake__", "a_b_"])
def test_a_name_pip_refuses_as_a_distribution_is_refused(name: str, tmp_path: Path, cli):
    code, out, err = cli("new-plugin", name, "--env-class", "--dir", tmp_path)
    assert code == 2, out + err
    line = one_error_line(err)
    assert f"'llamagym-{name.replace('_', '-')}', which pip refuses" in line
    assert f"try {name.rstrip('_')!r}" in line
    assert list(tmp_path.iterdir()) == []


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="abz09_-. A", max_size=12))
def test_every_name_taken_makes_a_package_pip_installs(name: str) -> None:
    """A name either is refused, or is an identifier whose distribution name pip accepts
    as a requirement (what `pip install` parses)."""
    try:
        validate_name(name)
    except ScaffoldError:
        return
    assert name.isidentifier()
    assert Requirement(f"llamagym-{name.replace('_', '-')}").name


@pytest.mark.parametrize(
    ("name", "options", "holder"),
    [
        ("cartpole", ["--env-class"], "the agent 'cartpole' of llamagym-cartpole"),
        ("blackjack", [], "the installed distribution llamagym-blackjack"),
        ("ppo", ["--kind", "algorithm"], "the algorithm 'ppo' of llamagym"),
        ("models", [], "the entry point 'models' of llamagym"),
    ],
)
def test_a_name_an_installed_plugin_holds_is_refused(name, options, holder, tmp_path, cli):
    """Installed beside the plugin that holds the name, the new one would take it over
    in `llamagym list`."""
    code, out, err = cli("new-plugin", name, *options, "--dir", tmp_path)
    assert code == 2, out + err
    line = one_error_line(err)
    assert f"plugin name {name!r} is taken by" in line and holder in line
    assert list(tmp_path.iterdir()) == []


def test_a_name_too_long_for_a_file_name_is_refused(tmp_path: Path, cli) -> None:
    code, _, err = cli("new-plugin", "a" * 300, "--dir", tmp_path)
    assert code == 2
    assert "is 300 characters long; a plugin name is at most 64" in one_error_line(err)
    assert list(tmp_path.iterdir()) == []


def test_the_package_appears_whole_and_readable(tmp_path: Path) -> None:
    """Written in a hidden folder and renamed into place: nothing else is left beside it,
    and its folders are as readable as any the user makes."""
    spec, root = write_plugin("lake", directory=tmp_path / "new")
    assert [p.name for p in (tmp_path / "new").iterdir()] == [spec.folder]
    assert root.stat().st_mode & 0o755 == 0o755 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
