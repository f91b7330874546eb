"""`llamagym check` and llamagym.testing: the built-in agents conform, each kind of
broken agent fails the right named check with a fix, and the pytest plugin's fixtures
work and cost nothing to sessions that do not use them."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import gymnasium
import pytest
from typer.testing import CliRunner

from llamagym import hookimpl
from llamagym.agent import Agent
from llamagym.cli.app import app
from llamagym.devtools import agent_checks
from llamagym.devtools.conformance import check_agent
from llamagym.devtools.fake_model import FakePolicy, ScriptExhaustedError
from llamagym.testing import BanditAgent, TwoArmedBandit, assert_agent_conforms

# Two small TextWorld games, as the TextWorld plugin's own tests make them (shared cache).
TINY_TEXTWORLD = {"agent": {"games": 2, "world_size": 2, "nb_objects": 3,
                            "quest_min_length": 2, "quest_max_length": 2,
                            "max_episode_steps": 10}}


def builtin_agent(name: str) -> type[Agent]:
    from llamagym.plugin_runtime.manager import get_plugins

    return get_plugins().registry.get("agent", name).load()


@pytest.mark.parametrize(
    ("name", "config"),
    [("blackjack", None), ("cartpole", None), ("textworld", TINY_TEXTWORLD)],
)
def test_builtin_agents_conform(name: str, config: dict | None) -> None:
    if name == "textworld":
        pytest.importorskip("textworld", reason="the textworld extra is not installed")
    results = assert_agent_conforms(builtin_agent(name), config, name=name, episodes=2)
    assert [r.name for r in results if r.status == "pass"] == list(agent_checks.CHECK_NAMES)


# -- broken agents, one flaw each ---------------------------------------------------------
class Corridor(gymnasium.Env):
    """Walk forward three times to win, within 20 steps; a small env that each broken
    agent below bends."""

    observation_space = gymnasium.spaces.Discrete(4)
    action_space = gymnasium.spaces.Discrete(2)
    endless = False

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.position, self.steps = 0, 0
        return self.position, {}

    def step(self, action: int):
        self.position = max(0, self.position + (1 if action == 1 else -1))
        self.steps += 1
        if self.endless:  # no goal, no time limit
            return self.position, 0.0, False, False, {}
        won = self.position == 3
        return self.position, float(won), won, self.steps >= 20, {}


class CorridorAgent(Agent):
    name = "corridor"
    action_names = ("back", "forward")
    baselines = {"forward": lambda *_: "forward"}

    def get_system_prompt(self) -> str:
        return "Walk forward to the end of the corridor."

    def format_observation(self, observation: Any) -> str:
        return f"You are {observation} steps in."

    def make_env(self) -> gymnasium.Env:
        return Corridor()


class UnseededCorridor(Corridor):
    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=None)  # ignores the seed it was given
        self.position = int(self.np_random.integers(10**9))
        return self.position, {}


class Unseeded(CorridorAgent):
    def make_env(self) -> gymnasium.Env:
        return UnseededCorridor()


class SecretCorridor(Corridor):
    """The same observations every episode; the reward hides a secret that the seed
    does not decide (drawn from the random module)."""

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        observation, info = super().reset(seed=seed, options=options)
        self.secret = random.randrange(10**6)
        return observation, info

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        return observation, reward + self.secret / 10**6, terminated, truncated, info


class HiddenSecret(CorridorAgent):
    def make_env(self) -> gymnasium.Env:
        return SecretCorridor()


class TooFewNames(CorridorAgent):
    action_names = ("forward",)


class GreedyParser(CorridorAgent):
    action_names = ("back", "forward", "backward")

    def make_env(self) -> gymnasium.Env:
        env = Corridor()
        env.action_space = gymnasium.spaces.Discrete(3)
        return env

    def extract_action(self, response: str) -> str | None:
        return "back" if "back" in response else None  # finds "back" inside "backward"


class Verbose(CorridorAgent):
    def format_observation(self, observation: Any) -> str:
        return "The corridor is long. " * 500


class Silent(CorridorAgent):
    def format_observation(self, observation: Any) -> str:
        return "  "


class UnfilledPrefix(CorridorAgent):
    defaults = {"rollout": {"reply_prefix": '{"steps": $steps, "action": "'}}


class BadBaseline(CorridorAgent):
    baselines = {"sideways": lambda *_: "sideways"}


class EndlessCorridor(Corridor):
    endless = True


class Endless(CorridorAgent):
    baselines = {}

    def make_env(self) -> gymnasium.Env:
        return EndlessCorridor()


class NoEnv(CorridorAgent):
    def make_env(self) -> gymnasium.Env:
        raise ImportError("No module named 'corridor_sim'")


@pytest.mark.parametrize(
    ("agent_class", "check", "says"),
    [
        (Unseeded, "seeded-reset", "np_random"),
        (HiddenSecret, "seeded-reset", "the reward differed"),
        (TooFewNames, "legal-actions", "Discrete(2)"),
        (GreedyParser, "action-round-trip", "the agent's extract_action"),
        (Verbose, "prompts", "shorten"),
        (Silent, "prompts", "empty text"),
        (BadBaseline, "baselines", "'sideways'"),
        (Endless, "episodes", "TimeLimit"),
        (NoEnv, "make-env", "corridor_sim"),
    ],
)
def test_each_flaw_fails_its_check_with_a_fix(agent_class, check, says, monkeypatch) -> None:
    monkeypatch.setattr(agent_checks, "MAX_TURNS_PER_EPISODE", 30)  # endless ends fast
    results = {r.name: r for r in check_agent(agent_class, episodes=1)}
    failed = [name for name, result in results.items() if result.failed]
    assert failed == [check]
    assert says in results[check].detail + results[check].fix
    assert results[check].fix  # a failure always says how to fix it
    if check == "make-env":  # what depends on a failed check is skipped, not failed
        assert results["options"].status == "pass"  # the one check that needs no env
        assert all(
            r.status == "skip" for name, r in results.items() if name not in (check, "options")
        )
    with pytest.raises(AssertionError, match=check):
        assert_agent_conforms(agent_class, episodes=1)


def test_a_reply_prefix_field_the_agent_does_not_fill_fails_the_prompt_check() -> None:
    results = {r.name: r for r in check_agent(UnfilledPrefix, episodes=1)}
    prompts = results["prompts"]
    assert prompts.failed and "names $steps" in prompts.detail
    assert "reply_fields" in prompts.fix
    # The episodes then stop at the same prefix, with the same message.
    assert "names $steps" in results["episodes"].detail


def test_a_sound_agent_passes_every_check() -> None:
    results = check_agent(CorridorAgent, episodes=2)
    assert [r.status for r in results] == ["pass"] * len(agent_checks.CHECK_NAMES)


# -- the command ----------------------------------------------------------------------
class CorridorPlugin:
    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register("corridor", f"{__name__}:CorridorAgent", description="a test corridor")
        register("corridor-no-env", f"{__name__}:NoEnv")


def test_check_command_exit_codes(register_plugin) -> None:
    register_plugin(CorridorPlugin(), "corridor-plugin")
    runner = CliRunner()
    good = runner.invoke(app, ["check", "corridor", "--episodes", "1"])
    assert good.exit_code == 0, good.output
    assert "PASS  action-round-trip" in good.output and "9 passed, 0 failed" in good.output
    bad = runner.invoke(app, ["check", "corridor-no-env"])
    assert bad.exit_code == 1
    assert "FAIL  make-env" in bad.output and "fix: " in bad.output
    assert "1 failed, 7 skipped (make-env)" in bad.output


# -- the fake model -------------------------------------------------------------------
def test_fake_llm_replies_in_order_through_the_extraction_chain(fake_llm) -> None:
    llm = fake_llm(['{"action": "forward"}', "I go forward", "Action: 1"])
    [episode] = llm.play(CorridorAgent(), episodes=1)
    assert [turn.action_index for turn in episode.turns] == [1, 1, 1]
    assert episode.env_return == 1.0 and episode.invalid_replies == 0
    assert "You are 0 steps in." in llm.prompts[0] and "corridor" in llm.prompts[0]
    assert llm.replies == ['{"action": "forward"}', "I go forward", "Action: 1"]


class ModeAware(CorridorAgent):
    def get_system_prompt(self) -> str:
        if self.config.rollout.mode == "generate":
            return 'Reply as JSON: {"action": "forward"}.'
        return "Reply with back or forward."


@pytest.mark.parametrize("mode", ["generate", "score"])
def test_fake_llm_plays_the_agent_in_the_mode_it_is_given(fake_llm, mode) -> None:
    agent = ModeAware(config={"rollout": {"mode": "score"}})
    llm = fake_llm(['{"action": "forward"}'], cycle=True)
    [episode] = llm.play(agent, episodes=1, mode=mode, max_turns=50)
    # The agent saw the mode of the play; every prompt is recorded, in either mode.
    asked = "Reply as JSON" if mode == "generate" else "Reply with back or forward"
    assert len(llm.prompts) == len(episode.turns) and all(asked in p for p in llm.prompts)
    assert len(llm.replies) == (len(episode.turns) if mode == "generate" else 0)
    assert agent.config.rollout.mode == "score"  # put back after the play


def test_fake_llm_script_running_out_is_an_error(fake_llm) -> None:
    with pytest.raises(ScriptExhaustedError, match="reply 2"):
        fake_llm(["forward"]).play(CorridorAgent(), episodes=1)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "reinforce"])
def test_fake_llm_drives_the_classic_act_loop(fake_llm, algorithm) -> None:
    agent = fake_llm(lambda prompt: "left" if "0 steps" in prompt else "right").attach(
        BanditAgent(config={"agent": {"name": "bandit"}, "algorithm": {"name": algorithm}})
    )
    assert isinstance(agent.policy, FakePolicy)  # no model was loaded
    assert agent.act(0) == 1  # "Which lever?" has no "0 steps": right


def test_tiny_model_fixture(tiny_model) -> None:
    model, tokenizer, directory = tiny_model
    assert (directory / "config.json").is_file()
    assert tokenizer.eos_token == "<|end|>" and model.config.vocab_size == len(tokenizer)


def test_register_plugin_fixture_unregisters_after_the_test(register_plugin) -> None:
    plugins = register_plugin(CorridorPlugin(), "corridor-plugin")
    assert "corridor" in plugins.registry.agents()
    assert TwoArmedBandit().reset(seed=0) == (0, {})  # the lazily defined helper classes


# -- the pytest plugin in someone else's session ------------------------------------
def test_pytest_plugin_is_light_and_changes_nothing_unasked(tmp_path) -> None:
    """A session outside this project: the plugin is loaded through its entry point,
    imports nothing heavy, and sets up none of its fixtures for a test that asks for
    none (and only the one asked for otherwise)."""
    (tmp_path / "test_other.py").write_text(textwrap.dedent("""
        import sys

        def test_loaded_and_light(request):
            assert request.config.pluginmanager.has_plugin("llamagym")
            assert not {"torch", "transformers", "gymnasium"} & set(sys.modules)

        def test_asks_for_nothing():
            pass

        def test_asks_for_one(register_plugin):
            assert callable(register_plugin)
    """))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--setup-show", "-p", "no:cacheprovider",
         "test_other.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    set_up = result.stdout.count("SETUP    F ")
    assert result.stdout.count("SETUP    F register_plugin") == 1 == set_up
