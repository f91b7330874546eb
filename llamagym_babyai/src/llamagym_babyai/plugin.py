"""Entry point of the plugin: the one statement of the agent's name, description and
default level, registered without importing the agent module or minigrid (fast CLI)."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AgentSpec

BABYAI = AgentSpec(
    name="babyai",
    entry_point="llamagym_babyai.agent:BabyAIAgent",
    description="BabyAI: follow a grid-world mission (go to, pick up, open) from what "
    "the agent sees, in words",
    env_id="BabyAI-GoToLocal-v0",
)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(BABYAI)
