"""Entry points of the built-in algorithms. Each registers a ``module:Class`` string, so
listing algorithms never imports torch; the class loads when a run selects it."""

from __future__ import annotations

from collections.abc import Callable

from llamagym.hookspecs import hookimpl


class AlgorithmPlugin:
    def __init__(self, name: str, entry_point: str, description: str):
        self.name, self.entry_point, self.description = name, entry_point, description

    @hookimpl
    def llamagym_register_algorithms(self, register: Callable[..., None]) -> None:
        register(self.name, self.entry_point, description=self.description)


ppo = AlgorithmPlugin(
    "ppo",
    "llamagym.plugins.ppo:PPO",
    "PPO: value head, GAE over turns, KL to the adapter-off reference, target-KL stop",
)
grpo = AlgorithmPlugin(
    "grpo",
    "llamagym.plugins.grpo:GRPO",
    "GRPO: returns normalised within groups of episodes from one seed, no value head",
)
rloo = AlgorithmPlugin(
    "rloo",
    "llamagym.plugins.rloo:RLOO",
    "RLOO: leave-one-out baseline over K episodes from one seed, no value head",
)
reinforce = AlgorithmPlugin(
    "reinforce",
    "llamagym.plugins.rloo:REINFORCE",
    "REINFORCE with a batch-mean baseline, no value head",
)
