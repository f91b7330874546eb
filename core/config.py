"""Every setting of a run, in one pydantic model.

Precedence, lowest first: these defaults < the agent's ``defaults`` < a YAML/TOML file
< ``--set key=value`` and typed CLI flags. The ``agent`` and ``algorithm`` sections
accept extra keys that belong to their plugins; the algorithm's own config class
validates its keys before anything loads.
"""

from __future__ import annotations

import copy
import json
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llamagym.errors import ConfigError


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class AgentSection(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field("", description="Registered agent name (see `llamagym list`).")


class AlgorithmSection(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field("ppo", description="Registered algorithm name (see `llamagym list`).")


class ModelSettings(Settings):
    name: str = Field("tiny", description="'tiny' (offline default), a Hub id or a local dir.")
    device: str = Field("auto", description="auto (cuda, then mps, then cpu), cpu, cuda, mps.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; auto is fp32 on CPU/MPS, bf16/fp16 on CUDA."
    )
    quantize: Literal["4bit", "8bit"] | None = Field(
        None, description="Load weights in 4 or 8 bits through bitsandbytes (QLoRA)."
    )
    lora: bool | None = Field(None, description="LoRA adapter; null = auto (models > 50M).")
    lora_rank: int | None = Field(None, ge=1, description="LoRA rank; null = registry default.")
    trust_remote_code: bool = Field(False, description="Run model code from the Hub repo.")


class InvalidActionSettings(Settings):
    policy: Literal["fallback", "reprompt", "random", "end_episode"] = Field(
        "fallback", description="What to do when no parser finds a legal action."
    )
    penalty: float = Field(-1.0, description="Reward added to a turn with an invalid reply.")
    fallback_action: str | None = Field(
        None, description="Action used by the fallback policy; null = the first legal one."
    )
    max_reprompts: int = Field(2, ge=1, le=10, description="Re-prompts before falling back.")


class RolloutSettings(Settings):
    mode: Literal["generate", "score"] = Field(
        "generate",
        description="generate: sample text and parse it; score: rank legal actions by "
        "their log-likelihood (always legal).",
    )
    num_envs: int = Field(16, ge=1, le=4096, description="Environments stepped in lockstep.")
    history_turns: int | None = Field(
        0, ge=0, description="Earlier turns kept in the prompt; null = the whole episode."
    )
    max_new_tokens: int = Field(24, ge=1, le=4096, description="Reply length in generate mode.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling in generate mode.")
    top_k: int = Field(0, ge=0, description="Top-k sampling in generate mode; 0 = off.")
    reward_shaping: bool = Field(False, description="Add llamagym_shape_reward hook terms.")
    invalid_action: InvalidActionSettings = Field(default_factory=InvalidActionSettings)


class TrainingSettings(Settings):
    episodes: int | None = Field(None, ge=1, description="Stop after this many episodes.")
    minutes: float | None = Field(None, gt=0, description="Stop after this wall-clock budget.")
    seed: int = Field(0, description="Seeds python, numpy, torch and the environments.")
    eval_episodes: int = Field(1000, ge=0, description="Greedy evaluation episodes at the end.")
    threads: int | None = Field(None, ge=1, description="torch threads; null = torch's default.")


class OutputSettings(Settings):
    dir: Path | None = Field(None, description="Run directory; null = runs/<agent>-<time>.")
    quiet: bool = Field(False, description="No progress bar (CI, logs).")


class RunConfig(Settings):
    agent: AgentSection = Field(default_factory=AgentSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    model: ModelSettings = Field(default_factory=ModelSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    output: OutputSettings = Field(default_factory=OutputSettings)


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``override`` laid over it, section by section."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def parse_assignment(assignment: str) -> dict[str, Any]:
    """``"algorithm.lr=1e-4"`` -> ``{"algorithm": {"lr": 0.0001}}`` (values parsed as YAML)."""
    key, sep, raw = assignment.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. algorithm.lr=1e-4")
    value = yaml.safe_load(raw) if raw.strip() else None
    result: dict[str, Any] = {}
    node = result
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return result


def read_config_file(path: Path) -> dict[str, Any]:
    """Read a YAML, JSON or TOML config file into a dict, with a clear error if it is bad."""
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text) or {}
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as error:
        first_line = str(error).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid: {first_line}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of sections")
    return data


def format_validation_error(error: ValidationError, prefix: str = "") -> str:
    """One line per problem: the key, the value given and what is allowed."""
    lines = []
    for problem in error.errors():
        key = prefix + ".".join(str(part) for part in problem["loc"])
        message = problem["msg"]
        if problem["type"] == "extra_forbidden":
            message = "unknown key"
        value = problem.get("input")
        given = "" if problem["type"] == "missing" else f" (got {value!r})"
        lines.append(f"{key}: {message}{given}")
    return "\n".join(lines)


def build_config(*layers: dict[str, Any]) -> RunConfig:
    """Merge layers (lowest precedence first) and validate them into a RunConfig."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = deep_merge(merged, layer)
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as error:
        raise ConfigError(format_validation_error(error)) from None


def algorithm_options(config: RunConfig) -> dict[str, Any]:
    """The algorithm section's plugin-owned keys (everything but ``name``)."""
    return {k: v for k, v in config.algorithm.model_dump().items() if k != "name"}


def agent_options(config: RunConfig) -> dict[str, Any]:
    """The agent section's plugin-owned keys (everything but ``name``)."""
    return {k: v for k, v in config.agent.model_dump().items() if k != "name"}
