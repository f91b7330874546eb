"""Commands for plugin authors: ``new-plugin`` writes a package, ``check`` tests an agent."""

from __future__ import annotations

from pathlib import Path

import typer

from llamagym.cli.app import app, report_plugin_problems
from llamagym.config import check_seed, deep_merge
from llamagym.config.files import parse_assignment
from llamagym.devtools.agent_checks import CHECK_NAMES
from llamagym.devtools.conformance import check_agent
from llamagym.devtools.moved_imports import moved_imports
from llamagym.display import printable
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.plugin_runtime.manager import Plugins, get_plugins
from llamagym.resolver.layers import resolve_agent_config


@app.command("new-plugin")
def new_plugin_command(
    name: str = typer.Argument(
        ..., help="Plugin name: the agent/algorithm name and the import name llamagym_NAME."
    ),
    kind: str = typer.Option("env", "--kind", help="env (an agent) or algorithm."),
    directory: Path = typer.Option(
        Path("."),
        "--dir",
        help="The folder that receives the package: it is written to DIR/llamagym-NAME "
        "(DIR is created if missing; an existing llamagym-NAME is never overwritten).",
    ),
    env_id: str = typer.Option(
        None, "--env-id", help="Gymnasium env id for --kind env (default FrozenLake-v1)."
    ),
    env_class: bool = typer.Option(
        False,
        "--env-class",
        help="For --kind env: an environment of the package's own instead (env.py, a "
        "number-guessing game to replace with yours), registered with Gymnasium by "
        "plugin.py.",
    ),
) -> None:
    """Write a complete plugin package: pyproject.toml with the entry point, the agent or
    algorithm, a README and tests. Then `pip install -e` it and it is in `llamagym list`."""
    from llamagym.devtools.scaffold import write_plugin  # gymnasium: not for --help

    spec, root = write_plugin(name, kind, directory, env_id, env_class=env_class)
    if kind != "env":
        what = f"algorithm {name!r}"
    elif spec.own_env:
        what = f"agent {name!r} for its own env {spec.env_id}, in env.py"
    else:
        what = f"agent {name!r} for {spec.env_id}"
    typer.echo(f"created {root} ({spec.distribution}, {what}):")
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        typer.echo(f"  {path.relative_to(root)}")
    steps = [f"cd {root}", 'pip install -e ".[test]"', "llamagym list"]
    if kind == "env":
        steps += [f"llamagym check {name}", "pytest", f"llamagym run {name}"]
    else:
        steps += ["pytest", f"llamagym run blackjack --algorithm {name}"]
    typer.echo("next:\n" + "\n".join(f"  {step}" for step in steps))
    typer.echo("guide: docs/writing-a-plugin.md in the LlamaGym repository")


@app.command("check")
def check_command(
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    episodes: int = typer.Option(4, "--episodes", min=1, help="Episodes per mode, end to end."),
    seed: int = typer.Option(0, "--seed", help="Seed of the resets and random walks."),
    assignments: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE laid over the agent's defaults, e.g. agent.games=2"
    ),
    skip: list[str] = typer.Option([], "--skip", help="A check not to run (repeatable)."),
) -> None:
    """Run the conformance checks on AGENT: its env resets with a seed, prompts render
    and fit the tiny model's context, every action name parses back, score mode has a
    candidate per action, baselines run, and episodes play with a scripted model.
    Exit code 1 when a check fails."""
    check_seed(seed, "--seed")
    unknown = sorted(set(skip) - set(CHECK_NAMES))
    if unknown:
        raise LlamaGymError(
            f"--skip {', '.join(unknown)}: no such check; checks: {', '.join(CHECK_NAMES)}"
        )
    plugins = get_plugins()
    plugins.registry.agents()  # the registration hooks run first, so their problems are shown too
    report_plugin_problems()
    registration = plugins.registry.get("agent", agent)
    agent_class = registration.load()
    overrides: dict = {}
    for assignment in assignments:
        overrides = deep_merge(overrides, parse_assignment(assignment))
    _refuse_bad_settings(agent_class, plugins, overrides)
    typer.echo(
        f"llamagym check {agent}: {agent_class.__module__}.{agent_class.__qualname__} "
        f"from {registration.distribution or 'an unknown distribution'}"
    )
    for line in moved_imports(agent_class.__module__):
        typer.secho(f"warning: {printable(line)}", fg="yellow", err=True)
    results = check_agent(
        agent_class, overrides, name=agent, episodes=episodes, seed=seed, skip=skip
    )
    colours = {"pass": "green", "fail": "red", "skip": "yellow"}
    for result in results:
        first, *rest = result.lines()
        typer.secho(first, fg=colours[result.status])
        for line in rest:
            typer.echo(line)
    failed = [result.name for result in results if result.failed]
    passed = sum(result.status == "pass" for result in results)
    skipped = len(results) - passed - len(failed)
    summary = f"{len(results)} checks: {passed} passed, {len(failed)} failed, {skipped} skipped"
    if failed:
        typer.secho(f"{summary} ({', '.join(failed)})", fg="red")
        raise typer.Exit(1)
    typer.secho(summary, fg="green")


def _refuse_bad_settings(agent_class: type, plugins: Plugins, overrides: dict) -> None:
    """A ``--set`` that the agent's own settings would not take is the user's mistake, not
    a failed check: a ConfigError (exit 2) naming it. Settings the agent's defaults
    already break are left to the checks, which report them as the plugin's."""
    if not overrides:
        return
    try:
        resolve_agent_config(agent_class, plugins=plugins)
    except ConfigError:
        return
    resolve_agent_config(agent_class, [("--set", overrides)], plugins=plugins)
