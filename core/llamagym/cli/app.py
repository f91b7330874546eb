"""The Typer application object every command module attaches to."""

from __future__ import annotations

import sys
from importlib.metadata import version

import typer
from rich.console import Console

from llamagym.plugin_runtime.manager import get_plugins

#: Columns of a rich console whose output is not a terminal (piped or redirected):
#: wide enough that no table cell is wrapped or cut.
UNBOUNDED_WIDTH = 10_000

app = typer.Typer(
    name="llamagym",
    help="Fine-tune LLM agents with online RL in Gymnasium environments.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"llamagym {version('llamagym')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Fine-tune LLM agents with online RL in Gymnasium environments."""


def report_plugin_problems() -> None:
    """Print each plugin problem once, as a warning line on stderr."""
    for problem in get_plugins().problems:
        typer.secho(f"warning: {problem}", fg="yellow", err=True)


def output_console() -> Console:
    """A rich console on stdout: as wide as the terminal, or, when stdout is not a
    terminal (``llamagym list | grep ...``, a file), wide enough that tables keep every
    name and description whole instead of fitting them into 80 columns."""
    stdout = sys.stdout
    if stdout is not None and stdout.isatty():
        return Console()
    return Console(width=UNBOUNDED_WIDTH)
