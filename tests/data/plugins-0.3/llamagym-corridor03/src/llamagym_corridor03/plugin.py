"""Registers the corridor's env with Gymnasium and its agent with LlamaGym."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.specs import AgentSpec

AGENT = AgentSpec(
    name="corridor03",
    entry_point="llamagym_corridor03.agent:CorridorAgent",
    description="Walk a corridor to its end",
    env_id="Corridor03-v0",
)


@hookimpl
def llamagym_register_envs(register: Callable[..., None]) -> None:
    register(id="Corridor03-v0", entry_point="llamagym_corridor03.env:CorridorEnv",
             max_episode_steps=12)


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(AGENT)
