"""What comes from outside is bounded: a config file cannot turn on a model's own code,
one process writes a run directory, a refused run writes nothing, a hostile env cannot
hang or blow up a run, and a chat template cannot hang a command. Each refusal is one
line (exit code 2) on the command line and a typed ``LlamaGymError`` in Python."""

from __future__ import annotations

import gc
import json
import math
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import gymnasium
import pytest
import yaml

from llamagym import hookimpl
from llamagym.errors import ConfigError, EnvFailureError
from llamagym.models.chat_template import ChatTemplateError, render_chat
from llamagym.testing import (
    BanditAgent,
    TwoArmedBandit,
    model_with_its_own_code,
    one_error_line,
    temporary_plugin,
    tiny_agent,
)
from llamagym.training.records.run_lock import WRITER, RunDirectoryBusyError, RunDirectoryLock

FAST = [
    "--num-envs", "2", "--threads", "1", "--episodes", "4", "--eval-episodes", "2",
    "--set", "algorithm.episodes_per_update=4", "--set", "algorithm.minibatch_size=4",
    "--set", "algorithm.epochs=1", "--quiet",
]


# -- 1. trust comes from the command line only --------------------------------------------
def test_a_config_file_cannot_turn_on_remote_code(tmp_path, cli) -> None:
    model, marker = model_with_its_own_code(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name": str(model), "trust_remote_code": True}}))
    # A run's own config.yaml, tampered with, reused as --config as its header suggests.
    own = tmp_path / "config.yaml"
    own.write_text(
        "# LlamaGym run configuration\nmodel:\n  # Run model code from the Hub repo.\n"
        f"  name: {json.dumps(str(model))}  # from flag\n  trust_remote_code: yes\n"
    )
    for how in (["--config", recipe], ["--config", own],
                ["--set", f"model.name={model}", "--set", "model.trust_remote_code=true"]):
        output = tmp_path / "run"
        code, _, err = cli("run", "blackjack", *how, *FAST, "--output", output)
        assert code == 2, err
        line = one_error_line(err)
        assert "model.trust_remote_code" in line and "--trust-remote-code" in line
        assert not marker.exists()
        assert not output.exists()
    code, _, err = cli("eval", "blackjack", "--checkpoint", tmp_path, "--set",
                       "model.trust_remote_code=true")
    assert code == 2 and "--trust-remote-code" in one_error_line(err)


@pytest.mark.parametrize(
    "trl",
    [{"trust_remote_code": True}, {"model_init_kwargs": {"trust_remote_code": True}}],
)
def test_trl_settings_cannot_turn_on_remote_code_either(tmp_path, cli, trl) -> None:
    """TRL builds its reference model with its own switches: from a config file or
    --set they are refused before anything loads or is written, as model's is."""
    pytest.importorskip("trl")
    model, marker = model_with_its_own_code(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model": {"name": str(model)}, "trl": trl}))
    flat = ".".join(next(iter(_paths(trl))))
    trl_run = ["--backend", "trl", "--mode", "generate", "--algorithm", "grpo"]
    for how in (["--config", recipe],
                ["--set", f"model.name={model}", "--set", f"trl.{flat}=true"]):
        output = tmp_path / "run"
        code, _, err = cli("run", "blackjack", *trl_run, *how, *FAST, "--output", output)
        assert code == 2, err
        line = one_error_line(err)
        assert f"trl.{flat}" in line and "--trust-remote-code" in line
        assert not marker.exists() and not output.exists()


def _paths(tree: dict, prefix: tuple = ()):
    for key, value in tree.items():
        yield from (_paths(value, (*prefix, key)) if isinstance(value, dict)
                    else [(*prefix, key)])


def test_the_python_call_and_a_false_setting_are_allowed(tmp_path) -> None:
    from llamagym.config.files import read_config_file, refuse_code_settings

    refuse_code_settings({"model": {"trust_remote_code": False}}, "a run's config.yaml")
    agent = tiny_agent(BanditAgent, model={"trust_remote_code": True})
    assert agent.config.model.trust_remote_code is True
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("model:\n  trust_remote_code: true\n")
    assert read_config_file(recipe)["model"]["trust_remote_code"] is True  # data, as read


# -- 2. one writer per run directory ---------------------------------------------------
HOLD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from llamagym.training.records.run_lock import RunDirectoryLock
    lock = RunDirectoryLock(Path(sys.argv[1]))
    lock.acquire()
    print("locked", flush=True)
    time.sleep(120)
    """
)


def hold_lock(directory: Path) -> subprocess.Popen:
    """Another process that holds ``directory``'s lock (as a run writing it does)."""
    directory.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_writer_is_refused_and_a_dead_writers_lock_taken_over(tmp_path, cli,
                                                                        caplog) -> None:
    output = tmp_path / "run"
    holder = hold_lock(output)
    try:
        code, _, err = cli("run", "blackjack", *FAST, "--output", output)
        assert code == 2, err
        line = one_error_line(err)
        assert f"being written by process {holder.pid}" in line and "--output" in line
        assert sorted(p.name for p in output.iterdir()) == [".llamagym.lock", WRITER]
        with pytest.raises(RunDirectoryBusyError, match=str(holder.pid)):
            RunDirectoryLock(output).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)  # no chance to release anything
        holder.wait()
    assert json.loads((output / WRITER).read_text())["pid"] == holder.pid  # left behind

    code, out, err = cli("run", "blackjack", *FAST, "--output", output)
    assert code == 0, err
    taken = [r.getMessage() for r in caplog.records if "taking it over" in r.getMessage()]
    assert len(taken) == 1 and str(holder.pid) in taken[0] and "no longer running" in taken[0]
    assert (output / "checkpoints").is_dir() and not (output / WRITER).exists()


# -- 3. a refused run writes nothing ----------------------------------------------------
def test_the_trl_batch_rule_is_refused_before_the_run_directory(tmp_path, cli) -> None:
    pytest.importorskip("trl")
    output = tmp_path / "run"
    code, _, err = cli("run", "blackjack", "--backend", "trl", *FAST[:-7],
                       "--set", "algorithm.episodes_per_update=6",
                       "--set", "algorithm.minibatch_size=4", "--quiet", "--output", output)
    assert code == 2, err
    assert "multiple of algorithm.minibatch_size x processes = 4" in one_error_line(err)
    assert not output.exists()


def test_a_model_that_does_not_load_leaves_no_run_directory(tmp_path, cli) -> None:
    from llamagym.models.tiny import build_tiny_model

    output = tmp_path / "run"
    broken = Path(shutil.copytree(build_tiny_model(), tmp_path / "broken-model"))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"truncated")
    code, _, err = cli("run", "blackjack", *FAST, "--model", broken, "--output", output,
                       "--set", "algorithm.name=ppo")
    assert code == 2, err
    one_error_line(err)
    assert not output.exists()


@pytest.mark.parametrize(
    "setting", ["--eval-episodes=1000000000", "algorithm.episodes_per_update=1000000000"]
)
def test_episode_counts_beyond_the_machines_memory_are_refused(setting, tmp_path, cli):
    output = tmp_path / "run"
    flag = [setting] if setting.startswith("--") else ["--set", setting]
    code, _, err = cli("run", "blackjack", *FAST, *flag, "--output", output)
    assert code == 2, err
    line = one_error_line(err)
    assert "1,000,000,000" in line and "GiB" in line and "this machine" in line
    assert not output.exists()


def test_the_python_call_gets_a_config_error_for_them() -> None:
    with pytest.raises(ConfigError, match=r"training.eval_episodes = 1,000,000,000 .* GiB"):
        tiny_agent(BanditAgent, training={"eval_episodes": 10**9})


@pytest.mark.parametrize("command", ["eval", "play", "record"])
def test_episodes_to_play_beyond_the_machines_memory_are_refused_before_loading(
    command, tmp_path, cli
) -> None:
    target = tmp_path / "no-run-yet"  # refused before anything is read or loaded
    words = {
        "eval": ["eval", "blackjack", "--checkpoint", target],
        "play": ["play", target],
        "record": ["record", "blackjack", "-b", "basic-strategy", "-o", target],
    }[command]
    code, _, err = cli(*words, "-n", str(10**9))
    assert code == 2, err
    line = one_error_line(err)
    assert "--episodes = 1,000,000,000" in line and "GiB" in line and "this machine" in line
    assert not target.exists()


def test_logits_a_generation_would_keep_beyond_the_machines_memory_are_refused(
    tmp_path, cli, monkeypatch
) -> None:
    monkeypatch.setattr("llamagym.config.machine_memory", lambda: 16 << 30)
    output = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, "--num-envs", "4096", "--output", output,
                       "--set", "rollout.mode=generate", "--set", "rollout.max_new_tokens=4096")
    assert code == 2, err
    line = one_error_line(err)
    # 4,096 rows x 4,096 steps x the tiny model's 1,024 logits x 4 bytes = 64 GiB
    assert "rollout.num_envs = 4,096 x rollout.max_new_tokens = 4,096" in line
    assert "vocabulary of 1,024 tokens" in line and "64.0 GiB" in line and "16.0 GiB" in line
    assert not output.exists()
    agent = tiny_agent(BanditAgent, rollout={"num_envs": 4096, "mode": "generate",
                                             "max_new_tokens": 4096})
    with pytest.raises(ConfigError, match="64.0 GiB of logits"):
        agent.policy  # noqa: B018 (loading the model checks it)
    # Within the machine's memory it loads.
    assert tiny_agent(BanditAgent, rollout={"num_envs": 4, "mode": "generate",
                                            "max_new_tokens": 4096}).policy is not None


# -- 4. hostile envs --------------------------------------------------------------------
class HostileBandit(TwoArmedBandit):
    """The bandit, made hostile in one way (``how``)."""

    how = "fine"

    def step(self, action):
        observation, reward, terminated, truncated, info = super().step(action)
        if self.how == "raises":
            raise RuntimeError("physics exploded")
        if self.how == "old-api":
            return observation, reward, terminated or truncated, info
        if self.how == "nan":
            return observation, float("nan"), terminated, truncated, info
        if self.how == "inf":
            return observation, float("inf"), terminated, truncated, info
        if self.how == "never-ends":
            return observation, reward, False, False, info
        return observation, reward, terminated, truncated, info


class HostileAgent(BanditAgent):
    name = "hostile"
    observation_chars = 0

    def format_observation(self, observation) -> str:
        return "Which lever? " + "x" * self.observation_chars

    def make_env(self):
        return HostileBandit()


@pytest.fixture
def hostile(monkeypatch):
    def make(how: str, **overrides):
        monkeypatch.setattr(HostileBandit, "how", how)
        return tiny_agent(HostileAgent, **overrides)

    return make


class BanditRegistration:
    @hookimpl
    def llamagym_register_agents(self, register):
        register("bandit", "llamagym.testing:BanditAgent", description="two levers")


def test_a_warning_that_quotes_an_env_cannot_drive_the_terminal(tmp_path, cli,
                                                                 monkeypatch) -> None:
    import logging

    from llamagym.display import PrintableFormatter

    clipboard = "\x1b]52;c;cm0gLXJmIH4=\x07"  # OSC 52: write the clipboard
    bandit_step = TwoArmedBandit.step

    def step(self, action):
        observation, *rest = bandit_step(self, action)
        # An env plugin that warns about what its env showed, quoting it.
        logging.getLogger("hostile_env").warning("odd observation %s\x1b[2J", clipboard)
        return observation, *rest

    monkeypatch.setattr(TwoArmedBandit, "step", step)
    with temporary_plugin(BanditRegistration(), "bandit-plugin"):
        code, _, err = cli("run", "bandit", *FAST, "--output", tmp_path / "run")
    assert code == 0, err
    assert "odd observation \\x1b]52;c;cm0gLXJmIH4=\\x07\\x1b[2J" in err  # shown, escaped
    assert "\x1b" not in err and "\x07" not in err
    # The plain handler of the commands without a progress bar formats the same way.
    record = logging.LogRecord("hostile_env", logging.WARNING, "", 0, "odd %s", (clipboard,), None)
    line = PrintableFormatter("%(levelname)s %(name)s: %(message)s").format(record)
    assert line == "WARNING hostile_env: odd \\x1b]52;c;cm0gLXJmIH4=\\x07"


@pytest.mark.parametrize("how", ["raises", "old-api", "nan", "inf"])
def test_every_failing_step_counts_toward_max_env_failures(how, hostile, tmp_path) -> None:
    from llamagym.training.loop.trainer import Trainer

    agent = hostile(
        how,
        rollout={"num_envs": 2},
        algorithm={"episodes_per_update": 4, "minibatch_size": 4},
        training={"episodes": 64, "max_env_failures": 5},
        output={"dir": str(tmp_path / "run"), "quiet": True},
    )
    started = time.monotonic()
    with pytest.raises(EnvFailureError) as raised:
        Trainer(agent, agent.session).run()
    assert time.monotonic() - started < 60
    message = str(raised.value)
    assert "6 times in a row" in message and "training.max_env_failures = 5" in message
    assert "\n" not in message
    expected = {
        "raises": "physics exploded",
        "old-api": "old gym API",
        "nan": "non-finite reward (nan)",
        "inf": "non-finite reward (inf)",
    }[how]
    assert expected in message
    metrics = tmp_path / "run" / "metrics.jsonl"
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        assert math.isfinite(json.loads(line).get("return_mean", 0.0))


def test_an_env_that_never_ends_is_cut_at_the_turn_cap(hostile) -> None:
    agent = hostile("never-ends", rollout={"num_envs": 2, "max_episode_turns": 7})
    episodes = agent.engine.collect([agent.make_env() for _ in range(2)], 3)
    assert [e.length for e in episodes] == [7, 7, 7]
    assert all(e.info["turn_cap"] == 7 and e.info["terminated"] is False for e in episodes)
    # An env registered with its own max_episode_steps keeps that limit.
    from llamagym.rollout.env_checks import max_turns

    gymnasium.register("HostileLimited-v0", entry_point=HostileBandit, max_episode_steps=3)
    try:
        assert max_turns(gymnasium.make("HostileLimited-v0"), 7) == 3
    finally:
        gymnasium.registry.pop("HostileLimited-v0")


def test_the_evaluation_honours_its_time_budget(hostile, caplog) -> None:
    from llamagym.training.loop.final_evaluation import evaluate_with_baselines

    agent = hostile("never-ends", rollout={"num_envs": 2, "max_episode_turns": 1_000_000})
    started = time.monotonic()
    result, baselines = evaluate_with_baselines(agent.evaluation_engine(), 100, 0, seconds=2.0)
    assert time.monotonic() - started < 30  # the baselines play only what the agent did
    assert result.episodes == 0 and all(b.episodes == 0 for b in baselines)
    assert any("ran out after 0 of 100 episodes" in r.getMessage() for r in caplog.records)


def test_a_huge_observation_is_cut_with_one_warning(hostile, monkeypatch, caplog) -> None:
    monkeypatch.setattr(HostileAgent, "observation_chars", 10_000_000)
    agent = hostile("fine", rollout={"num_envs": 2, "max_prompt_chars": 2_000})
    episodes = agent.engine.collect([agent.make_env() for _ in range(2)], 4)
    assert len(episodes) == 4
    assert all(len(e.turns[0].user_text) == 2_000 for e in episodes)
    warned = [r.getMessage() for r in caplog.records if "max_prompt_chars" in r.getMessage()]
    assert len(warned) == 1 and "'hostile'" in warned[0] and "10,000,013 characters" in warned[0]


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_a_tiny_temperature_samples_like_argmax(mode, hostile) -> None:
    agent = hostile("fine", rollout={"num_envs": 2, "mode": mode, "temperature": 1e-320,
                                     "max_new_tokens": 4})
    episodes = agent.engine.collect([agent.make_env() for _ in range(2)], 4)
    assert len(episodes) == 4
    assert all(math.isfinite(lp) for e in episodes for t in e.turns for lp in t.logprobs)


# -- 5. chat templates ------------------------------------------------------------------
@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    from llamagym.models.tiny import build_tiny_model

    return AutoTokenizer.from_pretrained(build_tiny_model())


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'x' * 100000000 }}",
        "{% set n = 10**10 %}{{ 'x' * n }}",
        "{{ 10**(10**10) }}",
        "{{ 'x' * 10**9 }}",
        "{% set n = 10**9 %}{{ ([1] * n)|length }}",
        "{{ '%1000000000s' % 'x' }}",
        "{{ '%*s' % (10**9, 'x') }}",
        "{{ '%1000000000s'|format('x') }}",
        "{{ '{:>1000000000}'.format(1) }}",
        "{{ '{:>{}}'.format(1, 10**9) }}",
        "{{ 'x'|center(10**9) }}",
        "{{ 'x'|center(1000000000) }}",
        "{{ 'x'.ljust(10**9) }}",
        "{{ 'x'|indent(10**9) }}",
        "{{ lipsum(10**9) }}",
        "{{ lipsum(200000)|length }}",
        "{% set s = 'x' * 200000 %}{{ s.replace('x', s)|length }}",
        "{% set s = 'x' * 100000 %}{{ [s, s, s]|join(s)|length }}",
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    ],
    ids=["nested-loops", "silent-nested-loops", "huge-string", "times-a-variable",
         "power", "times-a-power", "list-times", "percent-width", "percent-star",
         "format-filter", "format-width", "format-nested-width", "center-filter",
         "center-folded", "ljust", "indent", "lipsum", "lipsum-paragraphs", "replace", "join",
         "concat-doubling"],
)
def test_a_runaway_chat_template_is_refused_at_its_limit(template, tokenizer) -> None:
    tokenizer.chat_template = template
    started = time.monotonic()
    with pytest.raises(ChatTemplateError) as raised:
        render_chat(tokenizer, [[{"role": "user", "content": "hi"}]])
    assert time.monotonic() - started < 10  # 1 s of CPU; unbounded, hours
    message = str(raised.value)
    assert "the chat template of model" in message and "refused" in message
    assert "\n" not in message


def test_a_pause_of_the_machine_or_the_garbage_collector_is_not_the_templates(
    tokenizer,
) -> None:
    """The time limit counts the template's own CPU time: a collection of the whole
    program's objects (made slow here, 1.2 s of CPU) or the thread waiting (1.2 s) while
    a conversation renders does not make a real template's render fail."""
    paused = []

    def in_template() -> bool:
        frame = sys._getframe()
        while frame is not None and frame.f_code.co_filename != "<template>":
            frame = frame.f_back
        return frame is not None

    def slow_collection(phase: str, info: dict) -> None:
        if phase == "stop" and not paused and in_template():
            paused.append(phase)
            started = time.thread_time()
            while time.thread_time() - started < 1.2:
                pass
            time.sleep(1.2)

    thresholds = gc.get_threshold()
    gc.callbacks.append(slow_collection)
    gc.set_threshold(1)  # a collection at each allocation, the template's among them
    try:
        [text] = render_chat(tokenizer, [[{"role": "user", "content": "hi"}]])
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(slow_collection)
    assert paused and "hi" in text


@pytest.mark.parametrize(
    "template, problem",
    [
        ("{{ raise_exception('no system role') }}", "TemplateError: 'no system role'"),
        ("{% for %}", "TemplateSyntaxError"),
        ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ],
)
def test_a_chat_template_error_is_one_line(template, problem, tmp_path, cli) -> None:
    from llamagym.models.tiny import build_tiny_model

    model = Path(shutil.copytree(build_tiny_model(), tmp_path / "model"))
    settings = json.loads((model / "tokenizer_config.json").read_text())
    settings["chat_template"] = template
    (model / "tokenizer_config.json").write_text(json.dumps(settings))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    code, _, err = cli("run", "blackjack", *FAST, "--model", model, "-o", tmp_path / "run",
                       "--set", "algorithm.name=ppo")
    assert code == 2, err
    line = one_error_line(err)
    assert f"the chat template of model {str(model)!r} failed" in line and problem in line


# SmolLM2's own chat template (its chat_template.jinja), as text.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_real_templates_render_the_same_text_in_the_bounded_sandbox(tokenizer) -> None:
    from llamagym.models.tiny import CHAT_TEMPLATE

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "1 or 2?"}]
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    assert render_chat(tokenizer, [chat, chat[1:2]]) == [
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n1 or 2?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    ]
    tokenizer.chat_template = CHAT_TEMPLATE
    assert render_chat(tokenizer, [chat, chat[1:2]]) == [
        "<|system|>\nBe brief.<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\nHello.<|end|>\n"
        "<|user|>\n1 or 2?<|end|>\n<|assistant|>\n",
        "<|user|>\nhi<|end|>\n<|assistant|>\n",
    ]
    # What a template does with numbers, formats and filters within the limits is kept.
    tokenizer.chat_template = (
        "{{ '%s-%d' % ('a', 1700000000) }} {{ '{}:{:>4}'.format('b', 7) }} {{ 2 ** 10 }} "
        "{{ ['x', 'y']|join(', ') }} {{ 'ab'.replace('a', 'c') }} {{ '-' * 3 ~ 'z' }} "
        "{{ 'hi\nthere'|indent(2) }}"
    )
    assert render_chat(tokenizer, [chat]) == [
        "a-1700000000 b:   7 1024 x, y cb ---z hi\n  there"
    ]


def test_a_real_template_renders_as_before(tokenizer) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, [conversation]) == [
        tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    ]

