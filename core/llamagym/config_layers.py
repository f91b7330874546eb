"""Every layer of a run's config, and the one resolver over them.

A run's settings come in layers, lowest precedence first: the agent's name, its
defaults (or a checkpoint's whole config), the defaults for a pretrained model and for
the TRL backend, then what the user gave (a file, ``--set``, flags, a dict in Python).
:func:`resolve_agent_config` merges and validates them (:func:`llamagym.config.resolve_config`).

    resolved = resolve_agent_config(AgentClass, [("--set", {...})])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from llamagym.config import (
    PRETRAINED_MODEL_DEFAULTS,
    TRL_BACKEND_DEFAULTS,
    Layer,
    ModelSettings,
    ResolvedConfig,
    RolloutSettings,
    chosen_value,
    deep_merge,
    defaults_for_algorithm,
    resolve_config,
)
from llamagym.models.loading import trains_through_lora
from llamagym.plugin_manager import get_plugins

if TYPE_CHECKING:
    from llamagym.plugin_manager import Plugins


def defaults_for_model(
    agent_class: type | None, later_layers: Sequence[Mapping[str, Any]], model: Any = None
) -> dict[str, Any]:
    """The defaults layer for a pretrained model (anything but `tiny`), which goes above
    the agent's defaults: :data:`PRETRAINED_MODEL_DEFAULTS`, the model's registry entry's
    ``lora_layers`` (a setting recorded with the run, so a checkpoint made before an entry
    named one still loads its adapter on every layer) and the agent's own
    ``pretrained_defaults[mode]`` (for the run's action mode) over them. ``model`` is a
    model object given directly (the classic API), which counts as pretrained where it
    trains through LoRA (it carries an adapter, or gets one by the loader's rule);
    otherwise the layers name the model."""
    from_registry: dict[str, Any] = {}
    if model is None or isinstance(model, str):
        name = model or chosen_value(later_layers, "model", "name") or ModelSettings().name
        if str(name).strip().lower() == "tiny":
            return {}
        entry = get_plugins().model(str(name))
        if entry is not None and entry.lora_layers:
            from_registry = {"model": {"lora_layers": entry.lora_layers}}
    else:
        if not trains_through_lora(model):
            return {}
    # An agent's own pretrained defaults are given per action mode; when they name an
    # algorithm, their algorithm settings hold only for it (a later layer may pick
    # another), while the generic ones above hold for every algorithm.
    layers = [getattr(agent_class, "defaults", {}), *later_layers]
    mode = chosen_value(layers, "rollout", "mode") or RolloutSettings().mode
    own = getattr(agent_class, "pretrained_defaults", {}).get(mode, {})
    if own.get("algorithm", {}).get("name"):
        own = defaults_for_algorithm(own, later_layers)
    return deep_merge(deep_merge(PRETRAINED_MODEL_DEFAULTS, from_registry), own)


def run_layers(
    agent_class: type,
    later: Sequence[Layer] = (),
    *,
    base: Mapping[str, Any] | None = None,
    model: Any = None,
) -> list[Layer]:
    """Every layer of a run's config, lowest precedence first: the agent's name, then
    either ``base`` (a checkpoint's config: a resumed or loaded run keeps the settings it
    was trained with) or the agent's defaults and the pretrained-model defaults, then the
    ``later`` layers the user gave (file, ``--set``, flags, a dict in Python).
    ``model`` is a model object given directly (the classic API)."""
    layers: list[Layer] = []
    name = getattr(agent_class, "name", "")
    if name:
        layers.append(("agent", {"agent": {"name": name}}))
    if base is not None:
        layers.append(("checkpoint", base))
    else:
        chosen = [layer for _, layer in later]
        backend = chosen_value(chosen, "training", "backend")
        backend_defaults = TRL_BACKEND_DEFAULTS if backend == "trl" else {}
        chosen = [backend_defaults, *chosen]
        defaults = getattr(agent_class, "defaults", {})
        model_defaults = defaults_for_model(agent_class, chosen, model)
        # The agent's algorithm settings also give way to an algorithm its pretrained
        # defaults choose.
        defaults = defaults_for_algorithm(defaults, [model_defaults, *chosen])
        layers.append(("agent defaults", defaults))
        if model_defaults:
            layers.append(("pretrained-model defaults", model_defaults))
        if backend_defaults:
            layers.append(("TRL backend defaults", backend_defaults))
    return layers + [(source, layer) for source, layer in later if layer]

def resolve_agent_config(
    agent_class: type,
    later: Sequence[Layer] = (),
    *,
    base: Mapping[str, Any] | None = None,
    model: Any = None,
    plugins: Plugins | None = None,
) -> ResolvedConfig:
    """The one config resolver: every layer of ``agent_class``'s run (see
    :func:`run_layers`), merged and validated, the algorithm section by
    the registered algorithm's ``Config`` and the agent section by the agent's."""
    plugins = plugins or get_plugins()
    return resolve_config(
        run_layers(agent_class, later, base=base, model=model),
        agent_class=agent_class,
        algorithm_class_for=lambda name: plugins.get("algorithm", name).load(),
    )
