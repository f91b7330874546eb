"""Run configuration: layer precedence, `llamagym config show`, and the error for each
kind of bad value (one line naming the key, exit code 2, before anything loads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from llamagym_blackjack.agent import BlackjackAgent

from llamagym.cli.run_commands import resolve_run_config
from llamagym.config import RunConfig
from llamagym.errors import ConfigError
from llamagym.resolver.layers import render_config_yaml


def problem_lines(stderr: str) -> list[str]:
    """stderr without plugin warnings (a broken plugin elsewhere must not fail these)."""
    return [line for line in stderr.splitlines() if line and not line.startswith("warning:")]


def test_each_layer_overrides_the_one_below(tmp_path) -> None:
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        "rollout: {num_envs: 32, temperature: 0.7}\n"
        "algorithm: {lr: 5.0e-4, epochs: 3}\n"
        "training: {seed: 7}\n"
    )
    _, resolved = resolve_run_config(
        "blackjack",
        config_file,
        ["rollout.num_envs=16", "algorithm.lr=2e-4"],
        {"rollout.num_envs": 8, "training.episodes": None},
    )
    config = resolved.config
    assert config.rollout.num_envs == 8  # flag > --set > file > agent default (64)
    assert config.algorithm.lr == 2e-4  # --set > file > agent default (1e-3)
    assert config.algorithm.epochs == 3  # file > agent default (4)
    assert config.rollout.temperature == 0.7  # file > built-in default (1.0)
    assert config.training.seed == 7
    agent_default = BlackjackAgent.defaults["training"]["episodes"]
    assert config.training.episodes == agent_default  # agent default > built-in (None)
    assert config.rollout.top_k == RunConfig().rollout.top_k
    # The algorithm section is complete: its plugin's defaults are filled in.
    assert config.algorithm.clip_range == 0.2
    assert resolved.sources["rollout.num_envs"] == "flag"
    assert resolved.sources["algorithm.lr"] == "--set"
    assert resolved.sources["algorithm.epochs"] == f"file {config_file}"
    assert resolved.sources["training.episodes"] == "agent defaults"
    assert "rollout.top_p" not in resolved.sources


@pytest.mark.parametrize("suffix", ["toml", "json"])
def test_toml_and_json_files(tmp_path, suffix) -> None:
    path = tmp_path / f"run.{suffix}"
    path.write_text(
        "[rollout]\nnum_envs = 12\n" if suffix == "toml" else '{"rollout": {"num_envs": 12}}'
    )
    _, resolved = resolve_run_config("blackjack", path, [], {})
    assert resolved.config.rollout.num_envs == 12


BAD_CONFIGS = [
    # (arguments, key named in the message, a word of what is allowed)
    (["--set", "rollout.num_envs=0"], "rollout.num_envs", "greater than or equal to 1"),
    (["--num-envs", "0"], "rollout.num_envs", "greater than or equal to 1"),
    (["--set", "rollout.num_env=4"], "rollout.num_env", "did you mean 'num_envs'"),
    (["--set", "rollout.mode=fast"], "rollout.mode", "'generate' or 'score'"),
    (["--set", "training.episodes=lots"], "training.episodes", "valid integer"),
    (["--set", "trainig.seed=1"], "trainig", "did you mean 'training'"),
    (["--set", "rollout.top_p=1.5"], "rollout.top_p", "less than or equal to 1"),
    (["--set", "model.dtype=float8"], "model.dtype", "'float32'"),
    (["--set", "output.keep_checkpoints=0"], "output.keep_checkpoints", "greater than"),
    (["--set", "algorithm.lr=-1"], "algorithm.lr", "greater than 0"),
    (["--set", "algorithm.lrr=0.1"], "algorithm.lrr", "did you mean 'lr'"),
    (["--set", "algorithm.credit=sideways"], "algorithm.credit", "gae"),
    (["--algorithm", "nope"], "algorithm.name", "ppo"),
    (["--set", "agent.colour=red"], "agent.colour", "takes no options"),
]


@pytest.mark.parametrize(("arguments", "key", "allowed"), BAD_CONFIGS)
def test_bad_value_is_one_line_naming_the_key(arguments, key, allowed, tmp_path, cli) -> None:
    output = tmp_path / "run"
    code, out, err = cli("run", "blackjack", "-o", output, *arguments)
    assert code == 2
    lines = problem_lines(err)
    assert len(lines) == 1, err
    assert lines[0].startswith(f"error: {key}:"), lines[0]
    assert allowed in lines[0]
    assert not output.exists()  # rejected before anything was created or loaded


def test_bad_file_reports_every_problem_one_line_each(tmp_path, cli) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "rollout:\n  num_envs: -3\n  temprature: 0.5\nalgorithm:\n  epochs: many\ncolour: blue\n"
    )
    code, _, err = cli("run", "blackjack", "--config", path)
    assert code == 2
    lines = problem_lines(err)
    assert len(lines) == 4, err
    text = "\n".join(lines)
    for key, value in [
        ("rollout.num_envs", "-3"),
        ("rollout.temprature", "0.5"),
        ("algorithm.epochs", "'many'"),
        ("colour", "'blue'"),
    ]:
        assert f"{key}: " in text and value in text


def test_unreadable_config_file(tmp_path, cli) -> None:
    missing = tmp_path / "missing.yaml"
    code, _, err = cli("run", "blackjack", "--config", missing)
    assert code == 2 and "does not exist" in err
    broken = tmp_path / "broken.toml"
    broken.write_text("[rollout\nnum_envs = ")
    code, _, err = cli("run", "blackjack", "--config", broken)
    assert code == 2 and "is not valid" in err


def test_config_show_prints_commented_yaml_that_reads_back(tmp_path, cli) -> None:
    code, out, _ = cli("config", "show", "blackjack", "--set", "algorithm.lr=3e-4")
    assert code == 0
    assert "# Adam learning rate." in out  # the algorithm plugin's own field descriptions
    assert "# Environments stepped in lockstep." in out
    assert "lr: 0.0003  # from --set" in out
    assert "num_envs: 64  # from agent defaults" in out
    shown = yaml.safe_load(out)
    assert shown["algorithm"]["lr"] == 3e-4 and shown["algorithm"]["clip_range"] == 0.2

    saved = tmp_path / "shown.yaml"
    saved.write_text(out)
    _, resolved = resolve_run_config("blackjack", saved, [], {})
    assert resolved.config.model_dump() == RunConfig.model_validate(shown).model_dump()

    code, _, err = cli("config", "show", "blackjack", "-a", "nope")
    assert code == 2 and "algorithm.name" in err


def test_rendered_yaml_round_trips_every_value() -> None:
    config = RunConfig.model_validate(
        {"rollout": {"invalid_action": {"fallback_action": "yes"}}, "output": {"dir": "x y"}}
    )
    text = render_config_yaml(config)
    assert RunConfig.model_validate(yaml.safe_load(text)) == config


def test_agent_with_its_own_options_validates_them() -> None:
    from pydantic import BaseModel, Field

    from llamagym.resolver.layers import resolve_config
    from llamagym.testing import BanditAgent

    class Options(BaseModel):
        model_config = {"extra": "forbid"}
        levers: int = Field(2, ge=2, description="How many levers.")

    class OptionsAgent(BanditAgent):
        Config = Options

    resolved = resolve_config(
        [("test", {"agent": {"name": "bandit", "levers": 3}})], agent_class=OptionsAgent
    )
    assert resolved.config.agent.levers == 3
    assert "# How many levers." in resolved.to_yaml()
    with pytest.raises(ConfigError, match=r"^agent\.levers: got 1; must be greater"):
        resolve_config([("test", {"agent": {"levers": 1}})], agent_class=OptionsAgent)


def test_written_config_is_path_independent(tmp_path: Path) -> None:
    """A config file's output.dir is a plain string in YAML, not a Python object tag."""
    config = RunConfig.model_validate({"output": {"dir": tmp_path}})
    assert "!!python" not in render_config_yaml(config)


def test_agent_algorithm_defaults_apply_only_to_their_algorithm() -> None:
    from llamagym.config import defaults_for_algorithm

    defaults = {"rollout": {"num_envs": 8}, "algorithm": {"name": "ppo", "value_coef": 0.01}}
    assert defaults_for_algorithm(defaults, [{}]) == defaults
    assert defaults_for_algorithm(defaults, [{"algorithm": {"name": "ppo"}}]) == defaults
    other = defaults_for_algorithm(defaults, [{"algorithm": {"name": "grpo"}}, {"training": {}}])
    assert other == {"rollout": {"num_envs": 8}}


def test_a_pretrained_model_gets_the_pretrained_defaults_above_the_agents() -> None:
    """The agents' defaults are tuned for `tiny` (random weights, trained whole); any
    other model trains through LoRA and gets gentler settings, which a file, --set or a
    flag still override."""
    from llamagym.config import PRETRAINED_MODEL_DEFAULTS

    _, tiny = resolve_run_config("blackjack", None, [], {})
    assert tiny.config.algorithm.lr == 1e-3 and tiny.sources["algorithm.lr"] == "agent defaults"
    _, real = resolve_run_config("blackjack", None, [], {"model.name": "smollm2-135m"})
    expected = PRETRAINED_MODEL_DEFAULTS["algorithm"]
    assert real.config.algorithm.episodes_per_update == expected["episodes_per_update"]
    assert real.sources["algorithm.episodes_per_update"] == "pretrained-model defaults"
    assert tiny.config.algorithm.microbatch_size is None
    # The model's registry entry chooses how many layers LoRA adapts (none for tiny).
    assert real.config.model.lora_layers == 4 and tiny.config.model.lora_layers is None
    assert real.sources["model.lora_layers"] == "pretrained-model defaults"
    assert real.config.rollout.mode == "score"  # the agent's own choices stay
    # ...and its own pretrained defaults for the mode win over the generic ones.
    own = BlackjackAgent.pretrained_defaults["score"]["algorithm"]
    assert real.config.algorithm.lr == own["lr"] != expected["lr"]
    assert real.config.algorithm.microbatch_size == own["microbatch_size"]
    assert own["microbatch_size"] != expected["microbatch_size"]
    assert real.config.algorithm.name == own["name"]
    assert real.config.algorithm.target_kl == own["target_kl"] != expected["target_kl"]
    assert real.sources["algorithm.target_kl"] == "pretrained-model defaults"
    _, generate = resolve_run_config(
        "blackjack", None, [], {"model.name": "smollm2-135m", "rollout.mode": "generate"}
    )
    # Blackjack's generate mode keeps LoRA on every layer, over the registry's choice.
    assert generate.config.model.lora_layers is None
    generated = BlackjackAgent.pretrained_defaults.get("generate", {}).get("algorithm", {})
    assert generate.config.algorithm.target_kl == generated.get(
        "target_kl", expected["target_kl"]
    )
    # A mode's own sections other than the algorithm's hold for that mode alone.
    sampling = BlackjackAgent.pretrained_defaults["generate"]["rollout"]["top_k"]
    assert generate.config.rollout.top_k == sampling != real.config.rollout.top_k
    assert generate.config.model.gradient_checkpointing is False
    assert real.config.model.gradient_checkpointing is None
    # An agent's one-thread default (CartPole's, for tiny) gives way to the model-size
    # rule, which leaves a pretrained model torch's thread count.
    _, tiny_pole = resolve_run_config("cartpole", None, [], {})
    _, real_pole = resolve_run_config("cartpole", None, [], {"model.name": "smollm2-135m"})
    assert tiny_pole.config.training.threads == 1
    assert real_pole.config.training.threads is None
    assert real_pole.sources["training.threads"] == "pretrained-model defaults"
    _, chosen = resolve_run_config(
        "blackjack", None, ["algorithm.lr=0.0005", "model.name=some/model"], {}
    )
    assert chosen.config.algorithm.lr == 5e-4 and chosen.sources["algorithm.lr"] == "--set"
    assert chosen.config.algorithm.epochs == expected["epochs"]


def test_pretrained_defaults_that_choose_an_algorithm_hold_only_for_it() -> None:
    """An agent's pretrained defaults may pick an algorithm for a pretrained model; then
    its tiny-tuned settings for another algorithm give way, and a user who picks yet
    another algorithm gets the generic pretrained defaults without the chosen one's keys."""
    from llamagym.config import PRETRAINED_MODEL_DEFAULTS
    from llamagym.resolver.layers import resolve_agent_config

    class Chooser(BlackjackAgent):
        pretrained_defaults = {
            "score": {"algorithm": {"name": "grpo", "group_size": 4, "kl_coef": 0.3}}
        }

    model = ("--set", {"model": {"name": "smollm2-135m"}})
    chosen = resolve_agent_config(Chooser, [model])
    algorithm = chosen.config.algorithm
    assert algorithm.name == "grpo" and algorithm.group_size == 4 and algorithm.kl_coef == 0.3
    assert algorithm.lr == PRETRAINED_MODEL_DEFAULTS["algorithm"]["lr"]
    # Blackjack's PPO settings for the tiny model (entropy 0.01, 512 episodes) are gone.
    assert algorithm.entropy_coef == 0.0 and algorithm.episodes_per_update == 64
    own = resolve_agent_config(Chooser, [model, ("--set", {"algorithm": {"name": "ppo"}})])
    assert own.config.algorithm.name == "ppo"
    assert not hasattr(own.config.algorithm, "group_size")
    assert own.config.algorithm.lr == PRETRAINED_MODEL_DEFAULTS["algorithm"]["lr"]
    assert own.config.algorithm.kl_coef == 0.0
    tiny = resolve_agent_config(Chooser, [])
    assert tiny.config.algorithm.name == "ppo" and tiny.config.algorithm.lr == 1e-3
