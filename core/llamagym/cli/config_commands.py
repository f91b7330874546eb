"""``llamagym config show``: the resolved config of a run, before running it."""

from __future__ import annotations

from pathlib import Path

import typer

from llamagym.cli.app import app
from llamagym.cli.run_commands import resolve_run_config

config_app = typer.Typer(help="Inspect run configurations.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def show_command(
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    algorithm: str = typer.Option(None, "--algorithm", "-a", help="Algorithm name."),
    model: str = typer.Option(None, "--model", "-m", help="'tiny', a Hub id or a local dir."),
    mode: str = typer.Option(None, "--mode", help="score or generate."),
    config_file: Path = typer.Option(None, "--config", "-c", help="YAML/TOML/JSON config."),
    assignments: list[str] = typer.Option([], "--set", help="KEY=VALUE, e.g. algorithm.lr=1e-4"),
    backend: str = typer.Option(None, "--backend", help="native (default) or trl."),
) -> None:
    """Print the config `llamagym run AGENT` would use, as YAML with every field's
    description, and where each non-default value came from. Save it, edit it and pass
    it back with `llamagym run AGENT --config FILE`."""
    flags = {
        "algorithm.name": algorithm, "model.name": model, "rollout.mode": mode,
        "training.backend": backend,
    }
    agent_class, resolved = resolve_run_config(agent, config_file, assignments, flags)
    header = [
        f"Configuration of `llamagym run {agent}`.",
        "Precedence: built-in defaults < agent defaults < pretrained-model defaults (any",
        "model but tiny) < TRL backend defaults (--backend trl) < --config file < --set <",
        "flags;",
        "'# from ...' marks a value set above the built-in defaults.",
    ]
    if resolved.agent_config_class is not None:
        header += [
            f"Under agent:, every key but name is an option of {agent} itself, set like any",
            "other key: --set agent.KEY=VALUE, or under `agent:` in a --config file.",
        ]
    header.append("")
    typer.echo(resolved.to_yaml(header), nl=False)
