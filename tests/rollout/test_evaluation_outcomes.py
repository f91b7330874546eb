"""Evaluations: outcomes the agent names, a progress display, and one warning when every
episode was the same one (a deterministic env that ignores the seed, played greedily)."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from llamagym_blackjack.agent import BlackjackAgent
from rich.console import Console

from llamagym import Agent, hookimpl
from llamagym.errors import LlamaGymError
from llamagym.rollout.evaluation import (
    evaluate_agent,
    evaluate_baseline,
    evaluation_seeds,
    play_baseline,
    summarise,
)
from llamagym.testing import BanditAgent, tiny_agent
from llamagym.training.loop.final_evaluation import evaluate_with_baselines
from llamagym.training.loop.progress import EvaluationProgress, RunProgress, evaluation_table
from llamagym.training.loop.trainer import Trainer
from llamagym.training.records.report import write_report
from llamagym.training.records.run_files import read_metrics

# FrozenLake's 4x4 map; a state is row * 4 + column. Actions: 0 left, 1 down, 2 right, 3 up.
ROUTE = {0: "down", 4: "down", 8: "right", 9: "right", 10: "down", 14: "right"}


def route(observation: Any, info: dict, legal: Any, rng: Any) -> str:
    return ROUTE[int(observation)]


def random_move(observation: Any, info: dict, legal: Any, rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


class LakeAgent(Agent):
    """FrozenLake without the ice: one start state, deterministic moves."""

    name = "lake-test"
    env_id = "FrozenLake-v1"
    env_kwargs = {"is_slippery": False, "max_episode_steps": 12}
    action_names = ("left", "down", "right", "up")
    baselines = {"route": route, "random": random_move}
    outcome_names = ("goal", "no goal")
    defaults = {"rollout": {"mode": "score", "history_turns": 0}}

    def outcome(self, episode_return: float) -> str:
        return "goal" if episode_return > 0 else "no goal"

    def get_system_prompt(self) -> str:
        return "Cross the frozen lake to the goal: left, down, right or up."

    def format_observation(self, observation: Any) -> str:
        return f"Row {int(observation) // 4}, column {int(observation) % 4}."


class LakePlugin:
    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register("lake-test", f"{__name__}:LakeAgent", env_id="FrozenLake-v1")


def lake_agent(**sections: Any) -> Agent:
    return tiny_agent(LakeAgent, rollout={"num_envs": 4}, **sections)


def render(table: Any) -> str:
    console = Console(file=io.StringIO(), width=200)
    console.print(table)
    return " ".join(console.file.getvalue().split())  # type: ignore[attr-defined]


def identical_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "same episode" in r.getMessage()
    ]


# -- 1. outcomes are the agent's ---------------------------------------------------------
def test_blackjack_names_win_draw_loss_by_the_sign_of_each_return() -> None:
    agent = tiny_agent(BlackjackAgent, rollout={"num_envs": 8})
    played: list = []
    result = evaluate_agent(agent.evaluation_engine(), 60, seed=2, examples=played)
    returns = np.array([e.env_return for e in played])
    assert list(result.outcomes) == ["win", "draw", "loss"]
    assert result.outcomes["win"] == pytest.approx(np.mean(returns > 0))
    assert result.outcomes["draw"] == pytest.approx(np.mean(returns == 0))
    assert result.outcomes["loss"] == pytest.approx(np.mean(returns < 0))

    # A baseline's outcomes come from the same classification of its own returns.
    baseline = evaluate_baseline(agent, "basic-strategy", 60, seed=2)
    totals = np.zeros(60)
    for step in play_baseline(agent, "basic-strategy", evaluation_seeds(2, 60), rng_seed=2):
        totals[step.episode] += step.reward
    assert baseline.outcomes == pytest.approx(
        {"win": np.mean(totals > 0), "draw": np.mean(totals == 0), "loss": np.mean(totals < 0)}
    )
    assert "win / draw / loss" in render(evaluation_table(result, [baseline]))


def test_a_return_of_zero_is_what_the_agent_says_it_is() -> None:
    agent = lake_agent()
    route_result = evaluate_baseline(agent, "route", 5)
    random_result = evaluate_baseline(agent, "random", 40, seed=1)
    assert route_result.outcomes == {"goal": 1.0, "no goal": 0.0}
    assert random_result.outcomes["no goal"] == pytest.approx(1 - random_result.mean)
    text = render(evaluation_table(route_result, [random_result]))
    assert "goal / no goal" in text and "draw" not in text and "win" not in text


def test_an_agent_that_names_no_outcomes_has_no_outcome_column() -> None:
    agent = tiny_agent(BanditAgent, rollout={"num_envs": 4})
    result = evaluate_agent(agent.evaluation_engine(), 16)
    baselines = [evaluate_baseline(agent, name, 16) for name in agent.baselines]
    assert result.outcomes == {} and all(b.outcomes == {} for b in baselines)
    text = render(evaluation_table(result, baselines))
    assert "mean return" in text and "95% CI" in text and "invalid" in text
    assert "/" not in text and "draw" not in text and "win" not in text


def test_an_outcome_the_agent_does_not_list_is_refused() -> None:
    class Pushy(LakeAgent):
        def outcome(self, episode_return: float) -> str:
            return "push" if episode_return == 0 else "goal"

    agent = tiny_agent(Pushy)
    assert summarise("x", [1.0, 1.0], agent=agent).outcomes == {"goal": 1.0, "no goal": 0.0}
    with pytest.raises(LlamaGymError, match="'push'.*outcome_names"):
        summarise("x", [1.0, 0.0], agent=agent)


# -- 2. evaluations show their progress --------------------------------------------------
def test_evaluations_report_progress_episode_by_episode() -> None:
    agent = lake_agent()
    calls: list[tuple[int, int]] = []
    result = evaluate_agent(
        agent.evaluation_engine(), 10, on_progress=lambda done, total: calls.append((done, total))
    )
    assert calls == [(k, 10) for k in range(result.episodes + 1)]

    calls.clear()
    evaluate_baseline(agent, "random", 7, on_progress=lambda d, t: calls.append((d, t)))
    assert calls == [(k, 7) for k in range(8)]

    seen: list[tuple[str, int, int]] = []
    evaluate_with_baselines(
        agent.evaluation_engine(), 3, seed=0, on_progress=lambda *call: seen.append(call)
    )
    assert [name for name, done, _ in seen if done == 3] == ["agent", "route", "random"]


def test_the_progress_bar_draws_on_a_terminal_only() -> None:
    terminal = Console(file=io.StringIO(), force_terminal=True, width=120)
    with EvaluationProgress(terminal) as progress:
        progress("agent", 10, 10)
        progress("random", 4, 10)
    drawn = terminal.file.getvalue()  # type: ignore[attr-defined]
    assert "baseline random" in drawn and "4/10" in drawn and progress.calls == 2

    pipe = Console(file=io.StringIO(), force_terminal=False, width=120)
    with EvaluationProgress(pipe) as progress:
        progress("agent", 5, 10)
    assert pipe.file.getvalue() == "" and progress.calls == 1  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def lake_run(tmp_path_factory) -> tuple[Path, str]:
    """A short LakeAgent run whose progress bar draws on a (pretend) terminal."""
    run_dir = tmp_path_factory.mktemp("runs") / "lake"
    agent = lake_agent(
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
        training={"episodes": 8, "eval_episodes": 6},
        output={"dir": str(run_dir)},
    )
    screen = Console(file=io.StringIO(), force_terminal=True, width=120)
    Trainer(agent, agent.session, progress=RunProgress(screen)).run()
    return run_dir, screen.file.getvalue()  # type: ignore[attr-defined]


def test_the_final_evaluation_shows_progress_and_records_outcomes(lake_run) -> None:
    run_dir, screen = lake_run
    assert "evaluating the agent" in screen and "baseline route" in screen
    (evaluation,) = [
        r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "evaluation"
    ]
    assert list(evaluation["outcomes"]) == ["goal", "no goal"]
    assert evaluation["distinct_episodes"] == 1  # fixed start, deterministic, greedy
    assert {b["name"]: b["distinct_episodes"] for b in evaluation["baselines"]}["route"] == 1
    report = " ".join((run_dir / "report.md").read_text().split())
    assert "| 95% CI | goal / no goal | invalid replies |" in report
    assert "| **trained agent** |" in report and "n/a: identical episodes" in report
    assert "were all the same episode" in report and "reset(seed=...)" in report


def test_eval_command_shows_progress_outcomes_and_identical_episodes(
    lake_run, register_plugin, cli, monkeypatch
) -> None:
    run_dir, _ = lake_run
    register_plugin(LakePlugin(), "lake-plugin")
    code, out, err = cli("eval", "lake-test", "--checkpoint", run_dir, "-n", "6")
    assert code == 0, err
    out = " ".join(out.split())
    assert "goal / no goal" in out and "identical episodes" in out
    assert "all 6 episodes identical (no CI)" in out and "95% CI [" not in out
    assert "same episode" in " ".join(err.split())  # the warning
    assert "evaluating the agent" not in err  # stderr is no terminal here: no bar

    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich takes stderr for a terminal
    code, out, err = cli("eval", "lake-test", "--checkpoint", run_dir, "-n", "6", "--json")
    assert code == 0, err
    result = json.loads(out)  # the bar went to stderr; stdout is the JSON alone
    assert result["distinct_episodes"] == 1 and list(result["outcomes"]) == ["goal", "no goal"]
    assert "evaluating the agent" in err and "6/6" in err

    for quiet in (["--quiet"], ["--set", "output.quiet=true"]):
        code, out, err = cli("eval", "lake-test", "--checkpoint", run_dir, "-n", "6", *quiet)
        assert code == 0, err
        assert "evaluating the agent" not in err and "baseline" not in err
        assert "same episode" in " ".join(err.split())  # warnings still show


# -- 3. identical episodes -----------------------------------------------------------------
def test_a_deterministic_env_played_greedily_warns_once(caplog) -> None:
    agent = lake_agent()
    with caplog.at_level(logging.WARNING):
        result = evaluate_agent(agent.evaluation_engine(), 12, seed=4)
    assert result.episodes == 12 and result.distinct_episodes == 1 and result.identical
    (message,) = identical_warnings(caplog)
    assert "all 12 evaluation episodes" in message and "reset(seed=...)" in message
    assert "eval_episodes=1" in message
    text = render(evaluation_table(result, []))
    assert "identical episodes" in text and f"± {result.ci95:.3f}" not in text


def test_a_stochastic_env_does_not_warn(caplog) -> None:
    agent = tiny_agent(BlackjackAgent, rollout={"num_envs": 8})
    with caplog.at_level(logging.WARNING):
        result = evaluate_agent(agent.evaluation_engine(), 40, seed=1)
        baseline = evaluate_baseline(agent, "basic-strategy", 40, seed=1)
    assert not identical_warnings(caplog)
    assert result.distinct_episodes is not None and result.distinct_episodes > 1
    assert not result.identical and not baseline.identical
    text = render(evaluation_table(result, [baseline]))
    assert "identical" not in text and f"± {result.ci95:.3f}" in text


def test_a_report_without_outcomes_or_with_identical_episodes(tmp_path) -> None:
    config = {
        "agent": {"name": "bandit"},
        "algorithm": {"name": "ppo"},
        "model": {"name": "tiny"},
        "training": {"seed": 0},
    }
    update = {
        "kind": "update",
        "update": 1,
        "total_episodes": 8,
        "env_steps": 8,
        "seconds": 1.0,
        "return_mean": 0.5,
        "return_moving_average": 0.5,
    }
    evaluation = {
        "kind": "evaluation",
        "update": 1,
        "greedy": True,
        "name": "agent",
        "episodes": 8,
        "mean": 0.5,
        "ci95": 0.4,
        "invalid_rate": 0.0,
        "outcomes": {},
        "distinct_episodes": 2,
        "baselines": [
            {
                "name": "left",
                "episodes": 8,
                "mean": 0.25,
                "ci95": 0.3,
                "outcomes": {},
                "distinct_episodes": 1,
            }
        ],
    }
    text = write_report(tmp_path, [update, evaluation], config).markdown.read_text()
    assert "| policy | mean return | 95% CI | invalid replies |" in text
    assert "| **trained agent** | +0.500 | ±0.400 [+0.100, +0.900] | 0.0% |" in text
    assert "| left | +0.250 | n/a: identical episodes | n/a |" in text
    assert "were all the same episode" not in text  # only the agent's episodes are
