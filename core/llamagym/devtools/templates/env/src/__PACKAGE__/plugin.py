"""Entry point of the plugin (see pyproject.toml): the one statement of the agent's
name, description and environment. It names the agent class by a "module:Class" string,
so `llamagym list` does not import the agent module (or torch)."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

AGENT = AgentSpec(
    name="__NAME__",
    entry_point="__PACKAGE__.agent:__CLASS__",
    # The line `llamagym list` shows for the agent.
    description="__DESCRIPTION__",
    env_id="__ENV_ID__",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(AGENT)


# An environment of your own? `llamagym new-plugin NAME --env-class` writes a package
# with one (a small game in env.py, to replace with yours), registered with a hook like
# the one below. Or register yours with Gymnasium here, then set env_id above to its id:
#
# @hookimpl
# def llamagym_register_envs(register: Callable[..., None]) -> None:
#     register(id="MyGame-v0", entry_point="__PACKAGE__.env:MyGameEnv", max_episode_steps=200)
