"""Entry point of the plugin (see pyproject.toml). It names the algorithm class by a
"module:Class" string, so `llamagym list` does not import torch."""

from collections.abc import Callable

from llamagym import hookimpl
from llamagym.specs import AlgorithmSpec

ALGORITHM = AlgorithmSpec(
    name="steps03",
    entry_point="llamagym_steps03.algorithm:Steps03",
    description="REINFORCE with a batch-mean baseline (the llamagym-steps03 plugin)",
)


@hookimpl
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    register(ALGORITHM)
