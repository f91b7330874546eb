"""Transcripts: what the model saw, said and did, kept for every update in a file whose
size stays flat, shown in the report and by `llamagym play`."""

from __future__ import annotations

from llamagym.testing import BanditAgent, TwoArmedBandit, tiny_agent
from llamagym.training.loop.trainer import Trainer
from llamagym.training.records import transcripts
from llamagym.training.records.run_files import read_transcripts
from llamagym.training.records.transcripts import TRANSCRIPTS

STEPS: list[tuple[int | None, int, float]] = []  # (seed, action, reward) as the env saw them


class RecordingBandit(TwoArmedBandit):
    def reset(self, *, seed=None, options=None):
        self.seed_given = seed
        return super().reset(seed=seed, options=options)

    def step(self, action):
        result = super().step(action)
        STEPS.append((self.seed_given, int(action), float(result[1])))
        return result


class RecordingAgent(BanditAgent):
    def make_env(self):
        return RecordingBandit()


def train(run_dir, mode: str, updates: int) -> None:
    agent = tiny_agent(
        RecordingAgent,
        rollout={"mode": mode, "num_envs": 4},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8},
        training={"episodes": 8 * updates, "eval_episodes": 4},
        output={"dir": str(run_dir)},
    )
    Trainer(agent, agent.session).run()


def test_a_transcript_is_what_the_env_received_and_returned(tmp_path) -> None:
    for mode in ("score", "generate"):
        STEPS.clear()
        run_dir = tmp_path / mode
        train(run_dir, mode, updates=2)
        records = read_transcripts(run_dir / TRANSCRIPTS)
        assert [r["kind"] for r in records] == ["training"] * 4 + ["evaluation"] * 2
        env_saw: dict = {}
        for seed, action, reward in STEPS:  # the agent plays each evaluation seed before
            env_saw.setdefault(seed, (action, reward))  # the baselines do
        for record in records:
            (turn,) = record["turns"]  # a bandit episode is one pull
            action, reward = env_saw[record["seed"]]
            assert turn["action"] == ("left", "right")[action]
            assert record["return"] == reward
            if mode == "generate":
                assert "reply" in turn and "probability" not in turn
                # A reply no parser could read was penalised and fell back.
                if turn["parser"].startswith("none"):
                    assert turn["reward"] < reward
                else:
                    assert turn["parser"] and turn["reward"] == reward
            else:
                assert 0.0 < turn["probability"] <= 1.0 and turn["reward"] == reward
            assert record["system"] == "Pull one lever: left or right."
        report = (run_dir / "report.md").read_text()
        assert "## Transcripts" in report and "return:" in report


def test_the_file_keeps_the_newest_and_stays_flat(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(transcripts, "MAX_TRANSCRIPTS", 3)
    run_dir = tmp_path / "run"
    train(run_dir, "score", updates=2)
    first = (run_dir / TRANSCRIPTS).stat().st_size
    records = read_transcripts(run_dir / TRANSCRIPTS)
    assert len(records) == 3 and records[-1]["kind"] == "evaluation"
    train(tmp_path / "longer", "score", updates=6)
    longer = read_transcripts(tmp_path / "longer" / TRANSCRIPTS)
    assert len(longer) == 3 and (tmp_path / "longer" / TRANSCRIPTS).stat().st_size < 2 * first


def test_play_prints_whole_episodes(tmp_path, cli, register_plugin) -> None:
    run_dir = tmp_path / "run"
    code, _, err = cli("run", "blackjack", "-n", "16", "--num-envs", "4", "--eval-episodes",
                       "0", "--quiet", "--set", "algorithm.episodes_per_update=8", "-o", run_dir)
    assert code == 0, err
    code, out, err = cli("play", run_dir, "-n", "2")
    assert code == 0, err
    assert out.count("system: Play blackjack: stick or hit.") == 2
    assert out.count("return:") == 2 and "user: Sum" in out
    code, out, err = cli("play", run_dir, "--kept", "-n", "3")
    assert code == 0, err
    assert out.count("[training episode, update") == 3  # the newest kept, from the file


def test_each_turn_names_the_parser_that_found_its_action(fake_llm) -> None:
    replies = {"json": '{"action": "right"}', "words": "I pull the right one"}
    for reply, parser in ((replies["json"], "json"), (replies["words"], "regex")):
        agent = fake_llm(lambda prompt, reply=reply: reply).attach(
            BanditAgent(config={"agent": {"name": "bandit"}})
        )
        slot = agent.engine.new_slot(0, {}, None, None)
        (turn,) = agent.engine.decide([slot])
        assert turn.legal_actions[turn.action_index] == "right" and turn.parser == parser
