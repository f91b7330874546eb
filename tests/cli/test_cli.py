"""The command line as a user meets it: fast start, clear one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

LLAMAGYM = [sys.executable, "-m", "llamagym.cli"]


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLAMAGYM, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def test_help_and_list_do_not_import_torch() -> None:
    code = (
        "import sys; from llamagym.cli import app; from typer.testing import CliRunner;"
        "r = CliRunner().invoke(app, ['list']); assert r.exit_code == 0, r.output;"
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0;"
        "print(sorted(m for m in ('torch', 'transformers', 'textworld') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["llamagym.testing", "llamagym.agent"])
def test_the_pytest_plugin_and_the_agent_import_no_torch(module: str) -> None:
    # llamagym.testing is a pytest11 plugin: every pytest session of anyone with llamagym
    # installed imports it. The Agent is the task: a plugin's agent module and its config
    # layers load without the model side.
    code = (
        f"import sys, {module};"
        "print(sorted(m for m in ('torch', 'transformers', 'textworld') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_version_is_the_installed_distributions() -> None:
    from importlib.metadata import version

    result = run_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"llamagym {version('llamagym')}\n"


def test_list_shows_agents_and_algorithms_with_distributions() -> None:
    result = run_cli("list")
    assert result.returncode == 0, result.stderr
    assert "blackjack" in result.stdout and "llamagym-blackjack" in result.stdout
    assert "ppo" in result.stdout


@pytest.mark.parametrize(
    ("args", "named", "listed"),
    [
        (["run", "blakjack"], "unknown agent 'blakjack'", "blackjack"),
        (["run", "blackjack", "--algorithm", "dqn"], "unknown algorithm 'dqn'", "ppo"),
    ],
)
def test_unknown_names_give_one_line_and_exit_code_2(args, named, listed) -> None:
    result = run_cli(*args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and named in lines[0] and listed in lines[0]
    assert "Traceback" not in result.stderr


def test_bad_setting_is_rejected_before_loading_anything() -> None:
    result = run_cli("run", "blackjack", "--set", "rollout.num_envs=0", "--set", "rollout.mod=x")
    assert result.returncode == 2
    assert "rollout.num_envs" in result.stderr and "rollout.mod: unknown key" in result.stderr
    assert "Traceback" not in result.stderr


def test_broken_plugin_is_reported_and_the_cli_still_works(tmp_path) -> None:
    # A real distribution on sys.path whose entry point fails to import.
    dist_info = tmp_path / "llamagym_broken-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: llamagym-broken\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text("[llamagym]\nbroken = llamagym_broken_missing\n")
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    result = run_cli("list", env=env)
    assert result.returncode == 0
    assert "blackjack" in result.stdout
    warning = [line for line in result.stderr.splitlines() if "'broken'" in line]
    assert len(warning) == 1
    assert "llamagym-broken" in warning[0] and "LLAMAGYM_DISABLE_PLUGINS=broken" in warning[0]
    quiet = run_cli("list", env={**env, "LLAMAGYM_DISABLE_PLUGINS": "broken"})
    assert quiet.returncode == 0 and "broken" not in quiet.stderr


def _commands(group, path=()):
    """Every command of the click group under typer, with its path of names."""
    import click

    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_every_help_text_reads_as_wrapped_prose_at_80_columns() -> None:
    """A command's description wraps at the terminal's width: no line breaks before a
    word that would have fit on it (a docstring's own line breaks kept by the help)."""
    import typer.main
    from typer.testing import CliRunner

    from llamagym.cli.app import app

    width = 80
    runner = CliRunner()
    early = []
    for path in _commands(typer.main.get_command(app)):
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(width)},
                               terminal_width=width)
        assert result.exit_code == 0, (path, result.output)
        description = result.output.split("╭")[0].splitlines()
        lines = [line.strip() for line in description if "Usage:" not in line]
        for line, after in zip(lines, lines[1:], strict=False):
            if not line or not after:
                continue  # a paragraph's end
            # The help's margin is one column each side.
            if len(line) + 1 + len(after.split()[0]) <= width - 2:
                early.append(f"{' '.join(path)}: {line!r} / {after!r}")
    assert not early, "\n".join(early)
