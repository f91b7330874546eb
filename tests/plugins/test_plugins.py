"""The plugin runtime: each hook with a throwaway in-process plugin, discovery through
(fake) entry points, and every way a plugin can be broken."""

from __future__ import annotations

import importlib.metadata
import types
from pathlib import Path

import gymnasium
import pytest
import typer
from typer.testing import CliRunner

from llamagym import hookimpl
from llamagym.plugin_runtime import manager as plugin_manager
from llamagym.plugin_runtime.hookspecs import all_hook_names
from llamagym.plugin_runtime.manager import get_plugins
from llamagym.testing import BanditAgent, temporary_plugin, tiny_agent
from llamagym.training.loop.trainer import Trainer


class FakeDistribution:
    def __init__(self, name: str, version: str = "1.0"):
        self.metadata = {"Name": name}
        self.version = version


class FakeEntryPoint:
    """What importlib.metadata gives for an installed plugin, without installing one."""

    def __init__(self, name: str, load, dist: str = "fake-plugin"):
        self.name, self._load, self.dist = name, load, FakeDistribution(dist)
        self.group = "llamagym"

    def load(self):
        return self._load()


@pytest.fixture
def fake_entry_points(monkeypatch):
    """Add fake entry points next to the really installed ones."""
    extra: list[FakeEntryPoint] = []
    real = importlib.metadata.entry_points

    def entry_points(group: str):
        return list(real(group=group)) + (extra if group == "llamagym" else [])

    monkeypatch.setattr(plugin_manager.importlib.metadata, "entry_points", entry_points)
    plugin_manager.reset_plugins()
    return extra


def module_plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**{name: hookimpl(fn) for name, fn in hooks.items()})


# -- registration hooks ---------------------------------------------------------------
def test_register_agents_and_algorithms() -> None:
    def register_agents(register):
        register("bandit", "llamagym.testing:BanditAgent", description="two levers")

    def register_algorithms(register):
        register("copy-of-ppo", "llamagym_builtins.ppo:PPO", description="the same PPO")

    plugin = module_plugin(
        llamagym_register_agents=register_agents,
        llamagym_register_algorithms=register_algorithms,
    )
    with temporary_plugin(plugin, name="levers") as plugins:
        agent = plugins.registry.get("agent", "bandit")
        assert agent.plugin == "levers" and agent.description == "two levers"
        assert agent.load() is BanditAgent
        assert plugins.registry.get("algorithm", "copy-of-ppo").load().__name__ == "PPO"
    assert "bandit" not in get_plugins().registry.agents()


def test_register_envs() -> None:
    env_id = "LlamaGymTestBandit-v0"

    def register_envs(register):
        register(id=env_id, entry_point="llamagym.testing:TwoArmedBandit")

    with temporary_plugin(module_plugin(llamagym_register_envs=register_envs)) as plugins:
        plugins.register_envs()
        env = gymnasium.make(env_id)
        assert env.reset(seed=0)[0] == 0
    gymnasium.registry.pop(env_id)


def test_register_commands() -> None:
    def register_commands(cli):
        @cli.command("hello")
        def hello(name: str) -> None:
            typer.echo(f"hello {name}")

    app = typer.Typer()

    @app.command("noop")
    def noop() -> None:
        pass

    with temporary_plugin(module_plugin(llamagym_register_commands=register_commands)) as p:
        p.register_commands(app)
    result = CliRunner().invoke(app, ["hello", "world"])
    assert result.exit_code == 0 and "hello world" in result.output


def test_register_models() -> None:
    from llamagym.models import registry as model_registry
    from llamagym.plugin_runtime.registry import ModelEntry

    def register_models(register):
        register(
            ModelEntry(
                name="my-model",
                hub_id="me/my-model",
                architecture="llama",
                parameters="42M",
                suggested_memory="1 GB",
                lora_target_modules=("q_proj", "v_proj"),
            )
        )

    with temporary_plugin(module_plugin(llamagym_register_models=register_models)):
        entry = model_registry.get_model_entry("me/my-model")
        assert entry is not None and entry.lora_target_modules == ("q_proj", "v_proj")
    runner = CliRunner()
    from llamagym.cli.app import app

    result = runner.invoke(app, ["models"])
    assert result.exit_code == 0 and "qwen2.5-0.5b" in result.output.lower()


# -- per-step hooks: first answer wins, tryfirst beats the agent ------------------------
def test_system_prompt_and_observation_hooks() -> None:
    agent = BanditAgent(config={"agent": {"name": "bandit"}})
    plugins = get_plugins()
    assert plugins.system_prompt(agent) == "Pull one lever: left or right."
    assert plugins.format_observation(agent, 0, {}) == "Which lever?"

    class Override:
        @hookimpl(tryfirst=True)
        def llamagym_system_prompt(self, agent):
            return "overridden prompt"

        @hookimpl(tryfirst=True)
        def llamagym_format_observation(self, agent, observation, info):
            return f"observation {observation}"

    class Fallback:  # normal priority, registered later: asked before the agent
        @hookimpl(trylast=True)
        def llamagym_system_prompt(self, agent):
            return "never used"

    with temporary_plugin(Override(), "override"), temporary_plugin(Fallback(), "fallback"):
        assert plugins.system_prompt(agent) == "overridden prompt"
        assert plugins.format_observation(agent, 7, {}) == "observation 7"
    assert plugins.system_prompt(agent) == "Pull one lever: left or right."


def test_extract_action_hook_cannot_return_an_illegal_index() -> None:
    class Liar:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, agent, reply, legal_actions):
            return 5 if reply == "five" else None

    agent = BanditAgent(config={"agent": {"name": "bandit"}})
    with temporary_plugin(Liar(), "liar") as plugins:
        assert plugins.extract_action(agent, "five", ["left", "right"]) is None
        assert plugins.extract_action(agent, "right", ["left", "right"]) == 1


def test_a_plugin_raising_in_a_step_hook_is_reported_once_and_skipped() -> None:
    class Broken:
        @hookimpl(tryfirst=True)
        def llamagym_extract_action(self, agent, reply, legal_actions):
            raise KeyError("oops")

    agent = BanditAgent(config={"agent": {"name": "bandit"}})
    with temporary_plugin(Broken(), "broken-parser") as plugins:
        assert plugins.extract_action(agent, "right", ["left", "right"]) == 1
        assert plugins.extract_action(agent, "left", ["left", "right"]) == 0
        reports = [p for p in plugins.problems if "'broken-parser'" in p]
    assert len(reports) == 1 and "KeyError" in reports[0]
    assert "llamagym_extract_action" in reports[0]


# -- observer hooks, in a real (tiny) run --------------------------------------------
def test_shaping_and_lifecycle_hooks_in_a_run(tmp_path) -> None:
    seen: dict[str, list] = {"episodes": [], "updates": [], "shaped": []}

    class Observer:
        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            seen["shaped"].append(action)
            return 10.0

        @hookimpl
        def llamagym_episode_end(self, agent, episode):
            seen["episodes"].append(episode)

        @hookimpl
        def llamagym_update_end(self, agent, update, metrics):
            seen["updates"].append((update, metrics["return_mean"]))

    with temporary_plugin(Observer(), "observer"):
        agent = tiny_agent(
            rollout={"reward_shaping": True}, output={"dir": str(tmp_path), "quiet": True}
        )
        Trainer(agent, agent.session).run()
    assert len(seen["episodes"]) == 32 and len(seen["shaped"]) == 32
    assert [u for u, _ in seen["updates"]] == [1, 2]
    # The shaping term reaches the learner's reward, not the env's return.
    episode = seen["episodes"][0]
    assert episode.total_reward == pytest.approx(episode.env_return + 10.0)
    assert all(0.0 <= ret <= 1.0 for _, ret in seen["updates"])


def test_shaping_is_off_unless_configured(tmp_path) -> None:
    calls = []

    class Shaper:
        @hookimpl
        def llamagym_shape_reward(self, agent, observation, action, reward, info):
            calls.append(action)
            return 1.0

    with temporary_plugin(Shaper(), "shaper"):
        agent = tiny_agent(output={"dir": str(tmp_path), "quiet": True})
        Trainer(agent, agent.session).run()
    assert calls == []


# -- discovery and broken plugins ----------------------------------------------------------
def test_builtins_are_registered_through_entry_points() -> None:
    infos = {info.name: info for info in get_plugins().plugin_infos()}
    for name in ("algorithms", "models"):
        assert infos[name].distribution == "llamagym"
    # The parsers are each task's own (Task.reply_parsers), not plugins.
    assert not {"json-action", "regex-action"} & infos.keys()
    assert "ppo" in get_plugins().registry.algorithms()


def test_plugin_that_fails_to_import_is_reported_and_the_rest_works(fake_entry_points) -> None:
    def broken():
        raise ImportError("No module named 'missing_dependency'")

    fake_entry_points.append(FakeEntryPoint("broken", broken, dist="llamagym-broken"))
    plugins = get_plugins()
    [problem] = [p for p in plugins.problems if "'broken'" in p]
    assert "llamagym-broken" in problem and "missing_dependency" in problem
    assert "LLAMAGYM_DISABLE_PLUGINS=broken" in problem
    assert "ppo" in plugins.registry.algorithms()


def test_misspelt_hook_is_refused_by_name(fake_entry_points) -> None:
    typo = module_plugin(llamagym_register_agent=lambda register: None)
    fake_entry_points.append(FakeEntryPoint("typo", lambda: typo, dist="llamagym-typo"))
    plugins = get_plugins()
    [problem] = [p for p in plugins.problems if "'typo'" in p]
    assert "llamagym_register_agent" in problem and "llamagym-typo" in problem
    assert "typo" not in dict(plugins.manager.list_name_plugin())


def test_plugin_raising_inside_a_hook(fake_entry_points) -> None:
    def register_agents(register):
        raise RuntimeError("boom")

    raiser = module_plugin(llamagym_register_agents=register_agents)
    fake_entry_points.append(FakeEntryPoint("raiser", lambda: raiser, dist="llamagym-raiser"))
    plugins = get_plugins()
    assert "bandit" not in plugins.registry.agents()
    [problem] = [p for p in plugins.problems if "'raiser'" in p]
    assert "boom" in problem and "llamagym_register_agents" in problem


def test_duplicate_names_name_both_plugins(fake_entry_points) -> None:
    def register_agents(register):
        register("blackjack", "llamagym.testing:BanditAgent")

    clash = module_plugin(llamagym_register_agents=register_agents)
    fake_entry_points.append(FakeEntryPoint("clash", lambda: clash, dist="llamagym-clash"))
    plugins = get_plugins()
    assert plugins.registry.get("agent", "blackjack").plugin == "blackjack"  # the first is kept
    [problem] = [p for p in plugins.problems if "registered twice" in p]
    assert "'blackjack'" in problem and "'clash'" in problem and "llamagym-clash" in problem


def test_kill_switches(monkeypatch, fake_entry_points) -> None:
    def broken():
        raise ImportError("nope")

    fake_entry_points.append(FakeEntryPoint("broken", broken, dist="llamagym-broken"))
    monkeypatch.setenv("LLAMAGYM_LOAD_PLUGINS", "")
    plugin_manager.reset_plugins()
    plugins = get_plugins()
    assert plugins.problems == []
    assert "blackjack" not in plugins.registry.agents()  # third-party plugins are off
    assert "ppo" in plugins.registry.algorithms()  # built-ins stay

    monkeypatch.setenv("LLAMAGYM_LOAD_PLUGINS", "blackjack")
    plugin_manager.reset_plugins()
    assert "blackjack" in get_plugins().registry.agents() and get_plugins().problems == []

    monkeypatch.delenv("LLAMAGYM_LOAD_PLUGINS")
    monkeypatch.setenv("LLAMAGYM_DISABLE_PLUGINS", "broken,blackjack")
    plugin_manager.reset_plugins()
    assert get_plugins().problems == [] and "blackjack" not in get_plugins().registry.agents()


def test_every_hook_has_a_test_here() -> None:
    source = Path(__file__).read_text()
    missing = [name for name in all_hook_names() if name not in source.replace("test_every", "")]
    assert missing == []
