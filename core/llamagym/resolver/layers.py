"""Every layer of a run's config, and the one resolver over them.

A run's settings come in layers, lowest precedence first: the agent's name, its
defaults (or a checkpoint's whole config), the defaults for a pretrained model and for
the TRL backend, then what the user gave (a file, ``--set``, flags, a dict in Python).
:func:`resolve_agent_config` names the layers of an agent's run; :func:`resolve_config`
merges them, validates every section (the algorithm's and the agent's by their own
``Config``) and keeps which layer set each key. Every problem becomes one line naming
the key, the value given and what is allowed. :class:`ResolvedConfig` renders itself
as YAML with each field's description (``llamagym config show``).

    resolved = resolve_agent_config(AgentClass, [("--set", {...})])
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import yaml
from pydantic import BaseModel, ValidationError

from llamagym.config import (
    PRETRAINED_MODEL_DEFAULTS,
    TRL_BACKEND_DEFAULTS,
    AlgorithmSection,
    ModelSettings,
    RolloutSettings,
    RunConfig,
    TrainingSettings,
    check_episode_memory,
    chosen_value,
    deep_merge,
    defaults_for_algorithm,
)
from llamagym.display import clipped
from llamagym.errors import ConfigError, UnknownNameError
from llamagym.models.lora_choice import trains_through_lora
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.resolver.trl_arguments import trl_problems

if TYPE_CHECKING:
    from llamagym.plugin_runtime.manager import Plugins


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
        entry = get_plugins().registry.model(str(name))
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
        algorithm_class_for=lambda name: plugins.registry.get("algorithm", name).load(),
    )


# -- the one resolver: layers merged, every section validated, provenance kept ---------
def _model_at(model: type[BaseModel] | None, path: Sequence[Any]) -> type[BaseModel] | None:
    """The pydantic model that holds the key at ``path`` (for listing its allowed keys)."""
    for part in path:
        if model is None or part not in model.model_fields:
            return None
        model = _as_model(model.model_fields[part].annotation)
    return model


def _as_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            found = _as_model(option)
            if found is not None:
                return found
    return None


def _unknown_key_hint(key: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{hint} allowed: {', '.join(allowed)}" if allowed else hint


def format_validation_error(
    error: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> str:
    """One line per problem: the key, the value given and what is allowed.

    ``model`` is the validated class; with it an unknown key also lists the keys its
    section allows and the closest one to what was typed.
    """
    lines: list[str] = []
    seen: set[tuple] = set()
    for problem in error.errors():
        loc = problem["loc"]
        if loc in seen:  # a union reports each branch; the first reason is enough
            continue
        seen.add(loc)
        key = prefix + ".".join(str(part) for part in loc)
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            holder = _model_at(model, loc[:-1]) if model is not None else None
            allowed = list(holder.model_fields) if holder is not None else []
            lines.append(
                f"{key}: unknown key (got {clipped(value)})"
                + _unknown_key_hint(str(loc[-1]), allowed)
            )
            continue
        message = problem["msg"]
        for prefix_text, replacement in (
            ("Input should be ", "must be "),
            ("Value error, ", ""),
            ("Assertion failed, ", ""),
        ):
            if message.startswith(prefix_text):
                message = replacement + message[len(prefix_text) :]
        if problem["type"] == "missing":
            lines.append(f"{key}: required, but not given")
        else:
            lines.append(f"{key}: got {clipped(value)}; {message}")
    return "\n".join(lines)


# -- resolving a run's config from named layers ----------------------------------------
Layer = tuple[str, Mapping[str, Any]]
"""``(source, partial config)``: source names the layer in messages and in ``config show``
(``agent defaults``, ``file run.yaml``, ``--set``, ``flag``, ``checkpoint``)."""


class AlgorithmClass(Protocol):
    """What the resolver reads of a registered algorithm class (every subclass of
    :class:`llamagym.Algorithm` has it): the ``Config`` that validates the algorithm
    section."""

    @property
    def Config(self) -> type[BaseModel]: ...  # noqa: N802 (the class attribute's name)


@dataclass
class ResolvedConfig:
    """A validated config, with every plugin-owned section filled in with its defaults."""

    config: RunConfig
    #: dotted key -> the layer that set it last; keys no layer set hold built-in defaults
    sources: dict[str, str] = field(default_factory=dict)
    #: the registered algorithm class and its validated ``Config`` (what the run gets)
    algorithm_class: AlgorithmClass | None = None
    algorithm: BaseModel | None = None
    #: the agent's validated options (an instance of its ``Config``), if it declares one
    agent_options: BaseModel | None = None

    @property
    def algorithm_config_class(self) -> type[BaseModel] | None:
        return type(self.algorithm) if self.algorithm is not None else None

    @property
    def agent_config_class(self) -> type[BaseModel] | None:
        return type(self.agent_options) if self.agent_options is not None else None

    def descriptions(self) -> dict[str, str]:
        return config_descriptions(self.algorithm_config_class, self.agent_config_class)

    def to_yaml(self, header: Sequence[str] = ()) -> str:
        return render_config_yaml(self.config, self.descriptions(), self.sources, header)


def leaf_keys(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``."""
    leaves: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            leaves.update(leaf_keys(value, dotted + "."))
        else:
            leaves[dotted] = value
    return leaves


def agent_config_class(agent_class: type | None) -> type[BaseModel] | None:
    """An agent's options model: the ``Config`` class attribute, when it declares one."""
    candidate = getattr(agent_class, "Config", None)
    if isinstance(candidate, type) and issubclass(candidate, BaseModel):
        return candidate
    return None


def resolve_config(
    layers: Sequence[Layer],
    *,
    agent_class: type | None = None,
    algorithm_class_for: Callable[[str], AlgorithmClass] | None = None,
) -> ResolvedConfig:
    """Merge ``layers`` (lowest precedence first) and validate every section.

    All problems found are reported together, one line each, in one ``ConfigError``.
    ``algorithm_class_for(name)`` returns the registered algorithm class, whose
    ``Config`` validates the algorithm section; the agent section is validated by the
    agent's ``Config`` when it declares one (otherwise by the agent's own constructor).
    """
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for source, layer in layers:
        merged = deep_merge(merged, dict(layer))
        for key in leaf_keys(layer):
            sources[key] = source
    problems: list[str] = []
    merged = _named_expert(merged, agent_class, problems)
    try:
        RunConfig.model_validate(merged)
    except ValidationError as error:
        problems += format_validation_error(error, model=RunConfig).splitlines()
    algorithm_class, algorithm_settings = _validated_algorithm(
        merged.get("algorithm", {}), algorithm_class_for, problems
    )
    agent_settings = _validated_agent_options(merged.get("agent", {}), agent_class, problems)
    if sources.get("algorithm.warm_start.baseline") != "checkpoint":
        problems += _unknown_baseline(algorithm_settings, agent_class)
    if not problems:
        problems += _memory_problems(merged, algorithm_settings)
    problems += _misplaced_trl_keys(merged, sources)
    if problems:
        raise ConfigError("\n".join(problems))

    if algorithm_settings is not None:
        merged["algorithm"] = {
            "name": merged.get("algorithm", {}).get("name", AlgorithmSection().name),
            **algorithm_settings.model_dump(mode="json"),
        }
    if agent_settings is not None:
        merged["agent"] = {
            "name": merged.get("agent", {}).get("name", ""),
            **agent_settings.model_dump(mode="json"),
        }
    config = RunConfig.model_validate(merged)
    if config.training.backend == "trl" and _chosen_for_this_run(sources):
        # TRL's own checks, before anything is written; a resumed or loaded run's TRL
        # settings are checked again when it starts training (check_supported).
        problems = trl_problems(config, algorithm_settings)
        if problems:
            raise ConfigError("\n".join(problems))
    return ResolvedConfig(config, sources, algorithm_class, algorithm_settings, agent_settings)


def _chosen_for_this_run(sources: Mapping[str, str]) -> bool:
    """Whether the TRL settings are this run's own: no checkpoint's config lies below
    them, or a layer above it sets a ``trl.*`` key (a loaded run's settings were checked
    when it was trained, and evaluating it needs no TRL)."""
    if "checkpoint" not in sources.values():
        return True
    return any(key.startswith("trl.") and source != "checkpoint" for key, source in sources.items())


def _validated_algorithm(
    section: Any,
    algorithm_class_for: Callable[[str], AlgorithmClass] | None,
    problems: list[str],
) -> tuple[AlgorithmClass | None, BaseModel | None]:
    """The registered algorithm class the section names and the section validated by its
    ``Config``; what is wrong is added to ``problems``."""
    if not isinstance(section, Mapping) or algorithm_class_for is None:
        return None, None
    algorithm_class: AlgorithmClass | None = None
    settings: BaseModel | None = None
    name = section.get("name", AlgorithmSection().name)
    try:
        algorithm_class = algorithm_class_for(name)
    except UnknownNameError as error:
        listing = ", ".join(sorted(error.known)) or "none installed"
        problems.append(f"algorithm.name: unknown algorithm {name!r}; installed: {listing}")
    if algorithm_class is not None:
        options = {k: v for k, v in section.items() if k != "name"}
        try:
            settings = algorithm_class.Config.model_validate(options)
        except ValidationError as error:
            problems += format_validation_error(
                error, prefix="algorithm.", model=algorithm_class.Config
            ).splitlines()
    credit = getattr(settings, "credit", None)
    supported = tuple(getattr(algorithm_class, "credit_rules", ()) or ())
    if credit is not None and supported and credit not in supported:
        problems.append(
            f"algorithm.credit: got {credit!r}; algorithm {name!r} supports "
            f"{', '.join(supported)}"
        )
    return algorithm_class, settings


def _validated_agent_options(
    section: Any, agent_class: type | None, problems: list[str]
) -> BaseModel | None:
    """The agent section validated by the agent's ``Config``, when it declares one; keys
    given to an agent that takes no options are problems."""
    if not isinstance(section, Mapping) or agent_class is None:
        return None
    options = {k: v for k, v in section.items() if k != "name"}
    options_class = agent_config_class(agent_class)
    if options_class is not None:
        try:
            return options_class.model_validate(options)
        except ValidationError as error:
            problems += format_validation_error(
                error, prefix="agent.", model=options_class
            ).splitlines()
            return None
    # Nothing would ever read these keys: a typo must not pass silently.
    for key, value in options.items():
        problems.append(
            f"agent.{key}: unknown key (got {clipped(value)}); agent "
            f"{getattr(agent_class, 'name', '')!r} takes no options (an agent "
            "declares its options as a pydantic model: class Config(BaseModel))"
        )
    return None


#: ``--warm-start expert``: the agent's expert baseline, whatever the agent calls it.
EXPERT = "expert"


def expert_baseline(agent_class: type | None) -> str | None:
    """The baseline ``agent_class`` plays best: its ``expert_baseline``, else its one
    baseline besides ``random`` (None when it has none, or several and names none)."""
    baselines = list(getattr(agent_class, "baselines", None) or {})
    named = getattr(agent_class, "expert_baseline", None)
    if named is not None:
        return str(named)
    others = [name for name in baselines if name != "random"]
    return others[0] if len(others) == 1 else None


def _named_expert(
    merged: dict[str, Any], agent_class: type | None, problems: list[str]
) -> dict[str, Any]:
    """``merged`` with ``algorithm.warm_start.baseline: expert`` replaced by the name of
    the agent's expert baseline, so the run's config records which one it played (an
    agent with a baseline of its own called ``expert`` keeps it)."""
    warm_start = merged.get("algorithm", {}).get("warm_start")
    if not isinstance(warm_start, Mapping) or warm_start.get("baseline") != EXPERT:
        return merged
    baselines = list(getattr(agent_class, "baselines", None) or {})
    if agent_class is None or EXPERT in baselines:
        return merged
    expert = expert_baseline(agent_class)
    if expert is None:
        name = getattr(agent_class, "name", "") or agent_class.__name__
        problems.append(
            f"algorithm.warm_start.baseline: {name} names no expert baseline (its "
            f"baselines: {', '.join(baselines) or 'none'}); name one of them instead of "
            f"{EXPERT!r}, or declare expert_baseline = NAME on the agent class"
        )
        return merged
    algorithm = dict(merged["algorithm"])
    algorithm["warm_start"] = {**warm_start, "baseline": expert}
    return {**merged, "algorithm": algorithm}


def _unknown_baseline(algorithm_settings: Any, agent_class: type | None) -> list[str]:
    """A warm start from a baseline the agent does not have (``--warm-start NAME``), refused
    before anything loads or is written. (A checkpoint's is not checked: a resumed run
    trains on the demonstrations it recorded, and a loaded one plays no baseline.)"""
    baseline = getattr(getattr(algorithm_settings, "warm_start", None), "baseline", None)
    baselines = list(getattr(agent_class, "baselines", None) or {})
    if baseline in (None, EXPERT) or agent_class is None or baseline in baselines:
        return []  # (an expert that could not be named is reported by _named_expert)
    name = getattr(agent_class, "name", "") or agent_class.__name__
    return [
        f"algorithm.warm_start.baseline: {name} has no baseline {baseline!r}; its "
        f"baselines: {', '.join(baselines) or 'none'}"
    ]


def _memory_problems(merged: Mapping[str, Any], algorithm_settings: Any) -> list[str]:
    """What the settings would allocate, checked before anything is."""
    problems = []
    for key, count in (
        ("training.eval_episodes", merged.get("training", {}).get("eval_episodes")),
        ("algorithm.episodes_per_update", getattr(algorithm_settings, "episodes_per_update", None)),
    ):
        if isinstance(count, int):
            try:
                check_episode_memory(count, key)
            except ConfigError as error:
                problems.append(str(error))
    return problems


def _misplaced_trl_keys(merged: Mapping[str, Any], sources: Mapping[str, str]) -> list[str]:
    """``trl.*`` keys a user set for a run that does not use the TRL backend."""
    backend = merged.get("training", {}).get("backend", TrainingSettings().backend)
    if backend == "trl":
        return []
    return [
        f"{key}: applies only to the TRL backend; add --backend trl "
        "(training.backend=trl) or drop it"
        for key, source in sources.items()
        if key.startswith("trl.") and source != "checkpoint"
    ]


# -- rendering: YAML with each field's description as a comment --------------------------
def model_descriptions(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """Dotted key -> description for every field of ``model``, nested models included."""
    descriptions: dict[str, str] = {}
    for name, info in model.model_fields.items():
        key = prefix + name
        if info.description:
            descriptions[key] = info.description + _bounds(info.metadata)
        nested = _as_model(info.annotation)
        if nested is not None:
            descriptions.update(model_descriptions(nested, key + "."))
    return descriptions


def _bounds(rules: Sequence[Any]) -> str:
    """A field's declared bounds as its description ends with them, e.g. " [1 to 4,096]"."""
    low = high = None
    for rule in rules:
        for name, sign in (("ge", ""), ("gt", "> ")):
            if getattr(rule, name, None) is not None:
                low = f"{sign}{getattr(rule, name):,}"
        for name, sign in (("le", ""), ("lt", "< ")):
            if getattr(rule, name, None) is not None:
                high = f"{sign}{getattr(rule, name):,}"
    if low is not None and high is not None:
        return f" [{low} to {high}]"
    if low is not None:
        return f" [{low if low.startswith('>') else '>= ' + low}]"
    return f" [{high if high.startswith('<') else '<= ' + high}]" if high is not None else ""


def config_descriptions(
    algorithm_config: type[BaseModel] | None = None,
    agent_config: type[BaseModel] | None = None,
) -> dict[str, str]:
    descriptions = model_descriptions(RunConfig)
    if algorithm_config is not None:
        descriptions.update(model_descriptions(algorithm_config, "algorithm."))
    if agent_config is not None:
        descriptions.update(model_descriptions(agent_config, "agent."))
    return descriptions


def _yaml_scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=1_000_000, sort_keys=False)
    return text.strip().removesuffix("...").strip()


def render_config_yaml(
    config: RunConfig,
    descriptions: Mapping[str, str] | None = None,
    sources: Mapping[str, str] | None = None,
    header: Sequence[str] = (),
) -> str:
    """The config as YAML, each key preceded by its description as a comment, and each
    value that a layer above the built-in defaults set followed by that layer's name.
    The comments are ignored when the file is read back with ``--config``."""
    descriptions = descriptions or {}
    sources = sources or {}
    lines = [f"# {line}" if line else "#" for line in header]

    def emit(data: Mapping[str, Any], prefix: str, indent: str) -> None:
        for key, value in data.items():
            dotted = prefix + key
            if dotted in descriptions:
                lines.append(f"{indent}# {descriptions[dotted]}")
            if isinstance(value, Mapping) and value:
                lines.append(f"{indent}{key}:")
                emit(value, dotted + ".", indent + "  ")
            else:
                source = f"  # from {sources[dotted]}" if dotted in sources else ""
                lines.append(f"{indent}{key}: {_yaml_scalar(value)}{source}")

    data = config.model_dump(mode="json")
    if config.training.backend != "trl":
        del data["trl"]  # settings only the TRL backend reads
    emit(data, "", "")
    return "\n".join(lines) + "\n"
