"""The Typer application object every command module attaches to."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="llamagym",
    help="Fine-tune LLM agents with online RL in Gymnasium environments.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def report_plugin_problems() -> None:
    """Print each plugin problem once, as a warning line on stderr."""
    from llamagym.plugin_manager import get_plugins

    for problem in get_plugins().problems:
        typer.secho(f"warning: {problem}", fg="yellow", err=True)
