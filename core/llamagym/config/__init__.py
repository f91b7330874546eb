"""Every setting of a run, in one pydantic model, and the defaults layered under it.

Precedence, lowest first: these defaults < the agent's ``defaults`` < a YAML/TOML/JSON
file < ``--set key=value`` < typed CLI flags. The ``agent`` and ``algorithm`` sections
accept extra keys that belong to their plugins: the algorithm's ``Config`` class (and
the agent's, when it declares one) validates them in
:func:`llamagym.resolver.layers.resolve_config`, before any model or environment loads.

Every float is finite, and a seed is one numpy takes (0 to 2**32 - 1). Config files and
``--set`` lines are read, within bounds, by :mod:`llamagym.config.files`.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from llamagym import moved_name as _moved_name
from llamagym.errors import ConfigError

#: Seeds are what numpy's seeding takes: 0 to 2**32 - 1.
MAX_SEED = 2**32 - 1


_SEED_RANGE = f"a seed must be from 0 to {MAX_SEED} (2**32 - 1, the seeds numpy takes)"


#: The least memory one finished episode holds until its batch or evaluation is done
#: (its record, one turn and that turn's prompt tokens; a Blackjack episode holds ~2 KB).
MIN_EPISODE_BYTES = 1024


def machine_memory() -> int:
    """This machine's physical memory in bytes (16 GiB where the system does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return 16 << 30


def check_episode_memory(episodes: int, what: str) -> None:
    """A ``ConfigError`` when ``episodes`` episodes held at once (``what``: the setting)
    would take more than this machine's memory, before any is allocated."""
    needed, memory = episodes * MIN_EPISODE_BYTES, machine_memory()
    if needed > memory:
        raise ConfigError(
            f"{what} = {episodes:,} would hold at least {needed / 2**30:,.1f} GiB of "
            f"episodes in memory at once ({MIN_EPISODE_BYTES:,} bytes each at the least), "
            f"more than this machine's {memory / 2**30:,.1f} GiB; use at most "
            f"{memory // MIN_EPISODE_BYTES // 10:,} (a tenth of that bound)"
        )


#: The largest LoRA rank a config may ask for: beyond a model's own width a rank adds
#: weights but nothing the adapter can learn, and a rank of a billion asks for terabytes.
MAX_LORA_RANK = 1024

#: The most torch CPU threads a config may ask for (each thread's pool takes memory).
MAX_THREADS = 1024
#: Bounds of the env plugins' own options: the most characters of an env's text an
#: agent's ``max_observation_chars`` may keep (each turn's prompt is built from it), and
#: the most steps its ``max_episode_steps`` may allow an episode.
MAX_OBSERVATION_CHARS = 100_000
MAX_EPISODE_STEPS = 10_000
#: The longest wait a LLAMAGYM_*_TIMEOUT variable may ask for (a week): far past any real
#: wait, and well inside what a ``timedelta``, a thread's wait and the process group's
#: own timeout can hold.
MAX_WAIT_SECONDS = 7 * 24 * 3600

#: Bytes of one logit as generate keeps it (a 32-bit float at the most).
LOGIT_BYTES = 4


def check_generation_memory(rows: int, max_new_tokens: int, vocabulary: int) -> None:
    """A ``ConfigError`` when one batched generation would keep more logits than this
    machine's memory: every step's, for every row (``rows`` x ``max_new_tokens`` x
    ``vocabulary``, :data:`LOGIT_BYTES` each), before any is allocated."""
    needed, memory = rows * max_new_tokens * vocabulary * LOGIT_BYTES, machine_memory()
    if needed > memory:
        fits = memory // (rows * vocabulary * LOGIT_BYTES) // 10
        raise ConfigError(
            f"rollout.num_envs = {rows:,} x rollout.max_new_tokens = {max_new_tokens:,} x "
            f"the model's vocabulary of {vocabulary:,} tokens would keep "
            f"{needed / 2**30:,.1f} GiB of logits in one generation ({LOGIT_BYTES} bytes "
            f"each), more than this machine's {memory / 2**30:,.1f} GiB; lower "
            f"rollout.num_envs, or rollout.max_new_tokens to at most {max(fits, 1):,} "
            "(a tenth of that bound)"
        )


def check_seed(seed: int, where: str = "the seed") -> int:
    """``seed`` if numpy can take it, else a ``ConfigError`` naming ``where`` it came from."""
    if not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"{where}: got {seed}; {_SEED_RANGE}")
    return seed


class Settings(BaseModel):
    # inf and nan are refused in every float field: no setting means them.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


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
    lora_rank: int | None = Field(
        None, ge=1, le=MAX_LORA_RANK, description="LoRA rank; null = registry default."
    )
    lora_layers: int | None = Field(
        None,
        ge=1,
        description="Adapt only the last N decoder layers: the frozen layers below run "
        "once per prompt, not in every update pass (a faster update); null = every "
        "layer. A model's registry entry may choose N (pretrained-model defaults).",
    )
    trunk_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Dtype of the frozen layers below model.lora_layers (the trained ones "
        "stay as loaded); auto = bfloat16 where the CPU or GPU computes it natively.",
    )
    trust_remote_code: bool = Field(False, description="Run model code from the Hub repo.")
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute each decoder layer in backward instead of storing its "
        "activations (less memory, about a third more update time); null = on for LoRA "
        "models in generate mode.",
    )


class InvalidActionSettings(Settings):
    policy: Literal["fallback", "reprompt", "random", "end_episode"] = Field(
        "fallback", description="What to do when no parser finds a legal action."
    )
    penalty: float = Field(-1.0, description="Reward added to a turn with an invalid reply.")
    fallback_action: str | None = Field(
        None, description="Action used by the fallback policy; null = the first legal one."
    )
    max_reprompts: int = Field(2, ge=1, le=10, description="Re-prompts before falling back.")
    train_on_reprompts: bool = Field(
        True, description="Train on the failed attempts of a re-prompt (with the penalty)."
    )


class RolloutSettings(Settings):
    mode: Literal["generate", "score"] = Field(
        "generate",
        description="generate: sample text and parse it; score: rank legal actions by "
        "their log-likelihood (always legal).",
    )
    num_envs: int = Field(16, ge=1, le=4096, description="Environments stepped in lockstep.")
    carry_episodes: bool = Field(
        True,
        description="Training: an env whose episode ends starts the next at once, and "
        "episodes still in progress when an update has its episodes carry into the next "
        "(each turn trained once, with the log-probabilities it was played with). Off, or "
        "with groups (algorithm.group_size > 1): an update's episodes start and end in "
        "its collection.",
    )
    history_turns: int | None = Field(
        0, ge=0, description="Earlier turns kept in the prompt; null = the whole episode."
    )
    max_new_tokens: int = Field(24, ge=1, le=4096, description="Reply length in generate mode.")
    reply_prefix: str = Field(
        "",
        max_length=200,
        description="Generate mode: text the assistant's reply starts with, e.g. "
        "'{\"action\": \"'. It is part of the prompt (context, not trained); the "
        "parsers read it together with the reply. $name is filled each turn from the "
        "agent's reply_fields(observation), e.g. '{\"sum\": $sum, \"action\": \"'; "
        "$$ is a dollar sign.",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    final_temperature: float | None = Field(
        None,
        gt=0,
        description="Anneal the sampling temperature linearly to this over the run's "
        "budget (episodes or minutes), so late rollouts play closer to the greedy policy "
        "that is evaluated; null = constant.",
    )
    legal_replies: bool = Field(
        False,
        description="Generate mode: a reply may only write one of the turn's legal "
        "actions (the tokens of a reply the agent's parsers read as that action, after "
        "the reply prefix), then end, so no reply is invalid; what is trained on stays "
        "the model's own log-probabilities. Off: the model writes freely and the parsers "
        "judge the reply. A turn without legal actions is written freely.",
    )
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling in generate mode.")
    top_k: int = Field(0, ge=0, description="Top-k sampling in generate mode; 0 = off.")
    reward_shaping: bool = Field(False, description="Add llamagym_shape_reward hook terms.")
    progress_reward: float = Field(
        1.0,
        ge=0,
        le=100,
        description="The learner's reward for each unit of info['progress'] a step "
        "reports, where the env reports one (its own measure of how much closer the step "
        "came to the goal: a plan that got shorter, a subgoal reached; negative for a "
        "step back). A dense signal beside a sparse reward; evaluations count the env's "
        "reward alone. 0: none.",
    )
    explore: Literal["least-tried", "all"] = Field(
        "least-tried",
        description="least-tried: at a place the episode comes back to (the agent's "
        "exploration_place, by default the observation's text, with the same legal "
        "actions) offer only the legal actions it has taken least often there, so no "
        "policy loops on one action, in training and evaluation; all: offer every legal "
        "action.",
    )
    invalid_action: InvalidActionSettings = Field(default_factory=InvalidActionSettings)
    max_prompt_chars: int = Field(
        131_072,
        ge=1_000,
        le=16_777_216,
        description="Characters of conversation a prompt renders at most: a longer "
        "observation is cut (one warning), then the oldest turns are dropped. 128K "
        "characters is more than a 32K-token context holds.",
    )
    max_action_chars: int = Field(
        1_000,
        ge=1,
        le=100_000,
        description="Characters an action name may have: a legal action longer than "
        "this stops the run with an error naming the agent (score mode runs every "
        "legal action's tokens through the model).",
    )
    max_episode_turns: int = Field(
        1_000,
        ge=1,
        le=1_000_000,
        description="Turns after which an episode is cut (truncated), for an env that sets "
        "no max_episode_steps of its own (its own limit applies otherwise).",
    )


class TrainingSettings(Settings):
    episodes: int | None = Field(None, ge=1, description="Stop after this many episodes.")
    minutes: float | None = Field(None, gt=0, description="Stop after this wall-clock budget.")
    min_updates: int | None = Field(
        15,
        ge=1,
        le=100_000,
        description="With a time budget: the first collection ends after 1/min_updates of it, "
        "and when the first update says the budget holds fewer updates than this, the "
        "episodes per update are made fewer to fit (said at the start, kept in "
        "config.yaml); an algorithm.episodes_per_update you set is kept. null: never.",
    )
    seed: int = Field(
        0,
        description="Seeds python, numpy, torch and the environments; 0 to 2**32 - 1.",
    )
    eval_episodes: int = Field(
        1000, ge=0, description="Evaluation episodes at the end (0 = none); baselines too."
    )
    eval_greedy: bool = Field(True, description="Evaluate with argmax actions, not sampled.")
    max_env_failures: int = Field(
        10, ge=0, description="Env errors in a row (episode dropped, env remade) before stopping."
    )
    max_skipped_updates: int = Field(
        3, ge=1, description="Updates in a row with a non-finite loss/gradient before stopping."
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=MAX_THREADS,
        description="torch CPU threads; null = 1 for models under 50M parameters (small "
        "matrices gain nothing from more), else torch's default.",
    )
    backend: Literal["native", "trl"] = Field(
        "native",
        description="native: LlamaGym's own algorithms; trl: TRL's GRPOTrainer does the "
        "optimisation (vLLM, DeepSpeed, FSDP through accelerate; generate mode, GRPO).",
    )

    @field_validator("seed")
    @classmethod
    def _seed_in_numpy_range(cls, seed: int) -> int:
        if not 0 <= seed <= MAX_SEED:
            raise PydanticCustomError("seed_range", _SEED_RANGE)
        return seed


class OutputSettings(Settings):
    dir: Path | None = Field(None, description="Run directory; null = runs/<agent>-<time>.")
    quiet: bool = Field(False, description="No progress bar (CI, logs).")
    overwrite: bool = Field(
        False, description="Start a new run in a directory that already holds one."
    )
    checkpoint_every: int = Field(
        20, ge=0, description="Checkpoint every this many updates (0 = only at the end)."
    )
    keep_checkpoints: int = Field(3, ge=1, description="Checkpoints kept; older ones deleted.")
    tensorboard: bool = Field(
        True, description="Write TensorBoard events when `tensorboard` is installed."
    )
    report: bool = Field(True, description="Write report.md and learning_curve.png at the end.")
    rank_records: bool = Field(
        False,
        description="Each process appends a line per update to <run>/.ranks/rank-N.jsonl: "
        "its episodes' seeds and a SHA-256 of its weights (checks multi-process runs).",
    )


class TRLSettings(Settings):
    """What only the TRL backend has; the algorithm section maps onto GRPOConfig's GRPO
    fields (lr, group_size, epochs, clip_range, kl_coef, entropy_coef, ...). Any other
    field of the installed TRL's ``GRPOConfig`` may be set here too
    (``--set trl.vllm_gpu_memory_utilization=0.5``); the TRL backend checks each against
    that dataclass before anything loads."""

    model_config = ConfigDict(extra="allow", validate_assignment=True, allow_inf_nan=False)

    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="TRL's loss normalisation (GRPOConfig.loss_type)."
    )
    use_vllm: bool = Field(False, description="Generate with vLLM (GPU; pip install vllm).")
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate", description="vLLM in the training processes, or a `trl vllm-serve` server."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (less memory, more time)."
    )
    bf16: bool | None = Field(
        None,
        description="bfloat16 mixed precision (GPUs that have it); null = as `accelerate "
        "launch` was told (its --mixed_precision or config file), else off.",
    )


class RunConfig(Settings):
    agent: AgentSection = Field(
        default_factory=AgentSection, description="Which agent; its plugin owns other keys."
    )
    algorithm: AlgorithmSection = Field(
        default_factory=AlgorithmSection,
        description="Which algorithm; its plugin's Config owns the other keys.",
    )
    model: ModelSettings = Field(
        default_factory=ModelSettings, description="The language model and how it loads."
    )
    rollout: RolloutSettings = Field(
        default_factory=RolloutSettings, description="How episodes are played."
    )
    training: TrainingSettings = Field(
        default_factory=TrainingSettings, description="Budget, seed and final evaluation."
    )
    output: OutputSettings = Field(
        default_factory=OutputSettings, description="Where results go, checkpoints, loggers."
    )
    trl: TRLSettings = Field(
        default_factory=TRLSettings, description="TRL backend only (training.backend=trl)."
    )


def deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``base`` with ``override`` laid over it, section by section."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def defaults_for_algorithm(
    defaults: Mapping[str, Any], later_layers: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """An agent's defaults, without its ``algorithm`` section when a later layer picks
    another algorithm: those settings were tuned for the agent's own algorithm, and
    another algorithm starts from its own defaults instead."""
    chosen = None
    for layer in later_layers:
        section = layer.get("algorithm")
        if isinstance(section, Mapping) and section.get("name"):
            chosen = section["name"]
    own = defaults.get("algorithm", {}).get("name", AlgorithmSection().name)
    if chosen is None or chosen == own:
        return dict(defaults)
    return {key: value for key, value in defaults.items() if key != "algorithm"}


# What keeps RL stable on a pretrained model trained through a LoRA adapter. The agents'
# own defaults are tuned for the offline `tiny` model, which learns from random weights
# with full fine-tuning: their learning rate and batch shape wreck a pretrained model
# (SmolLM2-135M: KL 2.2 and a one-action policy after one update). Only keys every
# built-in algorithm takes; an agent refines them with its `pretrained_defaults`.
PRETRAINED_MODEL_DEFAULTS: dict[str, Any] = {
    "rollout": {"num_envs": 16},
    "algorithm": {
        "lr": 1e-4,
        "episodes_per_update": 64,
        "minibatch_size": 32,
        # Each step's 32 turns in passes of 8: the same step, with a quarter of the
        # activations alive at once (SmolLM2-135M, one generate-mode PPO update at
        # minibatch 32: docs/results.md).
        "microbatch_size": 8,
        "epochs": 2,
        "target_kl": 0.02,
    },
    # An agent's one-thread default is for `tiny`'s small matrices; a pretrained model's
    # forwards split well over every core (an fp32 2048x2048 matmul on a 2-core machine:
    # ~180 GFLOP/s on two threads, ~93 on one), so `training.threads`' model-size rule
    # decides again.
    "training": {"threads": None},
}


# What the TRL backend changes in any agent's defaults: TRL's GRPO, on generated
# replies, with the whole episode in the prompt (it trains one append-only sequence per
# episode) and no target-KL stop (TRL has none). Set explicitly, each is refused.
TRL_BACKEND_DEFAULTS: dict[str, Any] = {
    "algorithm": {"name": "grpo", "target_kl": None},
    "rollout": {"mode": "generate", "history_turns": None},
}


def chosen_value(layers: Sequence[Mapping[str, Any]], section: str, key: str) -> Any:
    """The value the last of ``layers`` to set ``section.key`` gives it, else None."""
    chosen = None
    for layer in layers:
        part = layer.get(section)
        if isinstance(part, Mapping) and part.get(key) is not None:
            chosen = part[key]
    return chosen


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
