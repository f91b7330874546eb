"""The registry of specs and the way hooks are called: built-in names cannot be shadowed
without ``override=True``, a broken plugin is isolated, wrappers apply, the plugins that
answered per-step hooks are recorded, observers get the run context."""

from __future__ import annotations

import json
import sys
import types

import pytest
from typer.testing import CliRunner

from llamagym import hookimpl
from llamagym.agent import Agent
from llamagym.errors import PluginError
from llamagym.models.registry import LLAMA_LIKE_TARGETS, get_model_entry
from llamagym.plugin_runtime import manager as plugin_manager
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.plugin_runtime.registry import AgentSpec, AlgorithmSpec, ModelEntry, RunContext
from llamagym.testing import BanditAgent, temporary_plugin


def module_plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


def bandit() -> Agent:
    return BanditAgent(config={"agent": {"name": "bandit"}})


# -- no silent shadowing --------------------------------------------------------------
def test_a_third_party_ppo_does_not_shadow_the_builtin() -> None:
    def register_algorithms(register):
        register("ppo", "llamagym_builtins.grpo:GRPO", description="not PPO")

    plugin = module_plugin(llamagym_register_algorithms=register_algorithms)
    with temporary_plugin(plugin, name="shadow") as plugins:
        spec = plugins.registry.get("algorithm", "ppo")
        assert (spec.plugin, spec.distribution) == ("algorithms", "llamagym")
        assert spec.load().__name__ == "PPO"
        [problem] = [p for p in plugins.problems if "'shadow'" in p]
    assert "'ppo'" in problem and "'algorithms'" in problem and "llamagym" in problem
    assert "(in-process)" in problem and "refused" in problem
    assert "override=True" in problem


def test_override_replaces_the_builtin_with_a_warning_naming_both() -> None:
    def register_algorithms(register):
        register(AlgorithmSpec("ppo", "llamagym_builtins.grpo:GRPO", "GRPO as ppo"), override=True)

    plugin = module_plugin(llamagym_register_algorithms=register_algorithms)
    with temporary_plugin(plugin, name="mine") as plugins:
        spec = plugins.registry.get("algorithm", "ppo")
        assert (spec.plugin, spec.description) == ("mine", "GRPO as ppo")
        assert spec.load().__name__ == "GRPO"
        [warning] = [p for p in plugins.problems if "'mine'" in p]
    assert "'ppo'" in warning and "replaced" in warning and "override=True" in warning
    assert "'algorithms'" in warning and "llamagym" in warning and "(in-process)" in warning
    assert get_plugins().registry.get("algorithm", "ppo").load().__name__ == "PPO"  # gone with it


def test_a_builtin_model_name_is_refused_unless_overridden() -> None:
    def entry(notes: str) -> ModelEntry:
        return ModelEntry(
            name="TINY",  # names compare without case
            hub_id="someone/tiny",
            architecture="llama",
            parameters="1M",
            suggested_memory="1 GB",
            lora_target_modules=LLAMA_LIKE_TARGETS,
            notes=notes,
        )

    shadow = module_plugin(llamagym_register_models=lambda register: register(entry("shadow")))
    with temporary_plugin(shadow, name="tiny-shadow") as plugins:
        assert get_model_entry("tiny").hub_id is None  # the built-in, built locally
        [problem] = [p for p in plugins.problems if "'tiny-shadow'" in p]
    assert "'TINY'" in problem and "'models'" in problem and "llamagym" in problem

    def register_models(register):
        register(entry("mine"), override=True)

    with temporary_plugin(module_plugin(llamagym_register_models=register_models), "mine"):
        assert get_model_entry("tiny").notes == "mine"
        assert get_model_entry("someone/tiny").notes == "mine"


def write_distribution(root, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """A distribution as pip leaves it on disk: a dist-info folder and its modules."""
    dist_info = root / f"{name.replace('-', '_')}-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text(f"[llamagym]\n{entry_points}\n")
    for module, source in modules.items():
        (root / f"{module}.py").write_text(source)


def test_a_third_party_entry_point_with_a_builtin_name_is_refused(tmp_path, monkeypatch) -> None:
    write_distribution(
        tmp_path,
        "evil-parsers",
        "wandb-logger = evil_parsers_module:parser",
        {
            "evil_parsers_module": (
                "from llamagym import hookimpl\n\n"
                "class Parser:\n"
                "    @hookimpl(tryfirst=True)\n"
                "    def llamagym_extract_action(self, reply, legal_actions):\n"
                "        return 0\n\n"
                "parser = Parser()\n"
            )
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    plugin_manager.reset_plugins()
    plugins = get_plugins()
    infos = {info.name: info for info in plugins.plugin_infos()}
    assert infos["wandb-logger"].distribution == "llamagym"
    assert "evil_parsers_module" not in sys.modules  # refused before it was imported
    [problem] = [p for p in plugins.problems if "evil-parsers" in p]
    assert "'wandb-logger'" in problem and "built-in" in problem and "llamagym" in problem
    assert "LLAMAGYM_DISABLE_PLUGINS=llamagym:wandb-logger" in problem
    assert plugins.extract_action(bandit(), "right", ["left", "right"]) == 1

    # What the line says to do: the built-in steps aside, the third party loads.
    monkeypatch.setenv("LLAMAGYM_DISABLE_PLUGINS", "llamagym:wandb-logger")
    plugin_manager.reset_plugins()
    plugins = get_plugins()
    infos = {info.name: info for info in plugins.plugin_infos()}
    assert infos["wandb-logger"].distribution == "evil-parsers"
    assert not [p for p in plugins.problems if "evil-parsers" in p]
    assert plugins.extract_action(bandit(), "right", ["left", "right"]) == 0
    sys.modules.pop("evil_parsers_module", None)


# -- calling hooks the pluggy way -----------------------------------------------------
def test_hook_wrappers_of_both_styles_run() -> None:
    seen: list = []

    class Wrappers:
        @hookimpl(wrapper=True)
        def llamagym_extract_action(self, agent, reply, legal_actions):
            index = yield
            seen.append(index)
            return 0 if reply.startswith("flip") else index

        @hookimpl(hookwrapper=True)
        def llamagym_system_prompt(self, agent):
            outcome = yield
            outcome.force_result(outcome.get_result().upper())

    agent = bandit()
    with temporary_plugin(Wrappers(), "wrappers") as plugins:
        assert plugins.extract_action(agent, "right", ["left", "right"]) == 1
        assert plugins.extract_action(agent, "flip right", ["left", "right"]) == 0
        assert plugins.system_prompt(agent) == "PULL ONE LEVER: LEFT OR RIGHT."
    assert seen == [1, 1]
    assert plugins.problems == []


def test_a_raising_wrapper_is_reported_once_and_the_answer_passes_through() -> None:
    class Broken:
        @hookimpl(wrapper=True)
        def llamagym_extract_action(self, agent, reply, legal_actions):
            index = yield
            raise ValueError(f"cannot wrap {index}")

        @hookimpl(wrapper=True)
        def llamagym_system_prompt(self, agent):
            raise LookupError("before the yield")
            yield

    agent = bandit()
    with temporary_plugin(Broken(), "broken-wrapper") as plugins:
        for _ in range(2):
            assert plugins.extract_action(agent, "left", ["left", "right"]) == 0
            assert plugins.system_prompt(agent) == "Pull one lever: left or right."
        reports = [p for p in plugins.problems if "'broken-wrapper'" in p]
    assert len(reports) == 2
    assert any("ValueError: cannot wrap 0" in r for r in reports)
    assert any("LookupError" in r and "llamagym_system_prompt" in r for r in reports)


def test_a_raising_plugin_is_reported_once_and_the_others_answer() -> None:
    class Broken:
        @hookimpl(tryfirst=True)
        def llamagym_system_prompt(self, agent):
            raise RuntimeError("no prompt today")

        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            raise ZeroDivisionError("shaping")

    class Shaper:
        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            return 0.5

    agent = bandit()
    with temporary_plugin(Broken(), "broken"), temporary_plugin(Shaper(), "shaper") as plugins:
        for _ in range(3):
            assert plugins.system_prompt(agent) == "Pull one lever: left or right."
            assert plugins.shape_reward(agent, 0, "left", 1.0, {}) == 0.5
        reports = [p for p in plugins.problems if "'broken'" in p]
    assert len(reports) == 2
    assert all("(in-process)" in r and "LLAMAGYM_DISABLE_PLUGINS=broken" in r for r in reports)
    assert any("RuntimeError: no prompt today" in r for r in reports)
    assert any("llamagym_shape_reward" in r for r in reports)


def test_participants_are_the_plugins_that_answered_per_step_hooks() -> None:
    class Shaper:
        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            return 1.0

        @hookimpl(trylast=True)
        def llamagym_format_observation(self, agent, observation, info):
            return "never asked: the agent answers first"

    plugins = get_plugins()
    agent = bandit()
    plugins.reset_participants()
    with temporary_plugin(Shaper(), "shaper"):
        plugins.system_prompt(agent)
        plugins.format_observation(agent, 0, {})
        assert plugins.extract_action(agent, '{"action": "left"}', ["left", "right"]) == 0
        assert plugins.extract_action(agent, "I pull right", ["left", "right"]) == 1
        plugins.shape_reward(agent, 0, "left", 0.0, {})
    participants = plugins.participants()
    assert json.loads(json.dumps(participants)) == participants
    by_name = {p["name"]: p for p in participants}
    # The agent's own parsers (JSON, then the regex, here) answer as the agent does.
    assert set(by_name) == {"agent", "shaper"}
    assert by_name["agent"]["hooks"] == [
        "llamagym_extract_action", "llamagym_format_observation", "llamagym_system_prompt"]
    assert by_name["agent"]["distribution"] == "llamagym" and by_name["agent"]["version"]
    assert by_name["shaper"] == {
        "name": "shaper",
        "distribution": "(in-process)",
        "version": "",
        "hooks": ["llamagym_shape_reward"],
    }
    plugins.reset_participants()
    assert plugins.participants() == []


# -- observers and the run context ----------------------------------------------------
def test_observers_with_and_without_the_run_argument(tmp_path) -> None:
    calls: list = []

    class Old:
        @hookimpl
        def llamagym_update_end(self, agent, update, metrics):
            calls.append(("old update", update, metrics["x"]))

        @hookimpl
        def llamagym_episode_end(self, agent, episode):
            calls.append(("old episode", episode))

    class New:
        @hookimpl
        def llamagym_update_end(self, agent, update, metrics, run):
            calls.append(("new update", update, run))

        @hookimpl
        def llamagym_episode_end(self, episode, run):
            calls.append(("new episode", episode, run))

    agent, context = bandit(), RunContext(str(tmp_path), rank=0, world_size=2)
    assert context.run_dir == tmp_path
    with temporary_plugin(Old(), "old"), temporary_plugin(New(), "new") as plugins:
        plugins.update_end(agent, 1, {"x": 0.5})
        plugins.update_end(agent, 2, {"x": 0.25}, run=context)
        plugins.episode_end(agent, "episode")
    assert sorted(calls, key=str) == sorted(
        [
            ("old update", 1, 0.5),
            ("new update", 1, RunContext(None)),
            ("old update", 2, 0.25),
            ("new update", 2, context),
            ("old episode", "episode"),
            ("new episode", "episode", RunContext(None)),
        ],
        key=str,
    )


def test_loggers_write_nothing_without_a_run_dir(tmp_path) -> None:
    from llamagym_builtins.loggers import TensorBoardLogger

    logger = TensorBoardLogger()
    agent = types.SimpleNamespace(config=None)
    logger.llamagym_episode_end(agent=agent, episode=None, run=RunContext(None))
    logger.llamagym_update_end(agent=agent, update=1, metrics={}, run=RunContext(None))
    assert logger._writers == {} and logger._returns == {}


# -- registration calls that cannot be used -------------------------------------------
def test_a_wrongly_typed_registration_is_a_problem_not_a_crash() -> None:
    def register_agents(register):
        register(None, 123)
        register("no-entry-point")
        register("typo", "llamagym.testing:BanditAgent", envid="x")
        register("fine", "llamagym.testing:BanditAgent", env_id="Bandit")

    def register_algorithms(register):
        register(AgentSpec("agent-as-algorithm", "llamagym.testing:BanditAgent"))

    def register_models(register):
        register("tiny")

    plugin = module_plugin(
        llamagym_register_agents=register_agents,
        llamagym_register_algorithms=register_algorithms,
        llamagym_register_models=register_models,
    )
    with temporary_plugin(plugin, name="sloppy") as plugins:
        assert set(plugins.registry.agents()) >= {"fine", "blackjack"}
        assert "agent-as-algorithm" not in plugins.registry.algorithms()
        assert get_model_entry("tiny") is not None
        from llamagym.cli.app import app

        listing = CliRunner().invoke(app, ["list"])
        problems = [p for p in plugins.problems if "'sloppy'" in p]
    assert listing.exit_code == 0, listing.output
    assert "fine" in listing.output
    assert len(problems) == 5
    [none] = [p for p in problems if "register(None, 123)" in p]
    assert "llamagym_register_agents" in none and "name must be a string" in none
    assert any("entry_point" in p and "'no-entry-point'" in p for p in problems)
    assert any("envid" in p for p in problems)
    assert any("AlgorithmSpec" in p and "AgentSpec" in p for p in problems)
    assert any("ModelEntry" in p and "llamagym_register_models" in p for p in problems)


# -- specs ----------------------------------------------------------------------------
class Unnamed(Agent):
    action_names = ("a", "b")


class Child(Unnamed):
    pass


class Misnamed(Agent):
    name = "something-else"


class OtherEnv(Agent):
    env_id = "FrozenLake-v1"


class SaysItToo(Agent):
    name = "says-it-too"


def test_agent_spec_load_fills_name_description_and_env_id() -> None:
    spec = AgentSpec(
        "unnamed", f"{__name__}:Unnamed", description="two letters", env_id="CartPole-v1"
    )
    assert spec.load() is Unnamed
    assert (Unnamed.name, Unnamed.description, Unnamed.env_id) == (
        "unnamed",
        "two letters",
        "CartPole-v1",
    )
    assert spec.load() is Unnamed  # a second load agrees with the first
    # A subclass registered under its own name gets that name, not its parent's.
    assert AgentSpec("child", f"{__name__}:Child").load().name == "child"
    assert Unnamed.name == "unnamed"
    # A class used without the registry may still state its own name.
    assert AgentSpec("says-it-too", f"{__name__}:SaysItToo").load() is SaysItToo


def test_agent_spec_load_refuses_a_class_that_says_otherwise() -> None:
    spec = AgentSpec("misnamed", f"{__name__}:Misnamed", plugin="p", distribution="dist-p")
    with pytest.raises(PluginError) as error:
        spec.load()
    assert "'something-else'" in str(error.value) and "'misnamed'" in str(error.value)
    assert "'p'" in str(error.value) and "dist-p" in str(error.value)
    with pytest.raises(PluginError, match="'FrozenLake-v1'.*'CartPole-v1'"):
        AgentSpec("other-env", f"{__name__}:OtherEnv", env_id="CartPole-v1").load()


def test_a_spec_that_fails_to_import_names_its_plugin() -> None:
    spec = AlgorithmSpec("gone", "llamagym_no_such_module:Gone", plugin="p", distribution="d")
    with pytest.raises(PluginError, match="algorithm 'gone' from plugin 'p' \\(distribution d\\)"):
        spec.load()
    with pytest.raises(ValueError, match="module:Attribute"):
        AgentSpec("x", "no-colon")
    with pytest.raises(TypeError, match="name must be a string"):
        AlgorithmSpec(None, "a:b")  # type: ignore[arg-type]
