"""A run and its directory: the core writes the history, evaluation stays out of the
training observers, the run directory names the plugins that took part, and a trained
agent loads back with one call."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from llamagym import hookimpl, load_agent
from llamagym.errors import LlamaGymError
from llamagym.plugin_runtime.manager import reset_plugins
from llamagym.testing import BanditAgent, temporary_plugin, tiny_agent
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.loop.trainer import Trainer
from llamagym.training.records.run_files import read_metrics

FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--checkpoint-every", "1",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1",
]


def update_numbers(run_dir) -> list[int]:
    return [r["update"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "update"]


def test_history_and_resume_need_no_optional_plugin(tmp_path, monkeypatch, cli) -> None:
    monkeypatch.setenv("LLAMAGYM_DISABLE_PLUGINS", "tensorboard-logger,wandb-logger")
    reset_plugins()
    run_dir = tmp_path / "run"
    assert cli("run", "blackjack", "-n", "16", "-o", run_dir, *FAST)[0] == 0
    assert update_numbers(run_dir) == [1, 2]
    code, _, err = cli("run", "blackjack", "-n", "32", "--resume", run_dir, *FAST)
    assert code == 0, err
    assert update_numbers(run_dir) == [1, 2, 3, 4]
    assert not (run_dir / "tensorboard").exists()


class EpisodeObserver:
    def __init__(self) -> None:
        self.calls: list[tuple[int, bool]] = []

    @hookimpl
    def llamagym_episode_end(self, agent, episode, run):
        self.calls.append((episode.seed, run.evaluation))


def test_evaluation_episodes_reach_no_training_observer(tmp_path) -> None:
    agent = tiny_agent(
        BanditAgent,
        training={"episodes": 16, "eval_episodes": 24},
        output={"dir": str(tmp_path / "run"), "report": False},
    )
    observer = EpisodeObserver()
    with temporary_plugin(observer, "observer"):
        summary = Trainer(agent, agent.session).run()
    assert summary.evaluation is not None and summary.evaluation.episodes == 24
    assert len(observer.calls) == summary.episodes == 16
    assert not any(evaluation for _, evaluation in observer.calls)


class Narrator:
    """Answers the observation hook before the agent does; never parses."""

    @hookimpl(tryfirst=True)
    def llamagym_format_observation(self, agent, observation, info):
        return f"You see {observation}."

    @hookimpl(tryfirst=True)
    def llamagym_extract_action(self, agent, reply, legal_actions):
        return None


def test_run_directory_names_the_plugins_that_answered(tmp_path) -> None:
    run_dir = tmp_path / "run"
    agent = tiny_agent(
        BanditAgent,
        training={"episodes": 16, "eval_episodes": 0},
        output={"dir": str(run_dir)},
    )
    with temporary_plugin(Narrator(), "narrator"):
        Trainer(agent, agent.session).run()
    answered = {p["name"]: p for p in json.loads((run_dir / "plugins.json").read_text())}
    assert answered["narrator"]["hooks"] == ["llamagym_format_observation"]
    # The agent's own methods answered the system prompt; the narrator's None parses
    # never counted.
    assert "llamagym_system_prompt" in answered["agent"]["hooks"]
    meta = checkpoints.read_meta(checkpoints.find_checkpoint(run_dir))
    assert {p["name"] for p in meta["plugins"]} == set(answered)
    report = (run_dir / "report.md").read_text()
    assert "| narrator |" in report and "format_observation" in report


def test_a_registered_agents_own_answers_are_credited_to_its_plugin(fake_llm) -> None:
    from importlib.metadata import version

    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.plugin_runtime.manager import get_plugins

    plugins = get_plugins()
    plugins.reset_participants()
    fake_llm(["stick"], cycle=True).play(BlackjackAgent(), episodes=2, mode="score")
    answered = {p["name"]: p for p in plugins.participants()}
    assert "agent" not in answered  # not the built-in that called the agent's methods
    assert answered["blackjack"]["distribution"] == "llamagym-blackjack"
    assert answered["blackjack"]["version"] == version("llamagym-blackjack")
    assert {"llamagym_system_prompt", "llamagym_format_observation"} <= set(
        answered["blackjack"]["hooks"]
    )


def test_resume_with_other_plugins_says_so(tmp_path, caplog) -> None:
    run_dir = tmp_path / "run"
    settings = {"output": {"dir": str(run_dir), "report": False}}
    with temporary_plugin(Narrator(), "narrator"):
        first = tiny_agent(BanditAgent, training={"episodes": 16, "eval_episodes": 0}, **settings)
        Trainer(first, first.session).run()
    resumed = tiny_agent(BanditAgent, training={"episodes": 32, "eval_episodes": 0}, **settings)
    with caplog.at_level(logging.WARNING, logger="llamagym"):
        Trainer(resumed, resumed.session, resume_from=run_dir).run()
    warnings = [r.getMessage() for r in caplog.records if "per-step hooks differ" in r.message]
    assert len(warnings) == 1 and "gone narrator" in warnings[0]


class BanditRegistration:
    @hookimpl
    def llamagym_register_agents(self, register):
        register("bandit", "llamagym.testing:BanditAgent", description="two levers")


def test_load_agent_acts_with_the_trained_weights(tmp_path) -> None:
    run_dir = tmp_path / "run"
    agent = tiny_agent(
        BanditAgent,
        training={"episodes": 16, "eval_episodes": 0},
        output={"dir": str(run_dir), "report": False},
    )
    Trainer(agent, agent.session).run()
    with temporary_plugin(BanditRegistration(), "bandit-plugin"):
        loaded = load_agent(run_dir)
    assert type(loaded) is BanditAgent and loaded.config == agent.config.model_copy(
        update={"output": agent.config.output.model_copy(update={"dir": None})}
    )
    trained = dict(agent.policy.model.named_parameters())
    for name, parameter in loaded.policy.model.named_parameters():
        assert torch.equal(parameter, trained[name]), name
    observation, info = loaded.make_env().reset(seed=0)
    assert loaded.act(observation, info) in range(len(loaded.legal_actions(observation, info)))
    with pytest.raises(LlamaGymError, match="trained with agent.name = 'bandit', not 'blackjack'"):
        load_agent(run_dir, agent="blackjack")


def test_evaluating_a_loaded_agent_never_trains_it(tmp_path) -> None:
    """A run configured with a demonstrations warm start: evaluating its trained agent
    builds no algorithm, so the demonstrations are not trained on again."""
    from llamagym.rollout.evaluation import evaluate_agent

    demos = tmp_path / "demos.jsonl"
    demo = {"system": BanditAgent().get_system_prompt(), "prompt": "Which lever?",
            "response": "right"}
    demos.write_text((json.dumps(demo) + "\n") * 8)
    run_dir = tmp_path / "run"
    agent = tiny_agent(
        BanditAgent,
        algorithm={"warm_start": {"demonstrations": str(demos), "lr": 1e-2}},
        training={"episodes": 16, "eval_episodes": 0},
        output={"dir": str(run_dir), "report": False},
    )
    Trainer(agent, agent.session).run()
    with temporary_plugin(BanditRegistration(), "bandit-plugin"):
        loaded = load_agent(run_dir)
    before = {n: p.detach().clone() for n, p in loaded.policy.model.named_parameters()}
    evaluate_agent(loaded.evaluation_engine(), 4)
    changed = [n for n, p in loaded.policy.model.named_parameters()
               if not torch.equal(p, before[n])]
    assert changed == []
