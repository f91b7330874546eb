"""benchmarks/env_plugins.py: its options refuse bad input in one line (exit 2) before
anything runs, an agent's variant becomes the ``--set`` its commands carry, and
``llamagym eval --json`` (the tiny model, for real) becomes the numbers its table shows."""

from __future__ import annotations

import argparse
import json
from fnmatch import fnmatch
from pathlib import Path

import pytest

from benchmarks import env_plugins, table


def test_the_result_files_are_the_ones_the_results_table_reads() -> None:
    for model in ("tiny", "smollm2-135m"):
        name = env_plugins.result_name(model)
        assert any(fnmatch(name, section) for section in table.SECTIONS), name
    # A Hub id or a path is a model name too: it names a file, never a folder.
    assert env_plugins.result_name("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "env-plugins-HuggingFaceTB-SmolLM2-135M-Instruct")
    assert "/" not in env_plugins.result_name("../../etc/x")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--episodes", "5", "--minutes", "3"], "not allowed with argument --episodes"),
        (["--episodes", "0"], "must be above 0"),
        (["--agent-episodes", "babyai=x"], "give AGENT=EPISODES"),
        (["--agents", "babyai", "--agent-episodes", "textarena-sudoku=4"],
         "not among --agents"),
        (["--minutes", "2", "--agent-episodes", "babyai=4"], "give it without --minutes"),
        (["--agents", "babyai;rm"], "give NAME or NAME:VARIANT"),
        (["--eval-episodes", "100000"], "is over 10000"),
        (["--curve-every", "0"], "must be above 0"),
        (["--curve-every", "4", "--zero-shot-only"], "give it without --zero-shot-only"),
    ],
)
def test_bad_options_stop_with_one_line_naming_the_fix(argv, said, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        env_plugins.parse_arguments(argv)
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert said in error


def test_the_budget_of_an_agent_named_alone_comes_before_the_default() -> None:
    args = env_plugins.parse_arguments(
        ["--agents", "babyai", "textarena-sudoku", "--episodes", "64",
         "--agent-episodes", "babyai=32"])
    assert env_plugins.budget_of(args, "babyai") == {"episodes": 32}
    assert env_plugins.budget_of(args, "textarena-sudoku") == {"episodes": 64}
    quick = env_plugins.parse_arguments(["--quick"])
    assert env_plugins.budget_of(quick) == {"episodes": 16} and quick.eval_episodes == 4
    minutes = env_plugins.parse_arguments(["--minutes", "30"])
    assert env_plugins.budget_of(minutes, "babyai") == {"minutes": 30.0}


def test_a_variant_is_the_agents_game_or_level_option() -> None:
    assignments, env_id = env_plugins.variant_assignments(
        "textarena-tower-of-hanoi", "TowerOfHanoi-v0-medium", "tiny")
    assert assignments == ["agent.game=TowerOfHanoi-v0-medium"]
    assert env_id == "TowerOfHanoi-v0-medium"
    assert env_plugins.variant_assignments("babyai", None, "tiny") == (
        [], "BabyAI-GoToLocal-v0")
    line = env_plugins.run_line("babyai", "tiny", 3, {"minutes": 1.5}, env_plugins.Path("/r"),
                                2, ["agent.level=BabyAI-GoToObj-v0"])
    recorded = " ".join(env_plugins.recorded_arguments(line))
    assert "--minutes 1.5 --threads 2" in recorded and "--seed 3" in recorded
    assert recorded.endswith("--set agent.level=BabyAI-GoToObj-v0")
    assert "/r" not in recorded  # where the run went is no part of its command
    assert "training.minutes" not in recorded
    # An episode budget alone (`llamagym run` then drops the agent's default minutes).
    counted = env_plugins.run_line("babyai", "tiny", 3, {"episodes": 16}, env_plugins.Path("/r"),
                                   2, [])
    assert "--episodes 16 --threads 2" in " ".join(counted)
    assert "--minutes" not in counted


@pytest.mark.parametrize(("agent", "variant"), [("textarena-sudoku", "Nope"),
                                                ("no-such-agent", None)])
def test_an_unknown_agent_or_variant_stops_in_one_line(agent, variant, capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        env_plugins.variant_assignments(agent, variant, "tiny")
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and error.startswith("env-plugins: ")


@pytest.mark.slow  # the benchmark through the CLI
def test_llamagym_eval_json_becomes_the_tables_numbers() -> None:
    args = argparse.Namespace(eval_episodes=2, eval_seed=10_000, threads=1)
    measured = env_plugins.evaluate("textarena-guess-the-number", ["--model", "tiny"], args,
                                    ["agent.game=GuessTheNumber-v0"])
    assert measured["command"].startswith(
        "llamagym eval textarena-guess-the-number --model tiny -n 2 --seed 10000 --json")
    agent, baselines = measured["agent"], measured["baselines"]
    assert set(baselines) == {"random", "binary-search"}
    assert baselines["binary-search"]["won"] == 1.0  # the solver always wins in 20 numbers
    for numbers in (agent, *baselines.values()):
        assert numbers["episodes"] == 2
        assert numbers["won"] == numbers["outcomes"]["won"]
        assert numbers["invalid_move"] == numbers["outcomes"]["invalid move"]
    cell = table._policy(baselines["binary-search"])
    assert cell == f"100% won, {baselines['binary-search']['mean']:+.2f}"


def test_the_outcome_that_means_a_win_is_read_for_each_env_and_invalid_ones_shown() -> None:
    babyai = env_plugins.summarise({"episodes": 4, "mean": 0.2, "ci95": 0.1,
                                    "invalid_rate": 0.25,
                                    "outcomes": {"success": 0.25, "failure": 0.75}})
    assert babyai["won"] == 0.25 and babyai["invalid_move"] is None
    textarena = env_plugins.summarise({"episodes": 4, "mean": 0.1, "ci95": 0.1,
                                       "invalid_rate": 0.0,
                                       "outcomes": {"won": 0.0, "lost": 0.5,
                                                    "invalid move": 0.5}})
    assert textarena["won"] == 0.0 and textarena["invalid_move"] == 0.5
    assert table._policy(babyai) == "25% won, +0.20, 25% invalid replies"
    assert table._policy(textarena) == "0% won, +0.10, 50% invalid moves"


def test_a_failed_command_is_one_line_with_its_last_word_unless_it_was_killed() -> None:
    stderr = "press Ctrl-C to stop with a checkpoint (press\nit again to stop at once)\n"
    killed = env_plugins.failure("llamagym run x", -9, stderr)
    assert killed == ("`llamagym run x` failed (killed by signal 9: the kernel's "
                      "out-of-memory killer, or a kill)")
    refused = env_plugins.failure("llamagym run x", 2, stderr + "error: no such game\n\n")
    assert refused == "`llamagym run x` failed (exit 2): error: no such game"


def test_eval_set_reaches_the_evaluations_and_not_the_run(monkeypatch, tmp_path) -> None:
    """``--eval-set agent.fold=test``: zero-shot and trained agents are evaluated on the
    held-out games while the run trains on its own."""
    commands: list[list[str]] = []

    def fake_llamagym(words, threads):
        commands.append(list(words))
        if words[0] == "run":
            output = Path(words[words.index("--output") + 1])
            output.mkdir(parents=True)
            return "", 1.0
        return json.dumps({"mean_return": 0.0, "episodes": 1, "returns": [0.0]}), 1.0

    monkeypatch.setattr(env_plugins, "run_llamagym", fake_llamagym)
    monkeypatch.setattr(env_plugins, "summarise", lambda data: {})
    monkeypatch.setattr(env_plugins, "variant_assignments", lambda a, v, m: ([], a))
    args = argparse.Namespace(
        model="tiny", set=["rollout.num_envs=2"], eval_set=["agent.fold=test"], seed=0,
        eval_episodes=2, eval_seed=10000, threads=1, zero_shot_only=False, warm_start=None,
        curve_every=None, episodes=4, minutes=None, agent_episodes=[])
    row = env_plugins.measure("twx-coin", args, tmp_path)
    run = next(words for words in commands if words[0] == "run")
    evals = [words for words in commands if words[0] == "eval"]
    assert len(evals) == 2 and all("agent.fold=test" in words for words in evals)
    assert all("rollout.num_envs=2" in words for words in [run, *evals])
    assert "agent.fold=test" not in run
    assert row["eval_set"] == ["agent.fold=test"] and row["set"] == ["rollout.num_envs=2"]


def test_a_table_says_what_the_evaluations_alone_played_with() -> None:
    assert table._evaluated_on({"eval_set": ["agent.fold=test"]}) == ", with `agent.fold=test`"
    assert table._evaluated_on({"eval_set": []}) == table._evaluated_on({}) == ""


def test_a_rows_training_keeps_what_the_run_said_of_its_signal() -> None:
    update = {"kind": "update", "update": 3, "seconds": 9.5, "return_mean": 0.0,
              "total_episodes": 24, "env_steps": 288}
    said = {"kind": "diagnosis", "update": 3, "finding": "no-reward",
            "message": "no episode earned a reward in the last 3 updates"}
    summary = env_plugins.summarise_training([update, said, {"kind": "eval", "update": 3}])
    assert summary["diagnoses"] == [{"update": 3, "finding": "no-reward",
                                     "message": said["message"]}]
    assert summary["updates"] == 1 and summary["episodes"] == 24
    assert env_plugins.summarise_training([update])["diagnoses"] == []


def test_the_table_says_what_each_run_said_of_its_signal_escaped() -> None:
    said = {"agent": "textarena-mastermind", "training": {"diagnoses": [
        {"update": 3, "finding": "one-action",
         "message": "the policy chose '[1 2|3 4](x)' in 96% of the turns"}]}}
    line = table._diagnosis_line(said)
    assert line.startswith("`textarena-mastermind`, what the run said of its learning signal:")
    assert "update 3, one-action: " in line
    assert "'\\[1 2\\|3 4\\](x)'" in line  # escaped: no link, no new table cell
    quiet = {"agent": "babyai", "training": {"diagnoses": []}}
    assert table._diagnosis_line(quiet).endswith("the run's dead-signal checks: none fired.")
