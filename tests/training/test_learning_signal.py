"""A run that cannot learn says so once, with what to do for its agent: a warning, a
diagnosis record in metrics.jsonl and a section of report.md; a resumed run does not say
it again, and a run that learns says nothing."""

from __future__ import annotations

from typing import Any

import gymnasium
import pytest

from llamagym import Agent, hookimpl
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.testing import temporary_plugin
from llamagym.training.loop.learning_signal import WINDOW, LearningSignal
from llamagym.training.records.run_files import read_metrics

FAST = [
    "--num-envs", "4", "--threads", "1", "--eval-episodes", "0", "--quiet",
    "--checkpoint-every", "1",
    "--set", "algorithm.episodes_per_update=8", "--set", "algorithm.minibatch_size=8",
    "--set", "algorithm.epochs=1",
]


class Desert(gymnasium.Env):
    """One-step episodes that end, whatever the action, with nothing earned."""

    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(3)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: int):
        return 0, 0.0, True, False, {}


class DesertAgent(Agent):
    name = "desert"
    action_names = ("north", "south", "east")
    baselines = {"random": lambda obs, info, legal, rng: legal[int(rng.integers(3))],
                 "walk-north": lambda *_: "north"}
    defaults = {"rollout": {"mode": "score"}}  # the legal actions ranked: no invalid reply

    def get_system_prompt(self) -> str:
        return "Cross the desert: north, south or east."

    def format_observation(self, observation: Any) -> str:
        return "Sand everywhere."

    def make_env(self) -> Desert:
        return Desert()


class DesertPlugin:
    @hookimpl
    def llamagym_register_agents(self, register) -> None:
        register("desert", f"{__name__}:DesertAgent")


def diagnoses(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "diagnosis"]


def test_a_run_that_is_never_rewarded_says_so_once(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    with temporary_plugin(DesertPlugin(), "desert-plugin"):
        code, _, err = cli("run", "desert", "-n", "40", "-o", run_dir, *FAST)
    assert code == 0, err
    found = diagnoses(run_dir)
    assert [(r["update"], r["finding"]) for r in found] == [(WINDOW, "no-reward")]
    message = found[0]["message"]
    assert "no episode of the last 3 updates (24 episodes) earned a reward" in message
    assert "--warm-start walk-north" in message  # its baseline, not "random"
    # Said once on the console (the run had 5 updates), and in the report.
    console = " ".join(err.split())  # rich wraps long lines
    assert console.count("earned a reward") == 1
    assert "WARNING update 3: no episode of the last 3 updates" in console
    report = (run_dir / "report.md").read_text()
    assert "## Diagnosis" in report
    assert "- update 3, no-reward: no episode of the last 3 updates" in report


def test_a_resumed_run_does_not_say_a_finding_again(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    with temporary_plugin(DesertPlugin(), "desert-plugin"):
        assert cli("run", "desert", "-n", "24", "-o", run_dir, *FAST)[0] == 0
        assert [r["finding"] for r in diagnoses(run_dir)] == ["no-reward"]
        code, _, err = cli("run", "desert", "-n", "48", "--resume", run_dir, *FAST)
    assert code == 0, err
    kinds = [r["kind"] for r in read_metrics(run_dir / "metrics.jsonl")]
    # Three more updates fill a window of the resumed run's own: still nothing to say.
    assert kinds.count("update") == 6 and kinds.count("resume") == 1
    assert [(r["update"], r["finding"]) for r in diagnoses(run_dir)] == [(3, "no-reward")]
    assert "earned a reward" not in " ".join(err.split())
    assert (run_dir / "report.md").read_text().count("no-reward") == 1


def test_blackjack_has_a_learning_signal(tmp_path, cli) -> None:
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", "-n", "64", "-o", run_dir, *FAST,
                       "--set", "algorithm.episodes_per_update=16",
                       "--set", "algorithm.minibatch_size=16")
    assert code == 0, err
    assert [r["update"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert diagnoses(run_dir) == []
    assert "## Diagnosis" not in (run_dir / "report.md").read_text()


# -- the checks, on episodes made by hand -----------------------------------------------
LEGAL = ["\x1b[2Jstick", "hit"]  # an env's text: quoted escaped


def episode(actions: list[int], *, reward: float = 1.0, valid: bool = True,
            terminated: bool = True) -> Episode:
    turns = [Turn(prompt_tokens=[], legal_actions=list(LEGAL), action_index=index, reply="",
                  logprobs=[0.0], value=0.0, valid=valid) for index in actions]
    if turns:
        turns[-1].reward = reward  # the learner's return is the env's here
    return Episode(turns=turns, env_return=reward, info={"terminated": terminated})


def blackjack_signal() -> LearningSignal:
    from llamagym_blackjack.agent import BlackjackAgent

    return LearningSignal(BlackjackAgent())


def run_updates(signal: LearningSignal, batches: list[list[Episode]],
                metrics: dict | None = None) -> list[dict]:
    said = []
    for update, batch in enumerate(batches, start=1):
        said += signal.add(batch, {"update": update, **(metrics or {})})
    return said


def varied(actions_of_episode: list[list[int]]) -> list[Episode]:
    """Episodes with returns that differ, so only the action choice can be a finding."""
    return [episode(actions, reward=float(i % 3 - 1)) for i, actions in
            enumerate(actions_of_episode)]


def test_one_action_in_almost_every_turn_is_a_finding() -> None:
    # 10 turns an update, 29 of the 30 turns "stick": 97%.
    batches = [varied([[0, 0]] * 5) for _ in range(WINDOW)]
    batches[1][0].turns[0].action_index = 1
    said = run_updates(blackjack_signal(), batches)
    assert [(r["update"], r["finding"]) for r in said] == [(WINDOW, "one-action")]
    message = said[0]["message"]
    assert message.startswith(
        "the policy chose '\\x1b[2Jstick' in 97% of the 30 turns with a choice in the last "
        "3 updates: it has stopped exploring"
    )
    assert "\x1b" not in message
    assert "--set algorithm.entropy_coef=..., now 0.01" in message
    assert "--warm-start basic-strategy; its others: always-stick, hit-below-17" in message


def test_a_policy_that_still_varies_is_no_finding() -> None:
    batches = [varied([[0, 0]] * 5) for _ in range(WINDOW)]
    for batch in batches:  # 3 of 30 turns "hit": 90%
        batch[0].turns[0].action_index = 1
    assert run_updates(blackjack_signal(), batches) == []


def test_a_finding_is_said_once_a_run_and_not_again_after_a_resume() -> None:
    batches = [varied([[0, 0]] * 5) for _ in range(WINDOW + 2)]
    said = run_updates(blackjack_signal(), batches)
    assert [(r["update"], r["finding"]) for r in said] == [(WINDOW, "one-action")]
    # A resumed run is handed the records of the run it continues.
    earlier = [{"kind": "update", "update": 1}, *said]
    assert run_updates(blackjack_signal_after(earlier), batches) == []


def blackjack_signal_after(history: list[dict]) -> LearningSignal:
    from llamagym_blackjack.agent import BlackjackAgent

    return LearningSignal(BlackjackAgent(), history)


@pytest.mark.parametrize(
    ("batch", "metrics", "finding", "words"),
    [
        ([episode([1], reward=-1.0) for _ in range(4)], {}, "no-reward",
         "every episode of the last 3 updates (12 episodes) returned -1"),
        ([episode([1], reward=1.0) for _ in range(4)], {}, "no-reward",
         "returned +1: no return differs from another, so there is nothing to learn from; "
         "if +1 is the most an episode can earn, the policy has learnt it"),
        ([episode([0, 1], reward=float(i), terminated=False) for i in range(4)], {},
         "all-truncated", "was cut by its time limit before it ended"),
        ([episode([0, 1], reward=float(i)) for i in range(4)],
         {"target_kl_stop": 1.0, "epochs_run": 1.0}, "kl-stop",
         "(1.0 of 4 epochs run on average)"),
        ([episode([0, 1], reward=float(i), valid=i > 2) for i in range(4)], {},
         "invalid-replies", "75% of the replies of the last 3 updates named no legal action"),
        ([episode([0, 1], reward=float(i), valid=i > 2) for i in range(4)], {},
         "invalid-replies", "try replies held to the legal actions (--set "
         "rollout.legal_replies=true)"),
    ],
)
def test_each_finding(batch, metrics, finding, words) -> None:
    said = run_updates(blackjack_signal(), [batch] * WINDOW, metrics)
    assert [r["finding"] for r in said] == [finding]
    assert words in said[0]["message"]
    # One update short of the window: nothing is judged yet.
    assert run_updates(blackjack_signal(), [batch] * (WINDOW - 1), metrics) == []


# -- before training: llamagym eval --model ---------------------------------------------
def test_eval_of_an_untrained_model_says_when_no_policy_earns_a_reward(cli) -> None:
    with temporary_plugin(DesertPlugin(), "desert-plugin"):
        code, out, err = cli("eval", "desert", "--model", "tiny", "-n", "8", "--quiet")
    assert code == 0, err
    assert "no policy tried earns any reward (the untrained model and every baseline " \
        "returned 0 in every episode)" in " ".join(out.split())


def test_a_baseline_that_earns_is_named_to_warm_start_from() -> None:
    from llamagym.rollout.evaluation import EvalResult
    from llamagym.training.loop.learning_signal import before_training

    agent = DesertAgent()
    untrained, random = EvalResult("agent", 8, 0.0, 0.0), EvalResult("random", 8, 0.0, 0.0)
    walk = EvalResult("walk-north", 8, 0.5, 0.2)
    line = before_training(agent, untrained, [random, walk])
    assert line is not None and line.endswith(
        "warm-start from a baseline that does, walk-north (+0.500): --warm-start walk-north"
    )
    # Random play that earns, or an untrained model that does: nothing to say.
    assert before_training(agent, untrained, [EvalResult("random", 8, 0.1, 0.1)]) is None
    assert before_training(agent, EvalResult("agent", 8, 0.0, 0.3), [random, walk]) is None


def test_a_run_that_warm_starts_is_not_told_to_warm_start() -> None:
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.resolver.layers import resolve_agent_config

    batch = [episode([1], reward=-1.0) for _ in range(4)]
    told = run_updates(blackjack_signal(), [batch] * WINDOW)[0]["message"]
    assert "--warm-start basic-strategy" in told
    config = resolve_agent_config(
        BlackjackAgent, [("--set", {"algorithm": {"warm_start": {"baseline": "basic-strategy"}}})]
    )
    warm = LearningSignal(BlackjackAgent(config=config))
    message = run_updates(warm, [batch] * WINDOW)[0]["message"]
    assert "--warm-start" not in message and message.endswith("try a larger budget (--minutes)")
