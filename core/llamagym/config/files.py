"""Reading a config: files (YAML, TOML or JSON) and ``--set key=value`` lines, as data.

What a config may hold is bounded, so a hostile or broken file or ``--set`` value is
refused in one line instead of hanging or overflowing the stack: a file is at most
:data:`MAX_CONFIG_BYTES` bytes of UTF-8 text, nests at most :data:`MAX_CONFIG_DEPTH`
levels, and holds at most :data:`MAX_CONFIG_VALUES` keys and values with every YAML alias
expanded. No setting that runs code (:data:`CODE_SETTINGS`) is taken from either.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib
import yaml

from llamagym.errors import ConfigError

#: The largest config file read, in bytes (a run's config is a few kilobytes).
MAX_CONFIG_BYTES = 1 << 20
#: The deepest nesting a config (a file, or a ``--set`` key with its value) may have;
#: a run's own settings nest three levels.
MAX_CONFIG_DEPTH = 64
#: The most keys and values a config may hold, every YAML alias expanded.
MAX_CONFIG_VALUES = 100_000
#: The settings that let code from outside the installed packages run, each with the one
#: command-line flag that turns it on. A config file or ``--set`` never does: a config
#: file is shared like any other data ("here is my recipe"). TRL's own switches (its
#: reference model is built with them) follow the same flag: the TRL backend sets them
#: from ``model.trust_remote_code``.
CODE_SETTINGS = {
    "model.trust_remote_code": "--trust-remote-code",
    "trl.trust_remote_code": "--trust-remote-code",
    "trl.model_init_kwargs.trust_remote_code": "--trust-remote-code",
}


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that measures each node as it is composed, before anything is
    built from it: a document nesting deeper than :data:`MAX_CONFIG_DEPTH` or holding more
    than :data:`MAX_CONFIG_VALUES` keys and values once its aliases are expanded is
    refused (a 1 KB file of aliases of aliases expands to billions; a deep one would
    overflow the stack of the recursive composer)."""

    def __init__(self, stream: str, source: str):
        super().__init__(stream)
        self.source = source
        self._open_collections = 0
        self._open_anchors: set[str] = set()
        #: id(node) -> (keys and values, nesting), aliases expanded
        self._extent: dict[int, tuple[int, int]] = {}

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise ConfigError(
                    f"{self.source}: the alias *{event.anchor} refers to a value that holds "
                    "it (an endless config); copy the values it needs instead"
                )
            return super().compose_node(parent, index)
        collection = isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent))
        if collection and self._open_collections >= MAX_CONFIG_DEPTH:
            raise ConfigError(_too_deep(self.source))
        anchor = getattr(event, "anchor", None)
        self._open_collections += collection
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._open_collections -= collection
            if anchor is not None:
                self._open_anchors.discard(anchor)
        self._measure(node)
        return node

    def _measure(self, node: yaml.Node) -> None:
        if isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            self._extent[id(node)] = (1, 0)
            return
        # An alias is the very node its anchor named, measured when it was composed.
        extents = [self._extent[id(child)] for child in children]
        values = 1 + sum(count for count, _ in extents)
        depth = 1 + max((nesting for _, nesting in extents), default=0)
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(_too_deep(self.source))
        if values > MAX_CONFIG_VALUES:
            raise ConfigError(_too_many_values(self.source, aliases=True))
        self._extent[id(node)] = (values, depth)


def _too_deep(source: str) -> str:
    return (
        f"{source} nests deeper than {MAX_CONFIG_DEPTH} levels, the most a config may nest; "
        "a run's settings nest three levels (see `llamagym config show AGENT`): look for "
        "runaway brackets"
    )


def _too_many_values(source: str, aliases: bool = False) -> str:
    expanded = " once its YAML aliases are expanded" if aliases else ""
    return (
        f"{source} holds more than {MAX_CONFIG_VALUES:,} keys and values{expanded}, the most "
        "a config may hold; a run's whole config is a few hundred at most (see `llamagym "
        "config show AGENT`)" + ("; write them out without aliases" if aliases else "")
    )


def check_extent(data: Any, source: str) -> None:
    """A ``ConfigError`` if ``data`` nests deeper than :data:`MAX_CONFIG_DEPTH` or holds
    more than :data:`MAX_CONFIG_VALUES` keys and values (what any parser produced)."""
    count = 0

    def walk(value: Any, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ConfigError(_too_many_values(source))
        if isinstance(value, Mapping):
            children: Sequence[Any] = [part for pair in value.items() for part in pair]
        elif isinstance(value, (list, tuple)):
            children = value
        else:
            return
        if depth >= MAX_CONFIG_DEPTH:
            raise ConfigError(_too_deep(source))
        for child in children:
            walk(child, depth + 1)

    walk(data, 0)


def load_yaml(text: str, source: str) -> Any:
    """``text`` as YAML (safe types only), within the limits on nesting and size; a syntax
    error is re-raised as PyYAML's ``YAMLError``, a value Python refuses (an integer of
    thousands of digits, a date that does not exist) as ``ValueError``."""
    loader = _BoundedLoader(text, source)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _first_line(error: Exception) -> str:
    problem = getattr(error, "problem", None)  # PyYAML: what, without where
    text = str(problem or error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _syntax_problem(error: Exception) -> str:
    """Where a parser stopped and why, in one line."""
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    mark = getattr(error, "problem_mark", None)  # PyYAML
    if mark is not None:
        return f"line {mark.line + 1}, column {mark.column + 1}: {_first_line(error)}"
    return _first_line(error)  # TOML says where itself


def refuse_code_settings(layer: Mapping[str, Any], source: str) -> None:
    """A ``ConfigError`` naming the flag to use when ``layer`` (a config file or a
    ``--set``) turns on a setting of :data:`CODE_SETTINGS`; ``false`` is left alone (a
    run's own ``config.yaml`` records it)."""
    for key, flag in CODE_SETTINGS.items():
        value: Any = layer
        for name in key.split("."):
            value = value.get(name) if isinstance(value, Mapping) else None
        if value is not None and value is not False:
            raise ConfigError(
                f"{source} sets {key} = {value!r}; only the command line lets a model run "
                f"code of its own: remove it there and pass {flag} (if you trust that "
                "model's code)"
            )


def parse_assignment(assignment: str) -> dict[str, Any]:
    """``"algorithm.lr=1e-4"`` -> ``{"algorithm": {"lr": 0.0001}}`` (values parsed as YAML)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. algorithm.lr=1e-4")
    source = f"--set {assignment!r}"
    try:
        value = load_yaml(raw, source) if raw.strip() else None
    except (yaml.YAMLError, ValueError) as error:
        raise ConfigError(
            f"{source}: the value is not valid YAML ({_first_line(error)}); write a YAML "
            "value such as 0.5, word, [a, b] or {k: v}, and put quotes around text that "
            "holds brackets, braces, colons or '#'"
        ) from error
    result: dict[str, Any] = {}
    node = result
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    check_extent(result, source)
    refuse_code_settings(result, source)
    return result


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML, JSON or TOML config file into a dict, with a one-line error (naming
    the file and the fix) if it cannot be read, is not UTF-8 text, does not parse, is
    too large or too deep, or is not a mapping of sections."""
    source = f"config file {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{source} does not exist")
    if not path.is_file():
        raise ConfigError(f"{source} is not a file; pass a YAML, TOML or JSON config file")
    try:
        with path.open("rb") as stream:
            raw = stream.read(MAX_CONFIG_BYTES + 1)
    except OSError as error:
        raise ConfigError(
            f"{source} cannot be read ({error.strerror or error}); check its permissions"
        ) from error
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source} is larger than {MAX_CONFIG_BYTES:,} bytes, the most a config file "
            "may be; a run's config is a few kilobytes (see `llamagym config show AGENT`)"
        )
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError(
            f"{source} holds binary data (a NUL byte at offset {nul}), not YAML, TOML or "
            "JSON text; pass the config file itself"
        )
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{source} is not UTF-8 text (byte 0x{raw[error.start]:02x} at offset "
            f"{error.start}); save it as UTF-8"
        ) from error
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = load_yaml(text, source)
            data = {} if data is None else data
    except RecursionError:  # the JSON and TOML parsers recurse once per level
        raise ConfigError(_too_deep(source)) from None
    except (yaml.YAMLError, ValueError) as error:  # TOML and JSON errors are ValueErrors
        syntax = {".toml": "TOML", ".json": "JSON"}.get(path.suffix, "YAML")
        raise ConfigError(
            f"{source} is not valid {syntax} ({_syntax_problem(error)}); correct it there, or "
            "start again from what `llamagym config show AGENT` prints"
        ) from error
    if not isinstance(data, dict):
        held = "a list" if isinstance(data, list) else f"the single value {data!r:.40}"
        raise ConfigError(
            f"{source} holds {held}, not a mapping of sections; write sections such as "
            "'training: {seed: 1}' (`llamagym config show AGENT` prints a complete one)"
        )
    check_extent(data, source)
    return data
