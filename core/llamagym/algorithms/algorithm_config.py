"""The ``algorithm`` section of a run's config: the base every algorithm's ``Config``
subclasses, the fields and validators the built-in configs share, and the settings
:meth:`~llamagym.algorithms.algorithm.Algorithm.optimise` reads.

It imports no torch: a config is validated before anything loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError, ValidationError

from llamagym.algorithms.credit import unsupported_credit_message

#: The flat ``algorithm.sft_*`` keys of the supervised settings, and their names in the
#: ``algorithm.warm_start`` section that holds them.
FLAT_WARM_START_KEYS: dict[str, str] = {
    "sft_warm_start": "replay",
    "sft_buffer_size": "buffer_size",
    "sft_top_k": "top_k",
    "sft_min_return": "min_return",
    "sft_steps": "steps",
    "sft_batch_size": "batch_size",
    "sft_lr": "lr",
    "sft_demonstrations": "demonstrations",
    "sft_demonstration_epochs": "demonstration_epochs",
}


def nest_warm_start_keys(section: Mapping[str, Any]) -> dict[str, Any]:
    """An algorithm section with the flat ``sft_*`` keys moved into its ``warm_start``
    section, for reading a config written with them (an older checkpoint's)."""
    nested = {key: value for key, value in section.items() if key not in FLAT_WARM_START_KEYS}
    moved = {
        FLAT_WARM_START_KEYS[key]: value
        for key, value in section.items()
        if key in FLAT_WARM_START_KEYS
    }
    if moved:
        nested["warm_start"] = {**moved, **dict(section.get("warm_start") or {})}
    return nested


def with_demonstrations(settings: AlgorithmConfig, path: Path) -> AlgorithmConfig:
    """A copy of ``settings`` whose warm start trains on the file at ``path``, the one a
    training run recorded from the baseline the settings name (which the copy then no
    longer names: its demonstrations are that file). ``settings`` stay as they are."""
    warm_start = settings.warm_start  # type: ignore[attr-defined]  # the baseline's section
    recorded = warm_start.model_copy(update={"demonstrations": path, "baseline": None})
    return settings.model_copy(update={"warm_start": recorded})


class AlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    #: Credit rules the algorithm accepts; a config with a ``credit`` field is checked
    #: against them, so ``--set algorithm.credit=gae`` on GRPO fails before any loading.
    credit_rules: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _warm_start_keys_are_nested(cls, data: Any) -> Any:
        """A config with a ``warm_start`` section refuses the flat ``sft_*`` keys, each
        with the key to use instead."""
        if not isinstance(data, Mapping) or "warm_start" not in cls.model_fields:
            return data
        flat = [key for key in data if key in FLAT_WARM_START_KEYS]
        if not flat:
            return data
        raise ValidationError.from_exception_data(
            cls.__name__,
            [
                {
                    "type": PydanticCustomError(
                        "nested_key",
                        "this key is now algorithm.warm_start.{key}",
                        {"key": FLAT_WARM_START_KEYS[key]},
                    ),
                    "loc": (key,),
                    "input": data[key],
                }
                for key in flat
            ],
        )

    @field_validator("credit", check_fields=False)
    @classmethod
    def _credit_is_supported(cls, rule: str) -> str:
        if cls.credit_rules and rule not in cls.credit_rules:
            name = cls.__name__.removesuffix("Config").lower()
            raise PydanticCustomError(
                "unsupported_credit", unsupported_credit_message(name, rule, cls.credit_rules)
            )
        return rule


def microbatch_size_field() -> Any:
    """The ``microbatch_size`` setting of a config whose algorithm steps through
    :meth:`Algorithm.optimise` (PPO's and GRPO's)."""
    return Field(
        None,
        ge=1,
        description="Turns per forward and backward pass; a step accumulates its "
        "minibatch's gradients from such pieces (less memory, same step). null = the "
        "whole minibatch.",
    )


def warmup_steps_field() -> Any:
    """The ``warmup_steps`` setting of a config whose algorithm steps with Adam."""
    return Field(
        0,
        ge=0,
        description="Optimizer steps over which the learning rate rises linearly to its "
        "value (0 = none). Adam's first step moves every weight by the whole rate, "
        "whatever its gradient's size.",
    )


def check_group_divides_batch(group_size: int, info: ValidationInfo) -> int:
    """Field validator body for ``group_size`` (declared after ``episodes_per_update``, so
    that is validated first): a batch must hold whole seed groups."""
    episodes = info.data.get("episodes_per_update")
    if episodes and episodes % group_size:
        lower = max(group_size, episodes - episodes % group_size)
        raise PydanticCustomError(
            "not_multiple_of_group",
            "episodes_per_update ({episodes}) must be a multiple of group_size "
            "({group_size}) so every seed group is complete; try episodes_per_update "
            "{lower} or {upper}",
            {"episodes": episodes, "group_size": group_size, "lower": lower,
             "upper": lower + group_size},
        )
    return group_size


def check_adaptive_kl(target: float | None, info: ValidationInfo) -> float | None:
    """Field validator body: the adaptive controller scales ``kl_coef``, so it must start >0."""
    if target is not None and not info.data.get("kl_coef"):
        raise PydanticCustomError(
            "adaptive_kl_needs_coef",
            "needs a starting kl_coef > 0 (the controller scales it); "
            "set e.g. algorithm.kl_coef=0.05",
        )
    return target


class ClippedSettings(Protocol):
    """The settings :meth:`Algorithm.optimise` reads (the built-in configs have them)."""

    epochs: int
    minibatch_size: int
    clip_range: float
    target_kl: float | None
    max_grad_norm: float
