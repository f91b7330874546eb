"""The TRL backend: any env plugin trained by TRL's GRPOTrainer through LlamaGym's own
rollout engine (tiny model, CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from llamagym_blackjack.agent import BlackjackAgent
from safetensors.torch import load_file

from llamagym.errors import ConfigError, LlamaGymError
from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.policy import Replies
from llamagym.plugin_runtime.manager import Plugins
from llamagym.resolver import trl_arguments
from llamagym.resolver.layers import resolve_agent_config
from llamagym.resolver.trl_arguments import grpo_args, mixed_precision_bf16
from llamagym.testing import free_port
from llamagym.training.records.run_files import read_metrics
from llamagym.trl_backend import settings as trl_settings
from llamagym.trl_backend.rollout import EpisodeRollouts, SequenceEngine, episode_sequence
from llamagym.trl_backend.settings import check_supported
from llamagym.trl_backend.trainer import TRLTrainer

pytest.importorskip("trl")

# Each test starts TRL (or a process that does): minutes in all; `make test-fast` skips them.
pytestmark = pytest.mark.slow

LLAMAGYM = [sys.executable, "-m", "llamagym.cli"]
SMALL = {
    "training": {"backend": "trl", "episodes": 32, "eval_episodes": 20, "threads": 1},
    "algorithm": {"episodes_per_update": 16, "minibatch_size": 8, "group_size": 4},
    "rollout": {"num_envs": 8},
    "output": {"quiet": True},
}


def run_cli(*args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*LLAMAGYM, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def arguments_of(agent: BlackjackAgent, path: Path, config: Any = None) -> Any:
    """TRL's GRPOConfig for ``agent``'s run (``config`` in place of its own)."""
    config = agent.config if config is None else config
    return grpo_args(config, agent.resolved.algorithm, path, world_size=1, use_cpu=True)


def small_agent(tmp_path: Path, **sections: dict) -> BlackjackAgent:
    layer = json.loads(json.dumps(SMALL))
    layer["output"]["dir"] = str(tmp_path / "run")
    for name, values in sections.items():
        layer.setdefault(name, {}).update(values)
    return BlackjackAgent(config=resolve_agent_config(BlackjackAgent, [("--set", layer)]))


# -- episodes as sequences ---------------------------------------------------------------
class ScriptedReplies:
    """A rollout policy whose replies are fixed texts, in turn (tokenized as a model
    would have sampled them); the tiny model's tokenizer and chat template."""

    def __init__(self, tokenizer: Any, replies: list[str]):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_token_id
        self.max_context = 512
        self.replies = replies
        self.turn = 0

    def generate(self, prompts: list[list[int]], **_: Any) -> Replies:
        replies = []
        for _prompt in prompts:
            text = self.replies[min(self.turn, len(self.replies) - 1)]
            replies.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        self.turn += 1
        return Replies.unscored(replies)


def test_env_mask_is_one_on_the_models_tokens_and_zero_on_every_other(tmp_path) -> None:
    agent = small_agent(tmp_path)
    _, tokenizer = load_model_and_tokenizer("tiny")
    # hit, hit, then stick: a Blackjack episode of up to three turns (seed 3 deals 5 + 4).
    policy = ScriptedReplies(tokenizer, ['hit"}', 'hit"}', 'stick"}'])
    engine = SequenceEngine(agent, policy, agent.config.rollout, seed=0)
    [episode] = engine.collect([agent.make_env()], 1, seeds=[3])
    assert len(episode.turns) >= 2, "the scripted episode must have several turns"
    sequence = episode_sequence(episode, tokenizer.eos_token_id)
    prefix = agent.config.rollout.reply_prefix

    # By hand: the chat template's text of the whole conversation, split where the
    # model's replies are; everything else is the environment's or the template's.
    conversation = [{"role": "system", "content": agent.get_system_prompt()}]
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    rendered = ""
    for position, turn in enumerate(episode.turns):
        conversation.append({"role": "user", "content": turn.user_text})
        text = (
            tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
            + prefix
        )
        context = tokenizer(text[len(rendered) :], add_special_tokens=False)["input_ids"]
        if position == 0:
            assert sequence.prompt_ids == context
        else:
            expected_ids += context
            expected_mask += [0] * len(context)
        reply = tokenizer(turn.reply[len(prefix) :], add_special_tokens=False)["input_ids"]
        expected_ids += reply
        expected_mask += [1] * len(reply)
        conversation.append({"role": "assistant", "content": turn.reply})
        rendered = text + turn.reply[len(prefix) :]
    expected_ids.append(tokenizer.eos_token_id)
    expected_mask.append(0)
    assert sequence.completion_ids == expected_ids
    assert sequence.env_mask == expected_mask
    # Every observation's tokens are masked: none of the model's tokens spell one.
    trained = tokenizer.decode([t for t, m in zip(expected_ids, expected_mask, strict=True) if m])
    assert "Sum" not in trained and "dealer" not in trained
    assert trained.count("hit") + trained.count("stick") == len(episode.turns)
    # And the model acted on exactly those tokens: each turn's prompt is the sequence so far.
    full = sequence.prompt_ids + sequence.completion_ids
    for turn in episode.turns:
        assert full[: len(turn.prompt_tokens)] == turn.prompt_tokens


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path) -> None:
    agent = small_agent(tmp_path)
    _, tokenizer = load_model_and_tokenizer("tiny")
    # A template that shows only the newest message: earlier turns vanish from the prompt.
    tokenizer.chat_template = (
        "{{ messages[-1]['content'] }}{% if add_generation_prompt %} A:{% endif %}"
    )
    policy = ScriptedReplies(tokenizer, ['hit"}'])
    engine = SequenceEngine(agent, policy, agent.config.rollout, seed=0)
    with pytest.raises(LlamaGymError, match="cannot be trained as one sequence"):
        engine.collect([agent.make_env()], 1, seeds=[3])


# -- a run -------------------------------------------------------------------------------
class Recorder:
    """Wraps the rollout and reward functions of a run: what TRL was given and paid."""

    def __init__(self, monkeypatch):
        self.batches: list[dict[str, Any]] = []
        self.rewards: list[tuple[list[list[int]], list[float]]] = []
        self.played: list[Any] = []
        call, reward = EpisodeRollouts.__call__, EpisodeRollouts.reward
        recorder = self

        def recorded_call(rollouts, prompts, trainer):
            output = call(rollouts, prompts, trainer)
            pending = dict(rollouts.pending)
            recorder.batches.append(
                {
                    "prompts": list(prompts),
                    **output,
                    "episodes": [pending[key][0] for key in output["episode_key"]],
                }
            )
            return output

        def recorded_reward(rollouts, prompts, completions, completion_ids, **kwargs):
            paid = reward(rollouts, prompts, completions, completion_ids, **kwargs)
            recorder.rewards.append(([list(ids) for ids in completion_ids], paid))
            return paid

        #: (update, metrics) of every update_end the loggers were called with
        self.update_ends: list[tuple[int, dict[str, Any]]] = []

        def recorded_update_end(plugins, agent, update, metrics, run=None):
            recorder.update_ends.append((update, dict(metrics)))

        monkeypatch.setattr(Plugins, "update_end", recorded_update_end)

        monkeypatch.setattr(EpisodeRollouts, "__call__", recorded_call)
        monkeypatch.setattr(EpisodeRollouts, "reward", recorded_reward)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """One short Blackjack run under TRL (32 episodes, two updates), recorded."""
    monkeypatch = pytest.MonkeyPatch()
    tmp_path = tmp_path_factory.mktemp("trl")
    recorder = Recorder(monkeypatch)
    # The untrained tiny model's replies name no action: with random fallbacks a
    # seed group's returns differ, so GRPO has something to learn from. Each step
    # accumulates its minibatch of 8 from two micro-batches.
    agent = small_agent(
        tmp_path,
        output={"checkpoint_every": 1},
        rollout={"invalid_action": {"policy": "random"}},
        algorithm={"microbatch_size": 4},
    )
    initial, _ = load_model_and_tokenizer("tiny", lora=False)
    before = {name: p.detach().clone() for name, p in initial.named_parameters()}
    try:
        summary = TRLTrainer(agent, agent.session).run()
    finally:
        monkeypatch.undo()
    return summary, recorder, before


def test_a_run_changes_the_weights_and_writes_a_native_run_directory(recorded_run) -> None:
    summary, _, before = recorded_run
    run = summary.output_dir
    for name in ("config.yaml", "metrics.jsonl", "report.md", "transcripts.jsonl"):
        assert (run / name).is_file(), name
    assert summary.episodes == 32 and summary.updates == 2
    after = load_file(str(run / "model" / "model.safetensors"))
    changed = [n for n, w in before.items() if n in after and not torch.equal(w, after[n])]
    assert changed, "no trained weight changed"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in records if r["kind"] == "update"]
    assert [r["update"] for r in updates] == [1, 2]
    for key in ("return_mean", "invalid_rate", "env_steps_per_second", "entropy_vocab",
                "policy_loss"):
        assert all(key in r for r in updates), key
    assert not any("entropy" in r for r in updates)  # the native name means another thing
    # The loggers heard of each update, with what metrics.jsonl holds.
    logged = recorded_run[1].update_ends
    assert [update for update, _ in logged] == [1, 2]
    assert [metrics for _, metrics in logged] == [
        {k: v for k, v in r.items() if k != "kind"} for r in updates
    ]
    [evaluation] = [r for r in records if r["kind"] == "evaluation"]
    assert evaluation["episodes"] == 20 and evaluation["baselines"]
    assert "backend: trl" in (run / "config.yaml").read_text()


def test_each_trl_group_holds_episodes_of_one_seed(recorded_run) -> None:
    _, recorder, _ = recorded_run
    group = 4
    assert recorder.batches
    for batch in recorder.batches:
        seeds = [episode.seed for episode in batch["episodes"]]
        assert seeds == [trl_settings.seed_of(p) for p in batch["prompts"]]
        groups = [seeds[k : k + group] for k in range(0, len(seeds), group)]
        assert all(len(set(g)) == 1 for g in groups)
        assert len({g[0] for g in groups}) == len(groups)  # one seed per group


def test_each_reward_is_the_return_of_the_episode_its_tokens_came_from(recorded_run) -> None:
    _, recorder, _ = recorded_run
    by_tokens: dict[tuple, list[float]] = {}
    for batch in recorder.batches:
        for ids, episode in zip(batch["completion_ids"], batch["episodes"], strict=True):
            by_tokens.setdefault(tuple(ids), []).append(episode.total_reward)
    paid = [
        (ids, r)
        for tokens, rewards in recorder.rewards
        for ids, r in zip(tokens, rewards, strict=True)
    ]
    assert len(paid) == 32
    for ids, reward in paid:
        assert reward in by_tokens[tuple(ids)]
    # Rewards vary, so the check above could fail: a misalignment would show.
    assert len({r for _, r in paid}) > 1


def test_a_reward_paired_with_another_episodes_tokens_is_refused(tmp_path) -> None:
    agent = small_agent(tmp_path)
    rollouts = EpisodeRollouts(agent, None, seed=0)
    first, second = agent_episode(5, -1.0), agent_episode(6, 1.0)
    rollouts.pending = {0: (first, [1, 2, 3]), 1: (second, [4, 5, 6])}
    kwargs = {"episode_key": [0, 1], "seed": [5, 6]}
    assert rollouts.reward([], [], [[1, 2, 3], [4, 5, 6]], **kwargs) == [-1.0, 1.0]
    rollouts.pending = {0: (first, [1, 2, 3]), 1: (second, [4, 5, 6])}
    with pytest.raises(LlamaGymError, match="another episode's tokens"):
        rollouts.reward([], [], [[4, 5, 6], [1, 2, 3]], **kwargs)


def agent_episode(seed: int, reward: float):
    from llamagym.rollout.trajectory import Episode, Turn

    turn = Turn(
        prompt_tokens=[9],
        legal_actions=["stick"],
        action_index=0,
        reply="",
        logprobs=[],
        value=0.0,
        reward=reward,
    )
    return Episode(turns=[turn], env_return=reward, seed=seed)


def test_a_run_resumes_from_its_trl_checkpoint(recorded_run, tmp_path) -> None:
    summary, _, _ = recorded_run
    import shutil

    run = tmp_path / "run"
    shutil.copytree(summary.output_dir, run)
    agent = small_agent(
        tmp_path,
        training={"episodes": 48},
        output={"checkpoint_every": 1, "dir": str(run)},
        rollout={"invalid_action": {"policy": "random"}},
    )
    resumed = TRLTrainer(agent, agent.session, resume_from=run).run()
    # 2 updates x 2 minibatches x 2 epochs
    assert resumed.resumed_from.name == "checkpoint-8"
    assert resumed.updates == 3 and resumed.episodes == 48
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in records if r["kind"] == "update"] == [1, 2, 3]


# -- settings ----------------------------------------------------------------------------
def test_settings_map_onto_grpo_config(tmp_path) -> None:
    agent = small_agent(
        tmp_path,
        algorithm={"lr": 3e-4, "kl_coef": 0.05, "clip_range": 0.3, "epochs": 2,
                   "microbatch_size": 4, "warmup_steps": 3},
        trl={"vllm_mode": "server", "loss_type": "grpo"},
    )
    # vLLM is for GPU machines: its settings' mapping, on a config that skips the check.
    config = agent.config.model_copy(deep=True)
    config.trl.use_vllm = True
    args = arguments_of(agent, tmp_path, config)
    # A minibatch of 8 is one optimizer step over two micro-batches of 4.
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 2)
    assert (args.learning_rate, args.beta, args.epsilon, args.num_iterations) == (
        3e-4,
        0.05,
        0.3,
        2,
    )
    assert (args.num_generations, args.generation_batch_size) == (4, 16)
    assert args.warmup_steps == 3
    assert (args.use_vllm, args.vllm_mode, args.loss_type) == (True, "server", "grpo")
    # The rollout returns vLLM's log-probabilities: TRL's correction by them stays on.
    assert args.vllm_importance_sampling_correction is True
    # 32 episodes = 2 updates of 16; each update is 2 minibatches of 8, twice.
    assert args.max_steps == 8


def test_any_grpo_config_field_passes_through_trl_settings(tmp_path) -> None:
    agent = small_agent(
        tmp_path,
        trl={"vllm_gpu_memory_utilization": 0.5, "adam_beta2": "0.99", "save_only_model": True},
    )
    check_supported(agent.resolved)
    args = arguments_of(agent, tmp_path)
    assert args.vllm_gpu_memory_utilization == 0.5 and args.save_only_model is True
    # A value is taken as its field's type (YAML reads 1e308 or 0.99 in quotes as text).
    assert args.adam_beta2 == 0.99 and isinstance(args.adam_beta2, float)


@pytest.mark.parametrize(
    ("trl", "says"),
    [
        ({"vllm_gpu_memory_utilisation": 0.5}, "did you mean vllm_gpu_memory_utilization"),
        ({"learning_rate": 1e-3}, "the TRL backend sets it from algorithm.lr"),
        ({"remove_unused_columns": True}, "reads the dataset's seed column"),
        ({"ds3_gather_for_generation": False}, "ZeRO-3 must gather the parameters"),
    ],
)
def test_a_trl_setting_grpo_config_lacks_or_the_run_sets_is_refused(trl, says, tmp_path) -> None:
    with pytest.raises(ConfigError, match=says) as refused:
        small_agent(tmp_path, trl=trl)  # by the config resolver
    assert str(refused.value).count("\n") == 0


@pytest.mark.parametrize(
    ("asked", "launched", "bf16"),
    [(None, "bf16", True), (None, "no", False), (None, None, False), (True, None, True),
     (False, "fp16", False), (True, "bf16", True), (True, "no", "refused")],
)
def test_bf16_follows_the_launcher_unless_asked(asked, launched, bf16, monkeypatch) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    if launched is not None:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)
    if bf16 == "refused":
        with pytest.raises(ConfigError, match="launched with mixed_precision=no"):
            mixed_precision_bf16(asked)
    else:
        assert mixed_precision_bf16(asked) is bf16


def test_a_value_grpo_config_refuses_is_one_line_naming_it(tmp_path) -> None:
    with pytest.raises(ConfigError, match="^trl.optim='nope': TRL's GRPOConfig refused it: "):
        small_agent(tmp_path, trl={"optim": "nope", "adam_beta2": 0.99})


def test_backend_defaults_make_any_agent_start_under_trl(tmp_path) -> None:
    config = small_agent(tmp_path).config
    assert config.algorithm.name == "grpo" and config.rollout.mode == "generate"
    assert config.rollout.history_turns is None  # Blackjack's own default is 0


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("rollout.mode=score", "--mode generate"),
        ("algorithm.name=ppo", "--algorithm grpo"),
        ("algorithm.credit=terminal", "algorithm.credit=discounted"),
        ("rollout.history_turns=2", "leave rollout.history_turns unset"),
        ("rollout.invalid_action.policy=reprompt", "use fallback"),
        ("algorithm.target_kl=0.02", "algorithm.kl_coef"),
        ("algorithm.microbatch_size=3", "must divide algorithm.minibatch_size"),
    ],
)
def test_what_cannot_carry_over_is_one_line_and_exit_2(setting, named, tmp_path) -> None:
    result = run_cli(
        "run", "blackjack", "--backend", "trl", "--set", setting, "--output", str(tmp_path / "r")
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], result.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_trl_settings_need_the_trl_backend_and_are_validated() -> None:
    with pytest.raises(ConfigError, match="trl.use_vllm: applies only to the TRL backend"):
        resolve_agent_config(BlackjackAgent, [("--set", {"trl": {"use_vllm": True}})])
    result = run_cli("run", "blackjack", "--backend", "trl", "--set", "trl.use_vlm=true")
    assert result.returncode == 2
    assert "trl.use_vlm" in result.stderr and "use_vllm" in result.stderr


def test_config_show_shows_trl_settings_only_for_the_trl_backend() -> None:
    trl = run_cli("config", "show", "blackjack", "--backend", "trl")
    native = run_cli("config", "show", "blackjack")
    assert trl.returncode == native.returncode == 0, trl.stderr + native.stderr
    assert "\ntrl:" in trl.stdout and "use_vllm: false" in trl.stdout
    assert "name: grpo" in trl.stdout and "# from TRL backend defaults" in trl.stdout
    assert "\ntrl:" not in native.stdout


def test_without_trl_the_backend_is_a_one_line_install_hint(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    with pytest.raises(LlamaGymError, match=r'needs trl: pip install "trl>=1.16,<2"'):
        trl_arguments.require_trl()


def test_deepspeed_with_the_native_backend_points_to_trl(monkeypatch) -> None:
    from llamagym import distributed

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="--backend trl"):
        distributed.start("auto")


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (GPU only)"
)
def test_vllm_colocate_generation_when_vllm_is_installed(tmp_path) -> None:
    agent = small_agent(tmp_path, trl={"use_vllm": True, "vllm_mode": "colocate"})
    summary = TRLTrainer(agent, agent.session).run()
    assert summary.updates == 2


FSDP2_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "accelerate" / "fsdp2.yaml"


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch",
    [["--multi_gpu"], ["--config_file", str(FSDP2_CONFIG)]],
    ids=["multi-gpu-flag", "fsdp2-config"],
)
def test_two_processes_under_accelerate_end_with_identical_weights(tmp_path, launch) -> None:
    """On CPUs accelerate runs an FSDP launch as plain data-parallel: the run says so and
    trains like the --multi_gpu one (the docs' config file, its GPU count and bf16
    overridden by flags)."""
    run = tmp_path / "run"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            *launch,
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            # A port of its own: a launcher of an earlier test may still hold the default.
            "--main_process_port",
            str(free_port()),
            "-m",
            "llamagym.cli",
            "run",
            "blackjack",
            "--backend",
            "trl",
            "--episodes",
            "32",
            "--eval-episodes",
            "10",
            "--quiet",
            "--output",
            str(run),
            "--set",
            "algorithm.episodes_per_update=16",
            "--set",
            "algorithm.minibatch_size=4",
            "--set",
            "algorithm.group_size=4",
            "--set",
            "rollout.num_envs=4",
            "--set",
            "output.rank_records=true",
            "--set",
            "training.threads=1",
            # Random fallbacks give a seed group's episodes different returns, so each
            # update has advantages to train on and the weights move.
            "--set",
            "rollout.invalid_action.policy=random",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    # Rank 0's traceback fills the end of stderr when rank 1 fails first: show both.
    rank1 = "\n".join(line for line in result.stderr.splitlines() if "[rank1]" in line)
    assert result.returncode == 0, rank1[-3000:] + "\n---\n" + result.stderr[-3000:]
    fsdp_on_cpu = "accelerate was launched with FSDP, which it runs only on GPUs"
    assert (fsdp_on_cpu in result.stderr) == ("--config_file" in launch), result.stderr[-2000:]
    ranks = {}
    for rank in (0, 1):
        lines = (run / ".ranks" / f"rank-{rank}.jsonl").read_text().splitlines()
        ranks[rank] = [json.loads(line) for line in lines]
    assert [r["update"] for r in ranks[0]] == [r["update"] for r in ranks[1]] == [1, 2]
    assert ranks[0][0]["parameters_sha256"] != ranks[0][1]["parameters_sha256"]
    for zero, one in zip(ranks[0], ranks[1], strict=True):
        assert zero["parameters_sha256"] == one["parameters_sha256"]
        assert set(zero["seeds"]).isdisjoint(one["seeds"])  # each rank its own groups
    # The logged numbers cover both processes, as in a native run: 16 episodes an update.
    updates = [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "update"]
    assert [r["episodes"] for r in updates] == [
        zero["episodes"] + one["episodes"] for zero, one in zip(ranks[0], ranks[1], strict=True)
    ] == [16, 16]
    assert updates[-1]["total_episodes"] == 32


@pytest.mark.parametrize("name", ["zero2", "zero3", "fsdp2"])
def test_the_documented_accelerate_configs_are_accelerates_format(name) -> None:
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).parents[2] / "docs" / "accelerate" / f"{name}.yaml"
    config = load_config_from_file(str(path))
    expected = "FSDP" if name.startswith("fsdp") else "DEEPSPEED"
    assert config.distributed_type.value == expected
    assert "--backend trl" in path.read_text().splitlines()[0]


class VLLMDouble:
    """What TRL's ``VLLMGeneration.generate`` returns (prompt ids, completion ids,
    per-token log-probs, their token ids), with fixed replies in turn; vLLM stops at the
    end-of-turn token, this double also returns tokens after it."""

    def __init__(self, tokenizer: Any, replies: list[str]):
        self.tokenizer, self.replies, self.calls = tokenizer, replies, []

    def generate(self, prompts, images, num_generations, profiler=None):
        assert images is None and num_generations == 1
        self.calls.append([list(prompt) for prompt in prompts])
        text = self.replies[min(len(self.calls) - 1, len(self.replies) - 1)]
        reply = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        completion = [*reply, self.tokenizer.eos_token_id, *reply]
        completions = [list(completion) for _ in prompts]
        logprobs = [[[-0.5] for _ in completion] for _ in prompts]
        return prompts, completions, logprobs, [[[t] for t in c] for c in completions]


def test_the_rollout_plays_with_vllms_tokens_and_returns_their_log_probs(tmp_path) -> None:
    """With ``trl.use_vllm`` the rollout function samples through TRL's vLLM generation:
    each reply is vLLM's tokens up to the end-of-turn token, and every reply token keeps
    vLLM's log-probability (NaN on the environment's and the template's tokens)."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    agent = small_agent(tmp_path, rollout={"num_envs": 2})
    model, tokenizer = load_model_and_tokenizer("tiny", seed=0)
    vllm = VLLMDouble(tokenizer, ['hit"}', 'stick"}'])
    trainer = SimpleNamespace(
        accelerator=Accelerator(cpu=True),
        model_wrapped=model,
        model=model,
        args=SimpleNamespace(gradient_checkpointing_kwargs=None),
        use_vllm=True,
        vllm_generation=vllm,
    )
    rollouts = EpisodeRollouts(agent, tokenizer, seed=0)
    try:
        output = rollouts(["seed=3", "seed=3"], trainer)
    finally:
        rollouts.close()
    assert len(vllm.calls) == 2 and len(output["completion_ids"]) == 2
    rows = zip(output["completion_ids"], output["env_mask"], output["logprobs"], strict=True)
    for completion, mask, logprobs in rows:
        assert len(logprobs) == len(completion)
        replies = tokenizer.decode([t for t, m in zip(completion, mask, strict=True) if m])
        # hit, then stick; what vLLM gave after a reply's end of turn is not kept
        assert (replies.count("hit"), replies.count("stick")) == (1, 1), replies
        assert all((lp == -0.5) == bool(m) for lp, m in zip(logprobs, mask, strict=True))
    # Every prompt vLLM was given is an episode's sequence so far.
    fulls = [p + c for p, c in zip(output["prompt_ids"], output["completion_ids"], strict=True)]
    for call in vllm.calls:
        for prompt in call:
            assert any(full[: len(prompt)] == prompt for full in fulls)


class PolicyAsVLLM:
    """vLLM's generate contract over the tiny model itself: its sampled replies and each
    token's log-probability (temperature 1, no other processor), so TRL's importance
    ratio over correctly aligned log-probabilities is 1."""

    def __init__(self, model: Any, tokenizer: Any):
        from llamagym.models.policy import Policy

        self.policy = Policy(model, tokenizer)
        self.generator = torch.Generator().manual_seed(0)

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        replies = self.policy.generate(prompts, max_new_tokens=8, generator=self.generator)
        logprobs = [[[lp] for lp in row] for row in replies.logprobs]
        return prompts, replies.tokens, logprobs, None


def test_trls_importance_sampling_correction_accepts_the_rollouts_log_probs(tmp_path) -> None:
    """TRL's own _generate_and_score_completions over the rollout function with vLLM's
    contract: the sampling log-probabilities it subtracts from the model's line up with
    the tokens, so the ratio is 1 (misaligned ones would differ by whole nats)."""
    from trl import GRPOTrainer

    agent = small_agent(
        tmp_path, rollout={"num_envs": 4, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    )
    model, tokenizer = load_model_and_tokenizer("tiny", seed=0)
    rollouts = EpisodeRollouts(agent, tokenizer, seed=0)
    args = arguments_of(agent, tmp_path / "run")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[rollouts.reward],
        args=args,
        train_dataset=trl_settings.seed_dataset(agent.config, 4),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    # vLLM's part, switched on after construction (vLLM itself needs GPUs).
    trainer.use_vllm, trainer.vllm_importance_sampling_correction = True, True
    trainer.vllm_generation, trainer._last_loaded_step = PolicyAsVLLM(trainer.model, tokenizer), -1
    batch = [{"prompt": f"seed={seed}", "seed": seed} for seed in (3, 3, 3, 3, 7, 7, 7, 7)]
    try:
        scored = trainer._generate_and_score_completions(batch)
    finally:
        rollouts.close()
    logged = {**trainer._metrics["eval"], **trainer._metrics["train"]}
    metrics = {k: sum(v) / len(v) for k, v in logged.items() if v}
    difference = [v for k, v in metrics.items() if "sampling_logp_difference" in k]
    ratios = [v for k, v in metrics.items() if "importance_sampling_ratio" in k]
    assert difference and ratios, sorted(metrics)
    assert max(abs(d) for d in difference) < 1e-3, metrics
    assert all(abs(r - 1) < 1e-3 for r in ratios), metrics
    assert scored["importance_sampling_ratio"].shape[0] == 8


@pytest.mark.parametrize(
    ("trl", "says"),
    [
        ({"hub_token": "hf_secret"}, "from the environment (HF_TOKEN)"),
        ({"model_init_kwargs": {"attn_implementation": "eager"}}, "from the model section"),
        ({"weight_decay": float("nan")}, "trl.weight_decay=nan: not a finite number"),
    ],
)
def test_secrets_model_keywords_and_non_numbers_are_refused(trl, says, tmp_path) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)):
        small_agent(tmp_path, trl=trl)


@pytest.mark.parametrize(
    ("trl", "says"),
    [
        # TRL's own checks: the optimizer and GRPOConfig built before anything is written
        ({"adam_beta1": 2}, "trl.adam_beta1=2: TRL's optimizer refused it: Invalid beta"),
        ({"adam_epsilon": -1}, "trl.adam_epsilon=-1: TRL's optimizer refused it"),
        ({"optim_args": "a"}, "trl.optim_args='a': TRL's optimizer refused it"),
        ({"steps_per_generation": 3}, "trl.steps_per_generation=3: TRL's GRPOConfig refused it"),
        ({"num_train_epochs": "many"}, "trl.num_train_epochs='many': GRPOConfig.num_train_epochs"
                                       " takes float"),
        # not a finite number, anywhere in the value
        ({"lr_scheduler_kwargs": {"a": float("nan")}}, "trl.lr_scheduler_kwargs.a=nan: not a"),
        ({"generation_kwargs": {"x": [1, float("inf")]}}, "trl.generation_kwargs.x[1]=inf: not"),
        # what this machine cannot honour, or the backend sets up another way
        ({"push_to_hub": True}, "trl.push_to_hub=true: the Hugging Face Hub is switched off"),
        ({"report_to": "wandb"}, "trl.report_to='wandb': wandb not installed here"),
        ({"use_liger_kernel": True}, "trl.use_liger_kernel=true: liger-kernel is not installed"),
        ({"deepspeed": "ds.json"}, "trl.deepspeed='ds.json': DeepSpeed is set up by the launcher"),
        ({"fsdp": "full_shard"}, "trl.fsdp='full_shard': FSDP is set up by the launcher"),
        ({"torch_compile": True}, "trl.torch_compile=True: the rollout runs the model's forward"),
        ({"eval_strategy": "steps"}, "trl.eval_strategy='steps': the run evaluates the trained"),
        ({"reward_weights": [1, 2]}, "trl.reward_weights: the TRL backend sets it to one reward"),
    ],
)
def test_every_trl_value_is_checked_before_anything_is_written(
    trl, says, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "vllm" in str(trl) and importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    with pytest.raises(ConfigError) as refused:
        small_agent(tmp_path, trl=trl)  # the config resolver, as config show and run use it
    message = str(refused.value)
    assert says in message and "\n" not in message, message
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed")
def test_vllm_without_vllm_installed_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="^trl.use_vllm=true: vLLM is not installed here"):
        small_agent(tmp_path, trl={"use_vllm": True})


def test_config_show_and_run_refuse_the_same_trl_setting_in_one_line(tmp_path) -> None:
    flags = ["blackjack", "--backend", "trl", "--set", "trl.vllm_gpu_memory_utilisation=0.5"]
    show = run_cli("config", "show", *flags)
    run = run_cli("run", *flags, "--output", str(tmp_path / "r"))
    assert show.returncode == run.returncode == 2, show.stdout + show.stderr
    assert show.stdout == "" and show.stderr == run.stderr, (show.stderr, run.stderr)
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "did you mean vllm_gpu_memory_utilization?" in lines[0], lines
    assert len(lines[0]) < 200  # the closest names, not every field of GRPOConfig
    assert not (tmp_path / "r").exists()


def test_the_completions_table_shows_escape_sequences_escaped(tmp_path, capfd) -> None:
    """TRL's log_completions prints each episode's text (observations, replies) as a
    table: a terminal's escape sequences in it are shown, not obeyed."""
    from llamagym.trl_backend.trainer import printable_grpo_trainer

    pytest.importorskip("rich")
    agent = small_agent(tmp_path, trl={"log_completions": True})
    model, tokenizer = load_model_and_tokenizer("tiny", seed=0)
    rollouts = EpisodeRollouts(agent, tokenizer, seed=0)
    trainer = printable_grpo_trainer(
        model=model,
        reward_funcs=[rollouts.reward],
        args=arguments_of(agent, tmp_path / "run"),
        train_dataset=trl_settings.seed_dataset(agent.config, 4),
        processing_class=tokenizer,
        rollout_func=rollouts,
    )
    rollouts.close()
    (tmp_path / "run" / "checkpoints" / "completions").mkdir(parents=True, exist_ok=True)
    observation = "Your hand: 14\x1b]52;c;cm0gLXJmIH4=\x07\x1b[2J"
    trainer._logs["prompt"].append("seed=3")
    trainer._logs["completion"].append(observation + ' {"action": "hit"}')
    trainer._logs["rewards"]["reward"].append(1.0)
    trainer._logs["advantages"].append(0.5)
    capfd.readouterr()
    trainer.log({})
    shown = capfd.readouterr().out
    assert "\x1b" not in shown and "\x07" not in shown
    assert "\\x1b]52" in shown.replace("\n", "").replace("│", "").replace(" ", "")


def test_trls_own_remote_code_switch_follows_the_model_section(tmp_path) -> None:
    args = arguments_of(small_agent(tmp_path), tmp_path)
    assert getattr(args, "trust_remote_code", False) is False


@pytest.mark.parametrize("entry", ["model", "checkpoints/checkpoint-3"])
def test_a_trl_run_writes_through_no_link_out_of_its_directory(entry, tmp_path) -> None:
    """TRL's own entries (the exported model, its checkpoints) are the run's folders:
    a link there, to another run's, is refused before anything is written."""
    run_dir, outside = tmp_path / "r", tmp_path / "outside"
    (run_dir / entry).parent.mkdir(parents=True)
    outside.mkdir()
    (run_dir / entry).symlink_to(outside, target_is_directory=True)
    result = run_cli("run", "blackjack", "--backend", "trl", "--output", str(run_dir))
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"{str(run_dir / entry)!r} is a symbolic link" in lines[0]
    assert not any(outside.iterdir()) and sorted(p.name for p in run_dir.iterdir()) == sorted(
        {entry.split("/")[0]}
    )
