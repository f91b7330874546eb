"""What a plugin author meets on the way from `llamagym new-plugin` to a trained agent:
agent options set from the command line reach the agent and `config show`, `check`
judges them, the run says which budget applies, every plugin has a version, `list`
keeps long names whole when piped, building the tiny model draws no progress bar, and
no message names a learning curve that was not drawn."""

from __future__ import annotations

import importlib
import json
import logging
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, Field
from typer.testing import CliRunner

import llamagym
from llamagym import hookimpl
from llamagym.cli.app import app
from llamagym.devtools.agent_checks import CHECK_NAMES
from llamagym.devtools.conformance import check_agent
from llamagym.devtools.scaffold import write_plugin
from llamagym.plugin_runtime.manager import get_plugins

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def invoke(*args: str) -> Any:
    """``llamagym ARGS`` in this process; the logging set-up a run makes is undone."""
    root, package = logging.getLogger(), logging.getLogger("llamagym")
    handlers, level = list(root.handlers), package.level
    try:
        return CliRunner().invoke(app, list(args))
    finally:
        root.handlers[:] = handlers
        package.setLevel(level)


def one_line(text: str) -> str:
    """Output with the line breaks a narrow console may insert taken out."""
    return text.replace("\n", "")


# -- agent options, on the package `llamagym new-plugin` writes ---------------------------
@pytest.fixture(scope="module")
def icy(tmp_path_factory) -> Iterator[types.ModuleType]:
    """The worked example (`llamagym new-plugin icy`), importable in this process; its
    plugin module is what the entry point would load."""
    _, root = write_plugin("icy", directory=tmp_path_factory.mktemp("plugins"))
    sys.path.insert(0, str(root / "src"))
    try:
        yield importlib.import_module("llamagym_icy.plugin")
    finally:
        sys.path.remove(str(root / "src"))
        for name in [name for name in sys.modules if name.startswith("llamagym_icy")]:
            del sys.modules[name]


@pytest.fixture
def icy_registered(icy, register_plugin) -> type:
    register_plugin(icy, "icy")
    return get_plugins().registry.get("agent", "icy").load()


def test_the_example_declares_an_option_that_reaches_the_env(icy_registered) -> None:
    options = icy_registered.Config
    assert issubclass(options, BaseModel) and "is_slippery" in options.model_fields
    default = options().is_slippery
    assert icy_registered().make_env().spec.kwargs["is_slippery"] is default
    flipped = icy_registered(config={"agent": {"is_slippery": not default}})
    assert flipped.options.is_slippery is (not default)
    assert flipped.make_env().spec.kwargs["is_slippery"] is (not default)


def test_config_show_lists_the_options_with_their_defaults(icy_registered) -> None:
    field = icy_registered.Config.model_fields["is_slippery"]
    shown = invoke("config", "show", "icy")
    assert shown.exit_code == 0, shown.output
    config = yaml.safe_load(shown.stdout)
    assert config["agent"] == {"name": "icy", "is_slippery": field.default}
    assert f"# {field.description}" in shown.stdout
    assert "--set agent.KEY=VALUE" in shown.stdout  # the header says how to set them

    value = not field.default
    changed = invoke("config", "show", "icy", "--set", f"agent.is_slippery={str(value).lower()}")
    assert changed.exit_code == 0, changed.output
    assert yaml.safe_load(changed.stdout)["agent"]["is_slippery"] is value
    assert f"is_slippery: {str(value).lower()}  # from --set" in changed.stdout

    typo = invoke("config", "show", "icy", "--set", "agent.slippery=true")
    assert "did you mean 'is_slippery'" in str(typo.exception)  # `llamagym`: exit code 2


def test_options_from_set_and_from_a_file_reach_the_agent_of_a_run(
    icy_registered, tmp_path, monkeypatch
) -> None:
    made = stub_trainer(monkeypatch, tmp_path)
    value = not icy_registered.Config().is_slippery
    result = invoke("run", "icy", "--quiet", "--set", f"agent.is_slippery={str(value).lower()}")
    assert result.exit_code == 0, result.output
    [trainer] = made
    assert trainer.agent.options.is_slippery is value
    assert trainer.agent.make_env().spec.kwargs["is_slippery"] is value

    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump({"agent": {"is_slippery": value}}))
    made.clear()
    result = invoke("run", "icy", "--quiet", "--config", str(file))
    assert result.exit_code == 0, result.output
    assert made[0].agent.options.is_slippery is value


def test_check_reports_the_options_in_use(icy_registered) -> None:
    value = not icy_registered.Config().is_slippery
    results = check_agent(
        icy_registered,
        {"agent": {"is_slippery": value}},
        episodes=1,
        skip=[n for n in CHECK_NAMES if n != "options"],
    )
    options = results[0]
    assert options.name == "options" and options.status == "pass", options.lines()
    assert f"is_slippery={value!r}" in options.detail


class NoDefault(BaseModel):
    model_config = ConfigDict(extra="forbid")
    levers: int = Field(description="How many levers.")


class Undocumented(BaseModel):
    model_config = ConfigDict(extra="forbid")
    levers: int = 2


class Permissive(BaseModel):
    levers: int = Field(2, description="How many levers.")


class CalledName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field("x", description="A name.")


class NotAModel:
    levers = 2


@pytest.mark.parametrize(
    ("config_class", "says", "fix"),
    [
        (NoDefault, "agent.levers has no default", "give every option a default"),
        (Undocumented, "agent.levers has no description", "description="),
        (Permissive, "accepts unknown keys", 'extra="forbid"'),
        (CalledName, "called 'name'", "call the option something else"),
        (NotAModel, "not a pydantic model", "class Config(BaseModel)"),
    ],
)
def test_options_that_cannot_work_fail_the_options_check(config_class, says, fix) -> None:
    from llamagym.testing import BanditAgent

    agent_class = type("OptionsAgent", (BanditAgent,), {"Config": config_class})
    others = list(CHECK_NAMES[1:])
    results = {result.name: result for result in check_agent(agent_class, skip=others)}
    assert list(results) == list(CHECK_NAMES)
    assert results["options"].failed, results["options"].lines()
    assert says in results["options"].detail and fix in results["options"].fix
    if config_class is NoDefault:  # the agent cannot be made: the rest wait for options
        assert {r.detail for name, r in results.items() if name != "options"} == {
            "needs options to pass"
        }


def test_an_agent_without_options_passes_the_options_check() -> None:
    from llamagym.testing import BanditAgent

    [options] = check_agent(BanditAgent, skip=list(CHECK_NAMES[1:]))[:1]
    assert options.status == "pass" and "declares no Config" in options.detail


def test_new_plugin_dir_is_the_folder_that_receives_the_package(tmp_path) -> None:
    parent = tmp_path / "not" / "yet"
    result = invoke("new-plugin", "lake", "--dir", str(parent))
    assert result.exit_code == 0, result.output
    assert [path.name for path in parent.iterdir()] == ["llamagym-lake"]
    assert (parent / "llamagym-lake" / "pyproject.toml").is_file()


# -- the budget line ----------------------------------------------------------------------
def stub_trainer(monkeypatch, output_dir: Path) -> list:
    """Replace the trainer with one that trains nothing; returns the trainers made."""
    from llamagym.training.loop import trainer as training
    from llamagym.training.loop.run_state import RunSummary

    made: list = []

    class StubTrainer:
        def __init__(self, agent: Any, parts: Any, progress: Any = None,
                     resume_from: Any = None):
            self.agent, self.output_dir = agent, output_dir
            made.append(self)

        def run(self) -> Any:
            return RunSummary(self.output_dir, 0, 0, 0, 0.0)

    monkeypatch.setattr(training, "Trainer", StubTrainer)
    return made


def budget_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("budget: ")]


def agent_defaults(name: str) -> dict:
    return dict(get_plugins().registry.get("agent", name).load().defaults["training"])


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--episodes", "16"], "budget: 16 episodes (--episodes)"),
        (
            ["--minutes", "5"],
            "budget: 5 min (--minutes; replaces the {default:,} episodes of the agent's "
            "defaults: add --episodes to keep both, whichever ends first)",
        ),
        (
            ["--episodes", "16", "--minutes", "5"],
            "budget: 16 episodes or 5 min, whichever ends first (episodes from --episodes, "
            "minutes from --minutes)",
        ),
        (
            ["--set", "training.episodes=500", "--minutes", "2.5"],
            "budget: 2.5 min (--minutes; replaces the 500 episodes of --set: add --episodes "
            "to keep both, whichever ends first)",
        ),
        ([], "budget: {default:,} episodes (the agent's defaults)"),
    ],
)
def test_the_run_says_which_budget_applies_and_where_it_came_from(
    arguments, expected, monkeypatch, tmp_path
) -> None:
    made = stub_trainer(monkeypatch, tmp_path)
    result = invoke("run", "blackjack", "--quiet", *arguments)
    assert result.exit_code == 0, result.output
    default = agent_defaults("blackjack")["episodes"]
    assert budget_lines(result.stdout) == [expected.format(default=default)]
    training = made[0].agent.config.training  # the budget the trainer was given
    if "--minutes" in arguments and "--episodes" not in arguments:
        assert training.episodes is None  # replaced, as the line says
    else:
        assert training.episodes == (16 if "--episodes" in arguments else default)


def test_budgets_from_the_agent_and_from_a_file(monkeypatch, tmp_path) -> None:
    made = stub_trainer(monkeypatch, tmp_path)
    minutes = agent_defaults("cartpole")["minutes"]  # CartPole trains on time alone
    result = invoke("run", "cartpole", "--quiet")
    assert budget_lines(result.stdout) == [f"budget: {minutes:g} min (the agent's defaults)"]
    # --episodes alone replaces the agent's time budget, as --minutes alone does episodes.
    result = invoke("run", "cartpole", "--quiet", "--episodes", "16")
    assert budget_lines(result.stdout) == [
        f"budget: 16 episodes (--episodes; replaces the {minutes:g} min of the agent's "
        "defaults: add --minutes to keep both, whichever ends first)"
    ]
    assert made[-1].agent.config.training.minutes is None
    assert made[-1].agent.config.training.episodes == 16
    result = invoke("run", "cartpole", "--quiet", "--episodes", "16", "--minutes", "2")
    assert budget_lines(result.stdout) == [
        "budget: 16 episodes or 2 min, whichever ends first (episodes from --episodes, "
        "minutes from --minutes)"
    ]

    file = tmp_path / "run.yaml"
    file.write_text(yaml.safe_dump({"training": {"episodes": 300, "minutes": 4}}))
    result = invoke("run", "blackjack", "--quiet", "--config", str(file))
    assert budget_lines(result.stdout) == [
        f"budget: 300 episodes or 4 min, whichever ends first (both from file {file})"
    ]
    result = invoke("run", "cartpole", "--quiet", "--set", "training.minutes=null")
    assert budget_lines(result.stdout) == [
        "budget: 1,000 episodes (the built-in default: neither training.episodes nor "
        "training.minutes is set)"
    ]


# -- versions, `list` when piped, the tiny model's build ----------------------------------
def test_every_plugin_in_the_json_listing_has_a_version() -> None:
    result = invoke("plugins")
    assert result.exit_code == 0, result.output
    listing = json.loads(result.stdout)
    builtins = [row for row in listing if row["distribution"] == "llamagym"]
    assert builtins and all(row["version"] == llamagym.__version__ for row in builtins)
    assert [row["name"] for row in listing if not row["version"]] == []


def test_built_ins_have_llamagyms_version_when_the_metadata_gives_none(monkeypatch) -> None:
    from llamagym.plugin_runtime import manager as plugin_manager

    real = plugin_manager.importlib.metadata.entry_points

    class Unversioned:
        """A built-in entry point whose distribution metadata has no version."""

        def __init__(self, entry_point: Any):
            self.entry_point, self.name, self.group = entry_point, entry_point.name, "llamagym"
            self.dist = types.SimpleNamespace(metadata={"Name": "llamagym"}, version="")

        def load(self) -> Any:
            return self.entry_point.load()

    def entry_points(group: str) -> list:
        found = list(real(group=group))
        if group != "llamagym":
            return found
        return [Unversioned(ep) if ep.dist.metadata["Name"] == "llamagym" else ep for ep in found]

    monkeypatch.setattr(plugin_manager.importlib.metadata, "entry_points", entry_points)
    plugin_manager.reset_plugins()
    try:
        listing = json.loads(invoke("plugins").stdout)
        builtins = [row for row in listing if row["distribution"] == "llamagym"]
        assert len(builtins) > 1  # the entry points and the agent's own hooks
        assert {row["version"] for row in builtins} == {llamagym.__version__}
    finally:
        monkeypatch.undo()
        plugin_manager.reset_plugins()


class LongNames:
    name = "an_agent_whose_name_is_longer_than_a_narrow_terminal_column_would_allow"
    description = (
        "A description that goes on well past eighty columns, naming the environment, "
        "the reward and the way the model answers, so that nothing of it may be lost"
    )

    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register(self.name, "nowhere.at.all:Agent", description=self.description)


def test_list_keeps_long_names_whole_when_piped(register_plugin) -> None:
    register_plugin(LongNames(), "long-names")
    result = invoke("list")
    assert result.exit_code == 0, result.output
    [row] = [line for line in result.stdout.splitlines() if LongNames.name in line]
    assert LongNames.description in row


def test_building_the_tiny_model_draws_no_progress_bar(tmp_path, monkeypatch) -> None:
    """transformers makes every bar it draws through `logging.tqdm`; record what it
    makes, so the test sees the bars whatever tqdm itself would print here."""
    from transformers.utils import logging as hf_logging

    from llamagym.models.tiny import build_tiny_model

    drawn: list[str] = []

    class Recorded:
        def __init__(self, iterable=None, *args, desc=None, **kwargs):
            drawn.append(str(desc))
            self.iterable = iterable if iterable is not None else []

        def __iter__(self):
            return iter(self.iterable)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    monkeypatch.setattr(hf_logging.tqdm_lib, "tqdm", Recorded)
    previous_hook = hf_logging.set_tqdm_hook(None)
    enabled = hf_logging.is_progress_bar_enabled()  # `run --quiet` switches them off
    hf_logging.enable_progress_bar()
    try:
        list(hf_logging.tqdm(range(1), desc="bar before"))
        assert drawn == ["bar before"]  # bars are drawn here
        build_tiny_model(tmp_path / "tiny")
        assert (tmp_path / "tiny" / "config.json").is_file()
        assert drawn == ["bar before"], drawn  # no "Writing model shards"
        list(hf_logging.tqdm(range(1), desc="bar after"))
        assert drawn == ["bar before", "bar after"]  # switched off only while saving
    finally:
        hf_logging.set_tqdm_hook(previous_hook)
        if not enabled:
            hf_logging.disable_progress_bar()


# -- the learning curve -------------------------------------------------------------------
RUN = [
    "run",
    "blackjack",
    "--quiet",
    "--num-envs",
    "4",
    "--threads",
    "1",
    "--episodes",
    "8",
    "--eval-episodes",
    "0",
    "--set",
    "algorithm.episodes_per_update=8",
    "--set",
    "algorithm.minibatch_size=8",
    "--set",
    "algorithm.epochs=1",
]


def test_no_message_names_a_learning_curve_that_was_not_drawn(tmp_path, monkeypatch) -> None:
    for name in [name for name in sys.modules if name.split(".")[0] == "matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    run_dir = tmp_path / "run"
    result = invoke(*RUN, "-o", str(run_dir))
    assert result.exit_code == 0, result.output
    assert "budget: 8 episodes (--episodes)" in result.stdout  # printed under --quiet
    assert (run_dir / "report.md").is_file()
    assert not (run_dir / "learning_curve.png").exists()
    assert "learning_curve.png" not in result.output
    assert "learning_curve.png" not in (run_dir / "report.md").read_text()
    assert f"report: {run_dir / 'report.md'}" in one_line(result.stdout)


def test_a_drawn_learning_curve_is_a_png_and_is_named(tmp_path) -> None:
    run_dir = tmp_path / "run"
    result = invoke(*RUN, "-o", str(run_dir))
    assert result.exit_code == 0, result.output
    curve = run_dir / "learning_curve.png"
    assert curve.read_bytes()[:8] == PNG_SIGNATURE
    assert f"(learning curve: {curve})" in one_line(result.stdout)
