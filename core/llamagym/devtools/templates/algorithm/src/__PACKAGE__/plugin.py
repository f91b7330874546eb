"""Entry point of the plugin (see pyproject.toml). It names the algorithm class by a
"module:Class" string, so `llamagym list` does not import torch."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.plugin_runtime.registry import AlgorithmSpec

ALGORITHM = AlgorithmSpec(
    name="__NAME__",
    entry_point="__PACKAGE__.algorithm:__CLASS__",
    description="REINFORCE with a batch-mean baseline (the __DISTRIBUTION__ plugin)",
)


@hookimpl
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    register(ALGORITHM)
