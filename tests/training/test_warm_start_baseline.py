"""A warm start from the agent's own baseline in one flag: ``llamagym run AGENT
--warm-start NAME`` records the baseline's successful episodes into the run directory,
in the run's mode and model, and trains on them before RL."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from llamagym_blackjack.agent import BlackjackAgent
from safetensors.torch import load_file

from llamagym.cli.run_commands import resolve_run_config
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.resolver.layers import resolve_agent_config
from llamagym.rollout.demonstrations import MAX_BASELINE_EPISODES, recording_seeds
from llamagym.rollout.evaluation import evaluation_seeds, play_baseline
from llamagym.testing import BanditAgent, TwoArmedBandit, tiny_agent
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.loop import baseline_warm_start
from llamagym.training.loop.trainer import Trainer
from llamagym.training.records.run_files import read_metrics
from llamagym_builtins.demonstrations_file import load_demonstrations

EPISODES = 60  # of the baseline, recorded
FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--episodes", "16",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1", "--set", f"algorithm.warm_start.baseline_episodes={EPISODES}",
]
BLACKJACK_BASELINES = "random, always-stick, hit-below-17, basic-strategy"


def said(err: str) -> str:
    """The log lines as one line of words (rich wraps them at the console's width)."""
    return " ".join(err.split())


def one_error(result: tuple[int, str, str]) -> str:
    code, out, err = result
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if line and not line.startswith("warning:")]
    assert len(lines) == 1, err
    return lines[0]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoints.find_checkpoint(run_dir) / checkpoints.WEIGHTS)


def baseline_episodes(baseline: str, seed: int) -> list[dict]:
    """Each recorded Blackjack episode of ``baseline`` played again: its (state, action)
    decisions and its return."""
    episodes: list[dict] = []
    for step in play_baseline(BlackjackAgent(), baseline, recording_seeds(seed, EPISODES),
                              rng_seed=seed):
        if step.episode == len(episodes):
            episodes.append({"decisions": [], "return": 0.0})
        episode = episodes[step.episode]
        player, dealer, ace = step.observation
        episode["decisions"].append(((int(player), int(dealer), bool(ace)), step.action))
        episode["return"] += step.reward
    return episodes


def shown_state(user_text: str) -> tuple[int, int, bool]:
    """The state a Blackjack prompt shows: 'Sum 15, dealer 10, usable ace no.'"""
    total, dealer, ace = (part.split()[-1].rstrip(".") for part in user_text.split(","))
    return int(total), int(dealer), ace == "yes"


def test_the_warm_start_trains_on_the_winning_episodes_of_the_baseline_only(tmp_path, cli):
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, "--seed", "3", "--output", run_dir,
                       "--warm-start", "basic-strategy")
    assert code == 0, err
    demonstrations = load_demonstrations(run_dir / "demonstrations.jsonl")
    # The baseline's episodes played again on the run's recording seeds: the file holds
    # the decisions of the won ones, in order, and nothing of the others.
    played = baseline_episodes("basic-strategy", seed=3)
    won = [episode for episode in played if episode["return"] > 0]
    assert 0 < len(won) < len(played)
    assert [
        (shown_state(d.messages[-2]["content"]), d.messages[-1]["content"]) for d in demonstrations
    ] == [decision for episode in won for decision in episode["decisions"]]
    # In the run's mode (score): each decision among the legal actions.
    assert all(d.legal_actions == ["stick", "hit"] for d in demonstrations)
    # Said before the first update, and trained on (the algorithm's warm start phase).
    log = said(err)
    line = (f"warm start: {len(demonstrations)} demonstrations from {len(won)} of {EPISODES} "
            "episodes of 'basic-strategy' (those that ended 'win')")
    assert line in log and "sft_demo_loss_first" in log
    assert log.index(line) < log.index("update 2:")  # before the progress of training
    # The same run as one given that file as its demonstrations: the recording moved no
    # training random stream, and the warm start went through the file's path.
    same = tmp_path / "same"
    code, _, err = cli("run", "blackjack", *FAST, "--seed", "3", "--output", same, "--set",
                       f"algorithm.warm_start.demonstrations={run_dir / 'demonstrations.jsonl'}")
    assert code == 0, err
    recorded, given = final_weights(run_dir), final_weights(same)
    assert all(torch.equal(recorded[name], given[name]) for name in given)


@pytest.mark.parametrize(
    "asked", [["--warm-start", "foo"], ["--set", "algorithm.warm_start.baseline=foo"]]
)
def test_an_unknown_baseline_is_one_line_naming_the_agents_baselines(asked, tmp_path,
                                                                     monkeypatch, cli):
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("llamagym.run.load_model_and_tokenizer", no_model)
    run_dir = tmp_path / "run"
    assert one_error(cli("run", "blackjack", *FAST, "--output", run_dir, *asked)) == (
        "error: algorithm.warm_start.baseline: blackjack has no baseline 'foo'; its "
        f"baselines: {BLACKJACK_BASELINES}"
    )
    assert not run_dir.exists()
    # A directory that is there already is left as it was.
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    one_error(cli("run", "blackjack", *FAST, "--output", run_dir, *asked))
    assert [path.name for path in run_dir.iterdir()] == ["notes.txt"]


def expert_of(agent_class: type) -> str:
    resolved = resolve_agent_config(agent_class, [("--set", {"algorithm": {"warm_start": {
        "baseline": "expert"}}})])
    return resolved.algorithm.warm_start.baseline


class TwoExpertsBandit(BanditAgent):
    baselines = {**BanditAgent.baselines, "random": BanditAgent.baselines["left"]}


class OwnExpertBandit(BanditAgent):
    baselines = {"expert": BanditAgent.baselines["left"], **BanditAgent.baselines}


class OneBaselineBandit(BanditAgent):
    baselines = {"random": BanditAgent.baselines["left"], "right": BanditAgent.baselines["right"]}


def test_expert_names_the_agents_expert_baseline_whatever_it_is_called() -> None:
    # Declared by the agent (Blackjack has three besides random), else its only one
    # besides random; the name the run records is the baseline's own.
    assert expert_of(BlackjackAgent) == "basic-strategy"
    assert expert_of(OneBaselineBandit) == "right"
    # A baseline of its own called "expert" is that one.
    assert expert_of(OwnExpertBandit) == "expert"


def test_an_agent_without_an_expert_is_one_line_naming_its_baselines() -> None:
    with pytest.raises(ConfigError) as refused:
        expert_of(TwoExpertsBandit)  # left and right besides random: neither is named
    message = str(refused.value)
    assert message == (
        "algorithm.warm_start.baseline: bandit names no expert baseline (its "
        "baselines: left, right, random); name one of them instead of 'expert', or declare "
        "expert_baseline = NAME on the agent class"
    )
    with pytest.raises(ConfigError, match="names no expert baseline"):
        expert_of(type("NoBaselines", (BanditAgent,), {"baselines": {}}))


def test_warm_start_expert_records_the_expert_and_config_yaml_names_it(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, "--output", run_dir, "--warm-start", "expert")
    assert code == 0, err
    assert "episodes of 'basic-strategy'" in said(err)
    assert "    baseline: basic-strategy  # from flag\n" in (run_dir / "config.yaml").read_text()


def test_a_baseline_and_a_demonstrations_file_are_not_both_taken(tmp_path) -> None:
    demos = tmp_path / "demos.jsonl"
    demos.write_text("")
    with pytest.raises(ConfigError) as refused:
        resolve_agent_config(BlackjackAgent, [("--set", {"algorithm": {"warm_start": {
            "demonstrations": str(demos), "baseline": "basic-strategy"}}})])
    message = str(refused.value)
    assert message.startswith("algorithm.warm_start.baseline: got 'basic-strategy'; ")
    assert "\n" not in message and "unset one of them" in message


def test_the_key_round_trips_and_a_resumed_run_records_nothing(tmp_path, monkeypatch, cli):
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, "--output", run_dir,
                       "--warm-start", "basic-strategy")
    assert code == 0, err
    # The flag is the key: written in config.yaml, read back from it as a --config file,
    # and kept in the checkpoint (whose config a resumed run starts from).
    assert "    baseline: basic-strategy  # from flag\n" in (run_dir / "config.yaml").read_text()
    _, again = resolve_run_config("blackjack", run_dir / "config.yaml", [], {})
    assert again.algorithm.warm_start.baseline == "basic-strategy"
    assert again.algorithm.warm_start.baseline_episodes == EPISODES
    assert again.algorithm.warm_start.demonstrations is None  # the run's file is no setting
    meta = checkpoints.read_meta(checkpoints.find_checkpoint(run_dir))
    assert meta["config"]["algorithm"]["warm_start"]["baseline"] == "basic-strategy"

    recorded = run_dir / "demonstrations.jsonl"
    before = (recorded.stat().st_ino, recorded.stat().st_mtime_ns, recorded.read_bytes())

    def recording(*args, **kwargs):
        raise AssertionError("a resumed run recorded the baseline again")

    monkeypatch.setattr(baseline_warm_start, "record_demonstrations", recording)
    code, _, err = cli("run", "blackjack", "--resume", run_dir, "--episodes", "32")
    assert code == 0, err
    assert (recorded.stat().st_ino, recorded.stat().st_mtime_ns, recorded.read_bytes()) == before
    # Trained on again before the checkpoint was loaded over them, as any resumed run is.
    assert "sft_demo_loss_first" in said(err) and "none recorded" in said(err)
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["update"] for r in records if r["kind"] == "update"] == [1, 2, 3, 4]
    # Without the file, a resume is refused in one line, the run as it was.
    recorded.rename(tmp_path / "elsewhere.jsonl")
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    line = one_error(cli("run", "blackjack", "--resume", run_dir, "--episodes", "48"))
    assert "demonstrations.jsonl' is missing" in line and "records none" in line
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics
    # Nor is a link in its place read (it could lead to any file, or a pipe).
    recorded.symlink_to(tmp_path / "elsewhere.jsonl")
    line = one_error(cli("run", "blackjack", "--resume", run_dir, "--episodes", "48"))
    assert "demonstrations.jsonl' is a symbolic link" in line, line
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics


class RiggedBandit(TwoArmedBandit):
    payout = (0.0, 1.0)  # left never pays, right always does


class RiggedBanditAgent(BanditAgent):
    def make_env(self) -> RiggedBandit:
        return RiggedBandit()


def rigged_run(tmp_path: Path, baseline: str) -> tuple[Trainer, Path]:
    run_dir = tmp_path / baseline
    agent = tiny_agent(
        RiggedBanditAgent,
        algorithm={"warm_start": {"baseline": baseline, "baseline_episodes": 20}},
        training={"episodes": 8, "eval_episodes": 0},
        output={"dir": str(run_dir), "report": False},
    )
    return Trainer(agent, agent.session), run_dir


def test_an_agent_without_outcomes_keeps_the_episodes_that_returned_more_than_0(tmp_path):
    trainer, run_dir = rigged_run(tmp_path, "right")
    trainer.run()
    assert len(load_demonstrations(run_dir / "demonstrations.jsonl")) == 20
    trainer, run_dir = rigged_run(tmp_path, "left")
    with pytest.raises(LlamaGymError) as refused:
        trainer.run()
    assert str(refused.value) == (
        "warm start: no episode of 'left' returned more than 0 in 20 episodes, so there is "
        "nothing to learn from; play more of them (--set "
        "algorithm.warm_start.baseline_episodes=200) or warm-start from another baseline "
        "(right)"
    )
    assert not (run_dir / "demonstrations.jsonl").exists()
    assert not (run_dir / "checkpoints").exists()


@pytest.mark.parametrize("seed", [0, 7, 2**32 - 1])
def test_the_recorded_episodes_are_none_of_the_final_evaluations(seed) -> None:
    recorded = set(recording_seeds(seed, MAX_BASELINE_EPISODES))
    assert not recorded & set(evaluation_seeds(seed, 1_000_000))


def test_the_trl_backend_refuses_a_warm_start_from_a_baseline() -> None:
    pytest.importorskip("trl")
    from llamagym.trl_backend.settings import check_supported

    resolved = resolve_agent_config(BlackjackAgent, [("--set", {
        "training": {"backend": "trl", "episodes": 32},
        "algorithm": {"name": "grpo", "episodes_per_update": 16, "minibatch_size": 8,
                      "group_size": 4, "warm_start": {"baseline": "basic-strategy"}},
        "rollout": {"num_envs": 8},
    })])
    with pytest.raises(ConfigError) as refused:
        check_supported(resolved)
    assert str(refused.value) == (
        "algorithm.warm_start: supervised warm starts (demonstrations, a baseline's with "
        "--warm-start, replay) run on the native backend only; warm-start there and continue "
        "with --backend trl from the export"
    )
