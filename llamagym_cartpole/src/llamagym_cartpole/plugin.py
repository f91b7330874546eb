"""Entry point of the plugin: the one statement of the agent's name, description and
environment, registered without importing the agent module (fast CLI)."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

CARTPOLE = AgentSpec(
    name="cartpole",
    entry_point="llamagym_cartpole.agent:CartPoleAgent",
    description="CartPole-v1: push the cart LEFT or RIGHT to keep the pole up",
    env_id="CartPole-v1",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(CARTPOLE)
