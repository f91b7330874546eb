"""Entry point of the plugin: the ``textworld`` agent and the ``textworld-games`` command.

Nothing here imports TextWorld (or the agent module), so ``llamagym list`` shows the
agent even where TextWorld is not installed; making its environment then fails with a
one-line hint how to install it.
"""

from collections.abc import Callable
from typing import Any

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

# The one statement of the agent's name, description and environment.
TEXTWORLD = AgentSpec(
    name="textworld",
    entry_point="llamagym_textworld.agent:TextWorldAgent",
    description="TextWorld: text adventures generated locally, admissible commands ranked",
    env_id="TextWorld (generated games)",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(TEXTWORLD)


@hookimpl
def llamagym_register_commands(cli: Any) -> None:
    from llamagym_textworld.cli import games_app

    cli.add_typer(games_app, name="textworld-games")
