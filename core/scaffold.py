"""``llamagym new-plugin``: write a complete, installable plugin package.

The package follows the layout of the built-in env plugins (``llamagym_blackjack``):
a ``src/`` layout, one ``plugin.py`` module as the entry point in group ``llamagym``
that registers the agent or algorithm as a lazy ``"module:Class"`` string, the class in
its own module, a README and tests that use :mod:`llamagym.testing`. The files are
templates with ``$name`` placeholders (``string.Template``: Python code has no ``$``).

Two kinds:

* ``env``: an :class:`~llamagym.Agent` for a Gymnasium environment. For the default,
  ``FrozenLake-v1``, a worked example (prompts that draw the lake, a hand-written
  route as a baseline); for any other env id with a ``Discrete`` action space, the
  same skeleton with placeholder action names marked ``TODO``.
* ``algorithm``: REINFORCE with a batch-mean baseline and a pydantic ``Config``, the
  smallest complete :class:`~llamagym.Algorithm`.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

from llamagym.errors import LlamaGymError

KINDS = ("env", "algorithm")
DEFAULT_ENV_ID = "FrozenLake-v1"
_NAME = re.compile(r"[a-z][a-z0-9_]*")


class ScaffoldError(LlamaGymError):
    """The plugin cannot be written as asked (bad name, existing folder, unknown env)."""


def validate_name(name: str) -> str:
    """``name`` if it can be the agent/algorithm name and the ``llamagym_NAME`` import
    name; otherwise a :class:`ScaffoldError` that says what to type instead."""
    if _NAME.fullmatch(name) and not keyword.iskeyword(name):
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


def llamagym_requirement(version: str | None = None) -> str:
    """The ``llamagym`` range a new plugin depends on: this release series only, because
    before 1.0 a minor release may change the hooks (after it, only a major one)."""
    if version is None:
        from llamagym import __version__ as version
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
        stem = "".join(part.capitalize() for part in self.name.split("_") if part)
        return stem + ("Agent" if self.kind == "env" else "")

    @property
    def worked_example(self) -> bool:
        return self.kind == "env" and self.env_id == DEFAULT_ENV_ID

    def substitutions(self) -> dict[str, str]:
        env = self.env or EnvFacts(0)
        return {
            "name": self.name,
            "package": self.package,
            "distribution": self.distribution,
            "Class": self.class_name,
            "env_id": self.env_id,
            "requirement": llamagym_requirement(),
            "action_count": str(env.action_count),
            "placeholder_names": _placeholder_names(env),
            "observation_notes": _observation_notes(env, self.env_id),
            "description": (
                "FrozenLake-v1: cross the ice to the goal without falling in a hole"
                if self.worked_example
                else f"{self.env_id}: an LLM agent (TODO: say what it does)"
            ),
            "what": (
                f"an LLM agent for Gymnasium's {self.env_id}"
                if self.kind == "env"
                else "a REINFORCE-style training algorithm"
            ),
        }


def _placeholder_names(env: EnvFacts) -> str:
    """``ACTION_NAMES``' body: one placeholder per action, with what the env's
    documentation says the action does beside it."""
    lines = []
    for index in range(env.action_count):
        meaning = env.action_meanings.get(index, "")
        comment = f"  # {meaning[:70]}" if meaning else ""
        lines.append(f'    "action {index}",{comment}')
    return "\n".join(lines)


def _observation_notes(env: EnvFacts, env_id: str, limit: int = 30) -> str:
    """Comment lines quoting the env's own description of its observations."""
    import textwrap

    if not env.observation_notes:
        return f"        # help(gymnasium.make({env_id!r}).unwrapped) may say what it holds."
    quoted: list[str] = []
    for line in env.observation_notes:
        # The docstring's own line breaks carry its lists and tables: keep them, and
        # only wrap a line too long for a 100-column file.
        quoted += textwrap.wrap(line, 84, subsequent_indent="  ") or [""]
    if len(quoted) > limit:
        quoted = quoted[:limit] + [f"(more: help(gymnasium.make({env_id!r}).unwrapped))"]
    lines = ["        # What the env's documentation says about its observations:"]
    lines += [f"        #   {line}".rstrip() for line in quoted]
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


def inspect_env(env_id: str) -> EnvFacts:
    """The size of ``env_id``'s ``Discrete`` action space, and what its documentation
    says about the actions and the observations."""
    import inspect
    import warnings

    import gymnasium

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the error below says what matters
            env = gymnasium.make(env_id)
    except (
        gymnasium.error.NameNotFound,
        gymnasium.error.VersionNotFound,
        gymnasium.error.DeprecatedEnv,
        gymnasium.error.NamespaceNotFound,
    ) as error:
        family = env_id.split("-")[0]
        known = [key for key in gymnasium.registry if key.startswith(family) and key != env_id]
        hint = f"; registered ids like it: {', '.join(known[:5])}" if known else ""
        raise ScaffoldError(f"cannot make env {env_id!r}: {error}{hint}") from None
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


def plugin_files(spec: PluginSpec) -> dict[str, str]:
    """Relative path -> content of every file of the package."""
    values = spec.substitutions()
    if spec.kind == "env":
        module, body = "agent.py", (FROZENLAKE_AGENT if spec.worked_example else GENERIC_AGENT)
        tests = FROZENLAKE_TESTS if spec.worked_example else GENERIC_TESTS
        plugin, readme_usage = ENV_PLUGIN, ENV_README_USAGE
    else:
        module, body, tests = "algorithm.py", ALGORITHM, ALGORITHM_TESTS
        plugin, readme_usage = ALGORITHM_PLUGIN, ALGORITHM_README_USAGE
    templates = {
        "pyproject.toml": PYPROJECT,
        "README.md": README + readme_usage + README_END,
        ".gitignore": GITIGNORE,
        f"src/{spec.package}/__init__.py": INIT,
        f"src/{spec.package}/plugin.py": plugin,
        f"src/{spec.package}/{module}": body,
        f"tests/test_{spec.name}.py": tests,
    }
    return {path: Template(text).substitute(values) for path, text in templates.items()}


def write_plugin(
    name: str,
    kind: str = "env",
    directory: Path | str = ".",
    env_id: str = DEFAULT_ENV_ID,
) -> tuple[PluginSpec, Path]:
    """Write the package into ``directory/llamagym-NAME`` and return its spec and path.

    Refuses to touch an existing folder: nothing is ever overwritten.
    """
    validate_name(name)
    if kind not in KINDS:
        raise ScaffoldError(f"--kind {kind!r} is not known; use one of: {', '.join(KINDS)}")
    if kind == "algorithm" and env_id != DEFAULT_ENV_ID:
        raise ScaffoldError("--env-id applies to --kind env only")
    env = inspect_env(env_id) if kind == "env" and env_id != DEFAULT_ENV_ID else None
    spec = PluginSpec(name, kind, env_id, env)
    root = Path(directory).expanduser() / spec.folder
    if root.exists():
        raise ScaffoldError(
            f"{str(root)!r} already exists; new-plugin never overwrites: choose another "
            "NAME or --dir, or move the folder away"
        )
    files = plugin_files(spec)
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
    return spec, root


# -- templates: packaging ---------------------------------------------------------------
PYPROJECT = '''\
[build-system]
requires = ["setuptools>=77"]  # builds wheels itself since 70.1
build-backend = "setuptools.build_meta"

[project]
name = "$distribution"
version = "0.1.0"
description = "LlamaGym plugin: $what."
readme = "README.md"
requires-python = ">=3.10"
license = "MIT"
# The LlamaGym release series this plugin was written against: before 1.0 a minor
# release may change the hooks, so widen the range only after testing the new one.
dependencies = ["$requirement", "gymnasium>=1.0"]

[project.optional-dependencies]
test = ["pytest>=8"]

# What makes LlamaGym find the plugin: an entry point in the group "llamagym".
# The name on the left is the plugin's name (LLAMAGYM_DISABLE_PLUGINS=$name turns it off).
[project.entry-points.llamagym]
$name = "$package.plugin"

[tool.setuptools.packages.find]
where = ["src"]

[tool.pytest.ini_options]
testpaths = ["tests"]
addopts = "--import-mode=importlib"

[tool.ruff]
line-length = 100

[tool.ruff.lint]
select = ["E", "F", "I", "UP", "B", "SIM"]
'''

GITIGNORE = """\
__pycache__/
*.egg-info/
build/
dist/
runs/
"""

INIT = '''\
"""LlamaGym plugin $distribution: $what."""

__version__ = "0.1.0"
'''

# -- templates: env kind ---------------------------------------------------------------
ENV_PLUGIN = '''\
"""Entry point of the plugin (see pyproject.toml). It registers the agent by a
"module:Class" string, so `llamagym list` does not import the agent module (or torch)."""

from collections.abc import Callable

from llamagym import hookimpl


@hookimpl
def llamagym_register_agents(register: Callable[..., None]) -> None:
    register(
        "$name",
        "$package.agent:$Class",
        # The line `llamagym list` shows for the agent.
        description="$description",
        env_id="$env_id",
    )


# An environment of your own? Register it with Gymnasium here, then set env_id to it:
#
# @hookimpl
# def llamagym_register_envs(register: Callable[..., None]) -> None:
#     register(id="MyGame-v0", entry_point="$package.env:MyGameEnv", max_episode_steps=200)
'''

FROZENLAKE_AGENT = '''\
"""The $name agent: how the model sees FrozenLake-v1 and what it may answer.

The model never sees the env's numbers, only the text below: the lake as a picture
with the agent's square marked, and four move words. In score mode (the default here)
the model ranks the four words; in generate mode it writes a reply that the extraction
chain reads (JSON {"action": "down"}, then extract_action below, then any move word).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamagym.agent import Agent

# One name per action of the env's Discrete(4) space, in the env's order.
ACTION_NAMES = ("left", "down", "right", "up")

# Gymnasium's default "4x4" map: S start, F frozen, H hole, G goal.
LAKE = ("SFFF", "FHFH", "FFFH", "HFFG")

# A shortest safe route across that map, as state -> move (state = row * 4 + column).
ROUTE = {0: "right", 1: "right", 2: "down", 6: "down", 10: "down", 14: "right"}


def random_move(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def follow_route(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    """Walk the hand-written route: the score a trained agent should reach."""
    return ROUTE.get(int(observation), "down")


class $Class(Agent):
    name = "$name"
    env_id = "FrozenLake-v1"
    # Not slippery: every move goes where it says, so a small model can learn the route
    # in minutes. Remove this line to play Gymnasium's default, slippery lake.
    env_kwargs = {"is_slippery": False}
    action_names = ACTION_NAMES
    # Each baseline is played on the same seeds as the trained agent at the end of a run.
    baselines = {"random": random_move, "route": follow_route}
    # Laid over LlamaGym's defaults; `llamagym config show $name` prints the result.
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 64, "epochs": 4, "gamma": 0.95},
        "training": {"episodes": 3000, "eval_episodes": 100},
    }

    def get_system_prompt(self) -> str:
        return (
            "Cross the frozen lake from S to the goal G without stepping into a hole H. "
            "Answer with one move: left, down, right or up."
        )

    def format_observation(self, observation: Any) -> str:
        row, column = divmod(int(observation), len(LAKE[0]))
        picture = [list(line) for line in LAKE]
        picture[row][column] = "@"
        lines = ["".join(line) for line in picture]
        return "\\n".join(lines) + f"\\nYou are at @ (row {row + 1}, column {column + 1})."

    def extract_action(self, response: str) -> str | None:
        # Asked after the JSON parser and before the regex over the move words: read
        # the compass words a model may use instead. Return None when unsure, so the
        # regex parser still gets its turn.
        compass = {"west": "left", "south": "down", "east": "right", "north": "up"}
        words = response.lower().replace(".", " ").split()
        found = [compass[word] for word in words if word in compass]
        return found[-1] if found else None
'''

GENERIC_AGENT = '''\
"""The $name agent: how the model sees $env_id and what it may answer.

The model never sees the env's numbers, only the text this class writes, and it
answers with one of the action names. In score mode (the default here) the model ranks
the names; in generate mode it writes a reply that the extraction chain reads (JSON
{"action": "<name>"}, then extract_action if you add one, then any action name).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llamagym.agent import Agent

# One name per action of $env_id's Discrete($action_count) space, in the env's order
# (index 0 first). TODO: replace each placeholder with a word or two that says what
# the action does (the comments quote the env's documentation). The model answers
# with these names; no name may contain another as whole words.
ACTION_NAMES = (
$placeholder_names
)


def random_action(observation: Any, info: dict, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


class $Class(Agent):
    name = "$name"
    env_id = "$env_id"
    action_names = ACTION_NAMES
    # Each baseline is played on the same seeds as the trained agent at the end of a
    # run. TODO: add a hand-written policy, so the report shows what "good" is.
    baselines = {"random": random_action}
    # Laid over LlamaGym's defaults; `llamagym config show $name` prints the result.
    defaults = {
        "rollout": {"mode": "score", "num_envs": 8, "history_turns": 0},
        "algorithm": {"name": "ppo", "lr": 1e-3, "episodes_per_update": 16,
                      "minibatch_size": 64, "epochs": 4, "gamma": 0.95},
        "training": {"episodes": 3000, "eval_episodes": 100},
    }

    def get_system_prompt(self) -> str:
        # TODO: say what the goal is and how to answer.
        return "Play $env_id. Answer with one action: " + ", ".join(ACTION_NAMES) + "."

    def format_observation(self, observation: Any) -> str:
        # TODO: describe the observation in words the model can learn from (decode
        # numbers into positions, names, small values); the raw value is only a start.
$observation_notes
        return f"Observation: {observation}"
'''

ENV_TESTS_HEAD = '''\
"""Tests of the $distribution plugin: `pip install -e ".[test]"`, then `pytest`.

The fake_llm fixture comes from LlamaGym's pytest plugin (llamagym.testing), which
pytest loads by itself wherever LlamaGym is installed.
"""

from __future__ import annotations

import json

from llamagym.evaluation import evaluate_baseline
from llamagym.plugin_manager import get_plugins
from llamagym.testing import assert_agent_conforms

from $package.agent import $Class


def test_registered_through_the_entry_point() -> None:
    registration = get_plugins().get("agent", "$name")
    assert registration.distribution == "$distribution"
    assert registration.load() is $Class


def test_passes_the_conformance_checks() -> None:
    # The checks of `llamagym check $name`: seeded resets, prompts that fit, action
    # names that parse back, baselines, and whole episodes with a scripted model.
    assert_agent_conforms($Class)
'''

FROZENLAKE_TESTS = ENV_TESTS_HEAD + '''

def test_the_prompt_draws_the_lake() -> None:
    text = $Class().format_observation(6)
    assert text.splitlines()[1] == "FH@H"
    assert text.endswith("(row 2, column 3).")


def test_a_scripted_model_walks_the_route(fake_llm) -> None:
    # Each reply is read by the extraction chain: JSON, a bare word, a sentence, and a
    # compass word that only this agent's extract_action knows.
    llm = fake_llm(['{"action": "right"}', "right", "down", "I go down.", "south", "Right!"])
    [episode] = llm.play($Class(), episodes=1)
    chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert chosen == ["right", "right", "down", "down", "down", "right"]
    assert episode.env_return == 1.0 and episode.invalid_replies == 0
    assert "@FFF" in llm.prompts[0]  # the model was shown the start square


def test_an_unreadable_reply_gets_a_legal_action_and_a_penalty(fake_llm) -> None:
    llm = fake_llm(["I would rather not.", json.dumps({"action": "down"})], cycle=True)
    [episode] = llm.play($Class(), episodes=1, max_turns=200)
    first = episode.turns[0]
    assert not first.valid and first.action_index is not None
    assert first.reward < 0  # the invalid-action penalty
    assert episode.turns[1].valid


def test_the_route_baseline_always_arrives() -> None:
    agent = $Class()
    assert evaluate_baseline(agent, "route", episodes=5).mean == 1.0
    assert evaluate_baseline(agent, "random", episodes=50, seed=1).mean < 0.5
'''

GENERIC_TESTS = ENV_TESTS_HEAD + '''

def test_replies_are_read_through_the_extraction_chain(fake_llm) -> None:
    names = list($Class.action_names)
    # JSON, then a bare name, then a reply naming no action at all.
    llm = fake_llm([json.dumps({"action": names[0]}), names[-1], "I am not sure."], cycle=True)
    [episode] = llm.play($Class(), episodes=1, max_turns=5000)
    chosen = [turn.legal_actions[turn.action_index] for turn in episode.turns]
    assert chosen[:2] == [names[0], names[-1]][: len(chosen)]
    # An unreadable reply still gets a legal action (the invalid-action policy).
    assert all(turn.valid == (turn.reply != "I am not sure.") for turn in episode.turns)


def test_the_random_baseline_plays() -> None:
    result = evaluate_baseline($Class(), "random", episodes=3)
    assert result.episodes == 3
'''

ENV_README_USAGE = """\
## Use

```console
$$ pip install -e ".[test]"
$$ llamagym list  # the agent `$name` is listed, from $distribution
$$ llamagym check $name  # conformance checks: env, prompts, parsing, baselines
$$ pytest  # this package's tests
$$ llamagym run $name  # train on the offline tiny model, then a report
```

The agent lives in `src/$package/agent.py`: its action names, prompts, learning
defaults and baselines. `src/$package/plugin.py` registers it with LlamaGym.
"""

# -- templates: algorithm kind ---------------------------------------------------------
ALGORITHM_PLUGIN = '''\
"""Entry point of the plugin (see pyproject.toml). It registers the algorithm by a
"module:Class" string, so `llamagym list` does not import torch."""

from collections.abc import Callable

from llamagym import hookimpl


@hookimpl
def llamagym_register_algorithms(register: Callable[..., None]) -> None:
    register(
        "$name",
        "$package.algorithm:$Class",
        description="REINFORCE with a batch-mean baseline (the $distribution plugin)",
    )
'''

ALGORITHM = '''\
"""$Class: REINFORCE (Williams, 1992) with a batch-mean baseline, one file top to bottom.

Each turn's log-probability is pushed up in proportion to how much better than the
batch average its return was. The same code serves both action modes: the policy's
evaluation gives one log-probability per "action unit" (the chosen candidate in score
mode, each reply token in generate mode) with a mask, and a turn's log-probability is
their masked sum.
"""

from __future__ import annotations

import math

import torch
from llamagym.algorithm import Algorithm, AlgorithmConfig, minibatches, rollout_metrics
from llamagym.config import RolloutSettings
from llamagym.policy import Policy
from llamagym.trajectory import Episode, Turn
from pydantic import Field


class ${Class}Config(AlgorithmConfig):
    """The run's `algorithm` section (`--set algorithm.lr=3e-4`); unknown keys fail."""

    lr: float = Field(1e-3, gt=0, description="Adam learning rate.")
    episodes_per_update: int = Field(32, ge=2, description="Episodes collected per update.")
    minibatch_size: int = Field(64, ge=1, description="Turns per gradient step.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount across an episode's turns.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")


class $Class(Algorithm):
    Config = ${Class}Config

    def __init__(self, policy: Policy, config: ${Class}Config, rollout: RolloutSettings):
        super().__init__(policy, config, rollout)
        # Only the language model's weights: REINFORCE has no use for the value head.
        self.optimizer = torch.optim.Adam(self.model_parameters(), lr=config.lr)

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        config = self.config
        # 1. Every turn's return: its reward plus the discounted rewards after it.
        turns: list[Turn] = []
        returns: list[float] = []
        for episode in episodes:
            running, reversed_returns = 0.0, []
            for turn in reversed(episode.turns):
                running = turn.reward + config.gamma * running
                reversed_returns.append(running)
            turns += episode.turns
            returns += reversed(reversed_returns)
        # 2. Advantage: the return minus the batch mean, so better-than-usual actions
        #    become likelier and worse ones less likely.
        baseline = sum(returns) / len(returns)
        advantages = torch.tensor([r - baseline for r in returns], device=self.policy.device)
        # 3. One gradient step per minibatch on -advantage x log pi(action | prompt).
        #    minibatch_count: as many steps as every other process takes when a run
        #    trains in several (their gradients are averaged in self.step).
        order = list(range(len(turns)))
        self.rng.shuffle(order)  # seeded: a seeded run repeats exactly
        losses = []
        steps = self.minibatch_count(len(turns), config.minibatch_size)
        for batch in minibatches(order, config.minibatch_size, steps):
            evaluation = self.evaluate([turns[i] for i in batch])
            turn_logprobs = (evaluation.logprobs * evaluation.mask).sum(-1)
            loss = -(advantages[batch] * turn_logprobs).mean()
            if self.step(self.optimizer, loss, config.max_grad_norm):  # skips NaN losses
                losses.append(loss.item())
        self.updates += 1
        return {
            **rollout_metrics(episodes),
            "policy_loss": sum(losses) / len(losses) if losses else math.nan,
            "policy_steps": float(len(losses)),
        }
'''

ALGORITHM_TESTS = '''\
"""Tests of the $distribution plugin: `pip install -e ".[test]"`, then `pytest`.

BanditAgent (two levers, one pays more) and tiny_agent (the offline tiny model with
small settings) come from LlamaGym's testing helpers, llamagym.testing.
"""

from __future__ import annotations

import math

import pytest
from llamagym.plugin_manager import get_plugins
from llamagym.testing import BanditAgent, action_probabilities, tiny_agent
from pydantic import ValidationError

from $package.algorithm import $Class


def test_registered_through_the_entry_point() -> None:
    registration = get_plugins().get("algorithm", "$name")
    assert registration.distribution == "$distribution"
    assert registration.load() is $Class


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError):
        $Class.Config(lr=-1.0)
    with pytest.raises(ValidationError):
        $Class.Config(no_such_key=1)


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_one_update_changes_every_weight(mode: str) -> None:
    agent = tiny_agent(BanditAgent, rollout={"mode": mode, "max_new_tokens": 4,
                       "invalid_action": {"policy": "random"}}, algorithm={"name": "$name"})
    before = {n: p.detach().clone() for n, p in agent.policy.model.named_parameters()}
    envs = [agent.make_env() for _ in range(8)]
    metrics = agent.algorithm.update(agent.engine.collect(envs, 32))
    assert metrics["policy_steps"] > 0 and math.isfinite(metrics["policy_loss"])
    after = dict(agent.policy.model.named_parameters())
    assert [n for n, p in before.items() if p.equal(after[n].detach())] == []


def test_learns_the_better_lever() -> None:
    agent = tiny_agent(BanditAgent, rollout={"num_envs": 32},
                       algorithm={"name": "$name", "episodes_per_update": 64, "lr": 3e-3})
    envs = [agent.make_env() for _ in range(32)]
    assert action_probabilities(agent, 0)[1] < 0.9
    for _ in range(15):
        agent.algorithm.update(agent.engine.collect(envs, 64))
        if action_probabilities(agent, 0)[1] > 0.9:
            break
    assert action_probabilities(agent, 0)[1] > 0.9
'''

ALGORITHM_README_USAGE = """\
## Use

```console
$$ pip install -e ".[test]"
$$ llamagym list  # the algorithm `$name` is listed
$$ pytest  # this package's tests
$$ llamagym run blackjack --algorithm $name  # train any agent with it
$$ llamagym config show blackjack -a $name  # its settings, with descriptions
```

The algorithm lives in `src/$package/algorithm.py`, its settings on top.
`src/$package/plugin.py` registers it with LlamaGym.
"""

# -- templates: README -----------------------------------------------------------------
README = """\
# $distribution

A [LlamaGym](https://github.com/KhoomeiK/LlamaGym) plugin: $what.

"""

README_END = """
## Publish

Raise `version` in `pyproject.toml`, then:

```console
$$ python -m pip install build twine
$$ python -m build  # dist/*.whl and dist/*.tar.gz
$$ python -m twine upload dist/*
```

It depends on `$requirement`: the LlamaGym release series it was written and tested
against. Test against a new series before widening the range.
"""
