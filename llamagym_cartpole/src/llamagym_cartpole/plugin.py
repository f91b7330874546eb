"""Entry point of the plugin: registers the agent without importing it (fast CLI)."""

from collections.abc import Callable

from llamagym import hookimpl


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(
        "cartpole",
        "llamagym_cartpole.agent:CartPoleAgent",
        description="CartPole-v1: push the cart LEFT or RIGHT to keep the pole up",
        env_id="CartPole-v1",
    )
