"""Entry point of the plugin (see pyproject.toml): the one statement of the agent's
name, description and environment, and the registration of that environment with
Gymnasium. Both name their class by a "module:Class" string, so `llamagym list` imports
neither the agent module (or torch) nor the env module."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

AGENT = AgentSpec(
    name="__NAME__",
    entry_point="__PACKAGE__.agent:__CLASS__",
    # The line `llamagym list` shows for the agent.
    description="__DESCRIPTION__",
    # The Gymnasium id of the env in env.py, registered below.
    env_id="__ENV_ID__",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(AGENT)


@hookimpl
def llamagym_register_envs(register: Callable[..., None]) -> None:
    # LlamaGym calls this the first time an agent makes its env (Agent.make_env).
    # register is gymnasium.register, except that an id already registered is skipped;
    # keyword arguments of the env's __init__ go in kwargs={...}.
    register(id=AGENT.env_id, entry_point="__PACKAGE__.env:__ENV_CLASS__")
