"""Entry point of the plugin: the one statement of the agent's name, description and
environment, registered without importing the agent module (fast CLI)."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

BLACKJACK = AgentSpec(
    name="blackjack",
    entry_point="llamagym_blackjack.agent:BlackjackAgent",
    description="Blackjack-v1: stick or hit against the dealer",
    env_id="Blackjack-v1",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(BLACKJACK)
