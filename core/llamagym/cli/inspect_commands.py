"""Commands that look at what is installed: ``list`` and ``plugins``."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Mapping
from dataclasses import asdict

import typer
from rich.table import Table

from llamagym.cli.app import app, output_console, report_plugin_problems
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.plugin_runtime.registry import AgentSpec, AlgorithmSpec


@app.command("list")
def list_command() -> None:
    """List the agents and algorithms every installed plugin registered."""
    plugins = get_plugins()
    console = output_console()
    registries: tuple[tuple[str, Mapping[str, AgentSpec | AlgorithmSpec]], ...] = (
        ("agents", plugins.registry.agents()),
        ("algorithms", plugins.registry.algorithms()),
    )
    report_plugin_problems()  # after the registration hooks ran: their problems too
    for kind, registry in registries:
        table = Table(title=kind.capitalize(), title_justify="left")
        table.add_column("name", style="bold")
        table.add_column("description")
        if kind == "agents":
            table.add_column("environment")
        table.add_column("distribution")
        for name, spec in sorted(registry.items()):
            env = [spec.env_id] if isinstance(spec, AgentSpec) else []
            table.add_row(name, spec.description, *env, spec.distribution)
        console.print(table)


@app.command("plugins")
def plugins_command() -> None:
    """Print every loaded plugin as JSON: name, distribution, version, hooks."""
    # The JSON is the only thing on stdout: what plugin code prints meanwhile (even a
    # registration hook still running after its time limit) goes to stderr.
    stdout = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        plugins = get_plugins()
        report_plugin_problems()
        listing = json.dumps([asdict(info) for info in plugins.plugin_infos()], indent=2)
        typer.echo(listing, file=stdout)
