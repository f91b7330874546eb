"""The ``llamagym`` command line. Commands are split by topic into sibling modules;
plugins add their own through the ``llamagym_register_commands`` hook."""

from __future__ import annotations

import logging
import os
import sys

import typer

from llamagym.cli import (  # noqa: F401  (importing a module attaches its commands)
    config_commands,
    eval_commands,
    inspect_commands,
    model_commands,
    plugin_commands,
    record_commands,
    report_commands,
    run_commands,
    trained_commands,
)
from llamagym.cli.app import app
from llamagym.display import PrintableFormatter, printable
from llamagym.errors import LlamaGymError
from llamagym.paths import path_problem
from llamagym.plugin_runtime.manager import get_plugins

__all__ = ["main"]


def main() -> None:
    plain = logging.StreamHandler()  # stderr, until a command shows progress (run, eval)
    plain.setFormatter(PrintableFormatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[plain])
    # shown once, below
    logging.getLogger("llamagym.plugin_runtime.manager").setLevel(logging.ERROR)
    try:
        get_plugins().register_commands(app)
        app()
    except LlamaGymError as error:
        _refuse(str(error))
    except OSError as error:
        # A path any command was given, or made from one, that cannot be used (too long,
        # a link loop, a file where a folder belongs, no permission, a full or read-only
        # disk): one line naming it and the fix. Any other OSError is a bug: traceback.
        problem = path_problem(error)
        if problem is None:
            raise
        _refuse(problem)
    except KeyboardInterrupt:
        typer.secho("interrupted", fg="yellow", err=True)
        sys.exit(130)


def _refuse(message: str) -> None:
    # The message may quote a file or a model: shown, never obeyed by the terminal.
    typer.secho(f"error: {_process()}{printable(message)}", fg="red", err=True)
    sys.exit(2)


def _process() -> str:
    """``"process N: "`` in the processes after the first of a multi-process run."""
    rank = os.environ.get("RANK", "0")
    return f"process {rank}: " if os.environ.get("WORLD_SIZE", "1") != "1" and rank != "0" else ""
