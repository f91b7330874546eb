"""``llamagym new-plugin``: write a complete, installable plugin package.

The package follows the layout of the built-in env plugins (``llamagym_blackjack``):
a ``src/`` layout, one ``plugin.py`` module as the entry point in group ``llamagym``
that registers the agent or algorithm as a lazy ``"module:Class"`` string, the class in
its own module, a README and tests that use :mod:`llamagym.testing`.

Two kinds:

* ``env``: an :class:`~llamagym.Agent` for a Gymnasium environment. For the default,
  ``FrozenLake-v1``, a worked example (prompts that draw the lake, a hand-written
  route as a baseline); for any other env id with a ``Discrete`` action space, the
  same skeleton with placeholder action names marked ``TODO``. With ``--env-class``,
  an environment of the package's own instead (``env.py``, registered with Gymnasium by
  ``plugin.py``): a number-guessing game to replace with the author's.
* ``algorithm``: REINFORCE with a batch-mean baseline and a pydantic ``Config``, the
  smallest complete :class:`~llamagym.Algorithm`.

The package's files are real files under ``templates/``, in layers: ``common`` (every
package), then ``env`` or ``algorithm``, then ``frozenlake`` for the worked example or
``ownenv`` for an environment of the package's own, whose files replace those of the
same path. A file is rendered by replacing tokens such as ``__NAME__`` or ``__CLASS__``
(in its path too) with the values of :meth:`PluginSpec.substitutions`; a line holding
only a comment with a token whose name ends in ``_LINES``
(``# __ACTION_PLACEHOLDER_LINES__``) becomes the token's lines, indented like the
comment. The tokens are plain identifiers and strings, so every template is valid
Python (or TOML, or Markdown), and ruff checks the Python ones under the generated
package's own settings (``templates/ruff.toml``).

The name must make a distribution pip installs and must not be one an installed plugin
holds (its entry point, agent or algorithm name, distribution or import name), else the
new plugin would take the name from it in ``llamagym list``. The package is written in a
hidden folder beside its place and renamed into place when complete: a failure (a full
disk, a read-only folder) leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import inspect
import keyword
import os
import re
import shutil
import stat
import tempfile
import textwrap
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import gymnasium
from packaging.utils import InvalidName, canonicalize_name

from llamagym import __version__
from llamagym.errors import LlamaGymError
from llamagym.paths import expand_user, path_problem
from llamagym.plugin_runtime.manager import ENTRY_POINT_GROUP, get_plugins

KINDS = ("env", "algorithm")
DEFAULT_ENV_ID = "FrozenLake-v1"
TEMPLATES = Path(__file__).resolve().with_name("templates")
_NAME = re.compile(r"[a-z][a-z0-9_]*")
#: The longest plugin name: its folder, package and class names stay short file names.
MAX_NAME_LENGTH = 64
# A comment line holding a *_LINES token (group 1: its indentation, group 2: the
# token's name), or a token anywhere (group 3).
_TOKEN = re.compile(r"^([ \t]*)# __((?:[A-Z]+_)+LINES)__$|__([A-Z]+(?:_[A-Z]+)*)__", re.M)


class ScaffoldError(LlamaGymError):
    """The plugin cannot be written as asked (bad name, existing folder, unknown env)."""


def _stem(name: str) -> str:
    """``name`` in CamelCase: ``frozen_lake`` -> ``FrozenLake``."""
    return "".join(part.capitalize() for part in name.split("_") if part)


def own_env_id(name: str) -> str:
    """The Gymnasium id of the env that ``--env-class`` writes for plugin ``name``."""
    return f"{_stem(name)}-v0"


def validate_name(name: str) -> str:
    """``name`` if it can be the agent/algorithm name, the ``llamagym_NAME`` import name
    and the ``llamagym-NAME`` distribution name pip installs; otherwise a
    :class:`ScaffoldError` that says what to type instead."""
    if len(name) > MAX_NAME_LENGTH:
        raise ScaffoldError(
            f"plugin name {name[:20]!r}... is {len(name)} characters long; a plugin name is "
            f"at most {MAX_NAME_LENGTH}: choose a shorter one"
        )
    if _NAME.fullmatch(name) and not keyword.iskeyword(name):
        distribution = f"llamagym-{name.replace('_', '-')}"
        try:
            canonicalize_name(distribution, validate=True)
        except InvalidName:
            raise ScaffoldError(
                f"plugin name {name!r} makes the distribution name {distribution!r}, which "
                "pip refuses (a name ends with a letter or digit); try "
                f"{name.rstrip('_')!r}"
            ) from None
        return name
    suggestion = re.sub(r"[^a-z0-9_]+", "_", name.strip().lower()).strip("_")
    if suggestion and not suggestion[0].isalpha():
        suggestion = "env_" + suggestion
    hint = f"; try {suggestion!r}" if _NAME.fullmatch(suggestion or "-") else ""
    raise ScaffoldError(
        f"plugin name {name!r} is not valid: it becomes the import name llamagym_<name>, "
        "so use lowercase letters, digits and underscores, starting with a letter "
        f"(a Python identifier){hint}"
    )


def check_name_is_free(name: str, kind: str) -> None:
    """Refuse ``name`` when an installed plugin holds it: as the name of an entry point in
    group ``llamagym``, of a registered agent (``kind`` env) or algorithm, or as the
    distribution or import name the package would have. Installed beside it, the new
    plugin would take that name from the one there, or be taken for it."""
    taken = [
        f"the entry point {name!r} of {point.dist.name if point.dist else 'a package'}"
        for point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        if point.name == name
    ]
    plugins = get_plugins()
    registered = plugins.registry.agents() if kind == "env" else plugins.registry.algorithms()
    if name in registered:
        spec = registered[name]
        owner = spec.distribution or "an installed plugin"
        taken.append(f"the {'agent' if kind == 'env' else 'algorithm'} {name!r} of {owner}")
    distribution = f"llamagym-{name.replace('_', '-')}"
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        installed = importlib.metadata.distribution(distribution)
        taken.append(f"the installed distribution {installed.name}")
    if importlib.util.find_spec(f"llamagym_{name}") is not None:
        taken.append(f"the import name llamagym_{name}")
    if taken:
        raise ScaffoldError(
            f"plugin name {name!r} is taken by {', '.join(dict.fromkeys(taken))}; choose "
            "another NAME (`llamagym list` shows the names in use)"
        )


def llamagym_requirement(version: str | None = None) -> str:
    """The ``llamagym`` range a new plugin depends on: this release series only, because
    before 1.0 a minor release may change the hooks (after it, only a major one)."""
    if version is None:
        version = __version__
    major, minor = (int(part) for part in version.split(".")[:2])
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f"llamagym>={major}.{minor},<{upper}"


@dataclass(frozen=True)
class EnvFacts:
    """What the env template needs to know about an env, read from the env itself."""

    action_count: int
    #: index -> what the env's documentation says the action does (may be empty)
    action_meanings: dict[int, str] = field(default_factory=dict)
    #: the "Observation Space" section of the env's documentation, as lines
    observation_notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PluginSpec:
    name: str
    kind: str
    env_id: str = DEFAULT_ENV_ID
    env: EnvFacts | None = None  # env kind, other than the worked example
    #: The package holds its own env (``env.py``), registered as ``env_id``.
    own_env: bool = False

    @property
    def package(self) -> str:
        return f"llamagym_{self.name}"

    @property
    def distribution(self) -> str:
        return f"llamagym-{self.name.replace('_', '-')}"

    @property
    def folder(self) -> str:
        # The distribution name, not the import name: a folder called like the package
        # it holds can be mistaken for that package when tests run from its parent.
        return self.distribution

    @property
    def class_name(self) -> str:
        return _stem(self.name) + ("Agent" if self.kind == "env" else "")

    @property
    def worked_example(self) -> bool:
        return self.kind == "env" and self.env_id == DEFAULT_ENV_ID and not self.own_env

    @property
    def layers(self) -> tuple[str, ...]:
        """The template folders this package is made of, later ones winning."""
        if self.kind == "algorithm":
            return ("common", "algorithm")
        if self.own_env:
            return ("common", "env", "ownenv")
        return ("common", "env", "frozenlake") if self.worked_example else ("common", "env")

    def substitutions(self) -> dict[str, str]:
        """Token name (``NAME`` for ``__NAME__``) -> the text it stands for."""
        env = self.env or EnvFacts(0)
        return {
            "NAME": self.name,
            "PACKAGE": self.package,
            "DISTRIBUTION": self.distribution,
            "CLASS": self.class_name,
            "CONFIG_CLASS": f"{self.class_name}Config",
            "ENV_CLASS": f"{_stem(self.name)}Env",
            "ENV_ID": self.env_id,
            "REQUIREMENT": llamagym_requirement(),
            "ACTION_COUNT": str(env.action_count),
            "ACTION_PLACEHOLDER_LINES": _placeholder_names(env),
            "OBSERVATION_NOTE_LINES": _observation_notes(env, self.env_id),
            "DESCRIPTION": self._description(),
            "WHAT": self._what(),
        }

    def _description(self) -> str:
        """The agent's line in ``llamagym list``."""
        if self.worked_example:
            return "FrozenLake-v1: cross the ice to the goal without falling in a hole"
        if self.own_env:
            return f"{self.env_id}: find the secret number from 1 to 16 by higher/lower hints"
        return f"{self.env_id}: an LLM agent (TODO: say what it does)"

    def _what(self) -> str:
        """What the package adds, for its README and its metadata."""
        if self.kind == "algorithm":
            return "a REINFORCE-style training algorithm"
        if self.own_env:
            return f"an LLM agent for its own Gymnasium env, {self.env_id}"
        return f"an LLM agent for Gymnasium's {self.env_id}"


def _placeholder_names(env: EnvFacts) -> str:
    """``ACTION_NAMES``' body: one placeholder per action, with what the env's
    documentation says the action does beside it."""
    lines = []
    for index in range(env.action_count):
        meaning = env.action_meanings.get(index, "")
        comment = f"  # {meaning[:70]}" if meaning else ""
        lines.append(f'"action {index}",{comment}')
    return "\n".join(lines)


def _observation_notes(env: EnvFacts, env_id: str, limit: int = 30) -> str:
    """Comment lines quoting the env's own description of its observations."""
    if not env.observation_notes:
        return f"# help(gymnasium.make({env_id!r}).unwrapped) may say what it holds."
    quoted: list[str] = []
    for line in env.observation_notes:
        # The docstring's own line breaks carry its lists and tables: keep them, and
        # only wrap a line too long for a 100-column file.
        quoted += textwrap.wrap(line, 84, subsequent_indent="  ") or [""]
    if len(quoted) > limit:
        quoted = quoted[:limit] + [f"(more: help(gymnasium.make({env_id!r}).unwrapped))"]
    lines = ["# What the env's documentation says about its observations:"]
    lines += [f"#   {line}".rstrip() for line in quoted]
    return "\n".join(lines)


def _doc_sections(doc: str) -> dict[str, list[str]]:
    """``## Title`` sections of a Gymnasium env's docstring, title -> body lines."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        heading = re.match(r"\s*##\s+(.+?):?\s*$", line)
        if heading:
            current = sections.setdefault(heading.group(1).strip().lower(), [])
        elif current is not None:
            current.append(line.strip())
    return sections


def _action_meanings(lines: list[str]) -> dict[int, str]:
    """``- 0: Move south`` list items or ``| 0 | apply -1 torque |`` table rows."""
    meanings: dict[int, str] = {}
    for line in lines:
        item = re.match(r"-\s*(\d+)\s*:\s*(.+)$", line) or re.match(
            r"\|\s*(\d+)\s*\|\s*([^|]+?)\s*\|", line
        )
        if item:
            meanings.setdefault(int(item.group(1)), item.group(2).strip().rstrip("."))
    return meanings


def inspect_env(env_id: str, name: str = "NAME") -> EnvFacts:
    """The size of ``env_id``'s ``Discrete`` action space, and what its documentation
    says about the actions and the observations. ``name`` is the plugin's, for the
    command an error suggests."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the error below says what matters
            env = gymnasium.make(env_id)
    except (gymnasium.error.NameNotFound, gymnasium.error.NamespaceNotFound) as error:
        raise ScaffoldError(
            f"cannot make env {env_id!r}: Gymnasium does not know this id "
            f"({' '.join(str(error).split())})"
            f"{_similar_ids(env_id)}; for an environment of your own: "
            f"llamagym new-plugin {name} --env-class"
        ) from None
    except (gymnasium.error.VersionNotFound, gymnasium.error.DeprecatedEnv) as error:
        raise ScaffoldError(f"cannot make env {env_id!r}: {error}{_similar_ids(env_id)}") from None
    except Exception as error:  # e.g. an optional dependency of the env is missing
        raise ScaffoldError(
            f"cannot make env {env_id!r}: {type(error).__name__}: {error}"
        ) from None
    space = env.action_space
    doc = inspect.getdoc(type(env.unwrapped)) or ""
    env.close()
    if not isinstance(space, gymnasium.spaces.Discrete):
        raise ScaffoldError(
            f"env {env_id!r} has the action space {space}; the env template needs a "
            "Discrete one (one name per action). Generate from a Discrete env and adapt "
            "legal_actions()/env_action(), or pick another env"
        )
    sections = _doc_sections(doc)
    return EnvFacts(
        int(space.n),
        _action_meanings(sections.get("action space", [])),
        tuple(sections.get("observation space", [])),
    )


def _similar_ids(env_id: str) -> str:
    """``; registered ids like it: ...`` for the ids of ``env_id``'s family, if any."""
    family = env_id.split("-")[0]
    known = [key for key in gymnasium.registry if key.startswith(family) and key != env_id]
    return f"; registered ids like it: {', '.join(known[:5])}" if known else ""


def _check_own_env_id(env_id: str) -> None:
    """Refuse an id whose name Gymnasium already uses: registering it beside (or instead
    of) Gymnasium's env would make ``gymnasium.make`` give the wrong game."""
    taken = gymnasium.envs.registration.parse_env_id(env_id)[:2]
    same = [key for key, spec in gymnasium.registry.items()
            if (spec.namespace, spec.name) == taken]
    if same:
        raise ScaffoldError(
            f"--env-class registers its env as {env_id!r}, but Gymnasium already has an "
            f"env of that name ({', '.join(same[:3])}); choose another NAME"
        )


def render(text: str, values: Mapping[str, str]) -> str:
    """``text`` with every token replaced by its value (one pass: a value is never
    read for tokens). A token without a value is a template error (``KeyError``)."""

    def replace(match: re.Match[str]) -> str:
        indent, block, inline = match.groups()
        if inline is not None:
            return values[inline]
        lines = values[block].split("\n")
        return "\n".join(indent + line if line else line for line in lines)

    return _TOKEN.sub(replace, text)


def layer_files(layer: str) -> dict[str, Path]:
    """Relative path (with its tokens) -> file, for every template of ``layer``."""
    folder = TEMPLATES / layer
    files = {}
    for path in sorted(folder.rglob("*")):
        relative = path.relative_to(folder)
        # Tools leave caches beside the templates (ruff's .ruff_cache, __pycache__).
        cache = any(part.startswith(".") or part == "__pycache__" for part in relative.parts[:-1])
        if path.is_file() and not cache:
            files[relative.as_posix()] = path
    return files


def plugin_files(spec: PluginSpec) -> dict[str, str]:
    """Relative path -> content of every file of the package."""
    values = spec.substitutions()
    templates: dict[str, Path] = {}
    for layer in spec.layers:
        templates.update(layer_files(layer))
    return {
        render(relative, values): render(path.read_text(encoding="utf-8"), values)
        for relative, path in templates.items()
    }


def write_plugin(
    name: str,
    kind: str = "env",
    directory: Path | str = ".",
    env_id: str | None = None,
    env_class: bool = False,
) -> tuple[PluginSpec, Path]:
    """Write the package into ``directory/llamagym-NAME`` and return its spec and path.

    ``env_id`` (default ``FrozenLake-v1``) names the Gymnasium env of an env plugin;
    ``env_class`` gives the package an env of its own instead, registered as
    :func:`own_env_id`. Refuses to touch an existing folder: nothing is ever overwritten.
    """
    validate_name(name)
    if kind not in KINDS:
        raise ScaffoldError(f"--kind {kind!r} is not known; use one of: {', '.join(KINDS)}")
    if kind == "algorithm" and (env_id is not None or env_class):
        option = "--env-class" if env_class else "--env-id"
        raise ScaffoldError(f"{option} applies to --kind env only")
    if env_class and env_id is not None:
        raise ScaffoldError(
            "--env-id names an env Gymnasium knows, --env-class writes one of the "
            "package's own: give one of them, not both"
        )
    env = None
    if env_class:
        env_id = own_env_id(name)
        _check_own_env_id(env_id)
    elif env_id is None:
        env_id = DEFAULT_ENV_ID
    elif kind == "env" and env_id != DEFAULT_ENV_ID:
        env = inspect_env(env_id, name)
    spec = PluginSpec(name, kind, env_id, env, own_env=env_class)
    check_name_is_free(name, kind)
    root = _target_folder(directory) / spec.folder
    if os.path.lexists(root):
        raise ScaffoldError(
            f"{str(root)!r} already exists; new-plugin never overwrites: choose another "
            "NAME or --dir, or move the folder away"
        )
    _write_package(root, plugin_files(spec))
    return spec, root


def _target_folder(directory: Path | str) -> Path:
    """``--dir`` as a folder that exists or can be created: a file, a device, a link to
    nothing or to itself, a path too long is a :class:`ScaffoldError`."""
    folder = expand_user(directory)
    try:
        mode = os.stat(folder).st_mode
    except FileNotFoundError:
        if os.path.lexists(folder):
            raise ScaffoldError(
                f"--dir {str(folder)!r} is a symbolic link to nothing; pass a folder"
            ) from None
        return folder
    except OSError as error:
        raise ScaffoldError(f"--dir {_os_problem(error)}") from None
    if not stat.S_ISDIR(mode):
        raise ScaffoldError(
            f"--dir {str(folder)!r} is not a folder; pass a folder (it is created if missing)"
        )
    return folder


def _os_problem(error: OSError) -> str:
    return path_problem(error) or f"{str(error.filename)!r}: {error.strerror or error}"


def _write_package(root: Path, files: Mapping[str, str]) -> None:
    """Write ``files`` into a hidden folder beside ``root`` and rename it to ``root``
    when complete. Any failure removes that folder, and the folders made for it, and is
    a :class:`ScaffoldError` in one line."""
    missing = [folder for folder in (root.parent, *root.parent.parents)
               if not os.path.lexists(folder)]
    staging = None
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", suffix=".tmp", dir=root.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(staging, 0o777 & ~umask)  # mkdtemp's folder is private; a package is not
        for relative, content in files.items():
            path = staging / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content, encoding="utf-8")
        os.rename(staging, root)
    except OSError as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        for folder in missing:  # deepest first: only the ones made here, now empty
            with contextlib.suppress(OSError):
                folder.rmdir()
        reason = path_problem(error, name=False) or error.strerror or str(error)
        raise ScaffoldError(
            f"could not write the plugin to {str(root)!r} ({reason}); nothing was left "
            "behind"
        ) from None
