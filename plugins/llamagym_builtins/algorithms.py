"""The built-in algorithms, one spec each, registered by this module (the built-in plugin
``algorithms``). A spec names its class by a ``module:Class`` string, so listing the
algorithms never imports torch; the class loads when a run selects it."""

from __future__ import annotations

from collections.abc import Callable

from llamagym.plugin_runtime.hookspecs import hookimpl
from llamagym.plugin_runtime.registry import AlgorithmSpec

ALGORITHMS: tuple[AlgorithmSpec, ...] = (
    AlgorithmSpec(
        "ppo",
        "llamagym_builtins.ppo:PPO",
        "PPO: value head, GAE over turns, KL to the adapter-off reference, target-KL stop",
    ),
    AlgorithmSpec(
        "grpo",
        "llamagym_builtins.grpo:GRPO",
        "GRPO: returns normalised within groups of episodes from one seed, no value head",
    ),
    AlgorithmSpec(
        "rloo",
        "llamagym_builtins.rloo:RLOO",
        "RLOO: leave-one-out baseline over K episodes from one seed, no value head",
    ),
    AlgorithmSpec(
        "reinforce",
        "llamagym_builtins.rloo:REINFORCE",
        "REINFORCE with a batch-mean baseline, no value head",
    ),
)


@hookimpl
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    for spec in ALGORITHMS:
        register(spec)
