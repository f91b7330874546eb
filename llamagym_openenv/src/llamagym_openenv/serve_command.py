"""``llamagym serve AGENT``: an installed agent's env as an OpenEnv server. Importing
this module imports neither OpenEnv nor uvicorn (the command is registered at start)."""

from __future__ import annotations

import typer

#: Where a server listens unless ``--host`` says otherwise: this machine only.
LOOPBACK = "127.0.0.1"
#: Seconds between the server's keepalive pings; a client silent for as long again is
#: taken for gone and its session closed.
DEFAULT_KEEPALIVE_SECONDS = 20.0


def serve_command(
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    host: str = typer.Option(
        LOOPBACK, "--host", help="Address to listen on; the default is this machine only."
    ),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0: a free one)."),
    max_sessions: int = typer.Option(
        64, "--max-sessions", min=1, max=10_000,
        help="Sessions (envs) at once; a client past them is refused.",
    ),
    keepalive: float = typer.Option(
        DEFAULT_KEEPALIVE_SECONDS, "--keepalive", min=0.1, max=3600,
        help="Seconds between pings; a client that answers none for as long is dropped "
        "and its session freed.",
    ),
    assignments: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE over the agent's defaults, e.g. agent.level=..."
    ),
) -> None:
    """Serve AGENT's env over OpenEnv (WebSocket sessions, one env each): observations
    as the agent's text, legal actions in the observation's metadata, reward and done
    as the env gives them, reset(seed) honoured."""
    from llamagym.cli.run_commands import resolve_run_config
    from llamagym_openenv.server import serve

    agent_class, resolved = resolve_run_config(agent, None, assignments, {})
    task = agent_class(config=resolved)
    serve(task, host, port, max_sessions, keepalive,
          announce=lambda line: typer.echo(line, err=False))
