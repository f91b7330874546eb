"""Entry point of the plugin: agent ``openenv`` (an env on an OpenEnv server) and the
``llamagym serve`` command. Nothing here imports OpenEnv, uvicorn or the agent module,
so ``llamagym list`` stays fast."""

from collections.abc import Callable
from typing import Any

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

OPENENV = AgentSpec(
    name="openenv",
    entry_point="llamagym_openenv.agent:OpenEnvAgent",
    description="Any OpenEnv server's env, by URL (--set agent.url=ws://HOST:PORT): its "
    "text and legal actions, as `llamagym serve` or another OpenEnv server sends them",
    env_id="openenv",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(OPENENV)


@hookimpl
def llamagym_register_commands(cli: Any) -> None:
    from llamagym_openenv.serve_command import serve_command

    cli.command("serve")(serve_command)
