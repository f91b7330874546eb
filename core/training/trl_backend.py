"""Training under TRL's ``GRPOTrainer``: ``llamagym run AGENT --backend trl``.

The agent, its prompts, chat template, parser chain and invalid-action policy are the
same as in a native run; LlamaGym's own rollout engine plays the episodes, and TRL does
the optimisation (and with it vLLM, DeepSpeed, FSDP and many nodes, through accelerate).
The pieces, in the order TRL calls them:

- The dataset has one row per environment seed (``prompt`` is ``"seed=N"``, the one
  thing a rollout function is handed). TRL gives each row ``num_generations`` times
  (``algorithm.group_size``): the copies of a row are one seed group.
- :class:`EpisodeRollouts` is the rollout function. It plays one episode per prompt with
  :class:`SequenceEngine` and returns each episode as ONE sequence: the first prompt,
  then the reply, the tokens the chat template puts between a reply and the next one
  (end of turn, the next observation, the reply prefix), the next reply, and so on.
  ``env_mask`` is 1 on the model's own tokens and 0 on everything the environment or
  the template wrote, so only replies are trained. The engine builds every turn's
  prompt by appending to that very sequence, so the model acted on exactly the tokens
  TRL scores.
- The episode's return reaches TRL through :meth:`EpisodeRollouts.reward`, keyed to the
  episode: each row carries the key of the episode that produced its tokens, and the
  reward function checks the row's completion tokens and seed against that episode
  before it answers. A reward can never be paired with another episode's tokens.
- Callbacks write ``metrics.jsonl`` (TRL's log mapped onto LlamaGym's metric names) and
  stop at the time budget; at the end the run gets the same greedy evaluation, baselines,
  ``report.md`` and learning curve as a native one.

What cannot carry over is refused before anything loads (:func:`check_supported`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from transformers import PrinterCallback, TrainerCallback

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.models.chat_template import render_chat
from llamagym.models.policy import Replies, json_closed_at, reply_prefixes
from llamagym.rollout.engine import RolloutEngine, Slot
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.training import distributed
from llamagym.training.budget import run_budgets
from llamagym.training.export import RUN_EXPORT
from llamagym.training.report import (
    METRICS,
    append_record,
    records_until,
    rewrite_records,
)
from llamagym.training.run_directory import RUN_FILES, check_writable
from llamagym.training.run_files import read_metrics
from llamagym.training.run_state import (
    MOVING_AVERAGE_EPISODES,
    Counters,
    RunSummary,
    isolated_rng,
    seed_everything,
)
from llamagym.training.sharded import full_state_dict, whole_model
from llamagym.training.trainer import Trainer, make_first_env
from llamagym.training.transcripts import PER_UPDATE, TRANSCRIPTS, TranscriptLog, transcript

if TYPE_CHECKING:
    from llamagym.config import ResolvedConfig

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    'the TRL backend needs trl: pip install "trl>=1.16,<2" (or from a LlamaGym clone, '
    'pip install "./[trl]")'
)
SEED_PROMPT = "seed="
#: With only a time budget, the dataset holds this many episodes (it is never used up).
UNBOUNDED_EPISODES = 10_000_000


def require_trl() -> None:
    """One line, not a traceback, when trl is missing."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        raise LlamaGymError(INSTALL_HINT)


# -- what carries over ------------------------------------------------------------------
def check_supported(resolved: ResolvedConfig, processes: int = 1) -> None:
    """Refuse, before anything loads or is written, every setting the TRL backend cannot
    honour in a run of ``processes`` processes; each problem is one line naming the
    alternative."""
    config = resolved.config
    algorithm = resolved.algorithm
    problems = []
    if config.rollout.mode != "generate":
        problems.append(
            "rollout.mode=score: the TRL backend trains generated replies (TRL's loss is "
            "per token); use --mode generate, or the native backend for score mode"
        )
    if config.algorithm.name != "grpo":
        problems.append(
            f"algorithm.name={config.algorithm.name}: the TRL backend runs TRL's GRPO "
            "(no value head, so no PPO); use --algorithm grpo, or the native backend for "
            f"{config.algorithm.name}"
        )
    else:
        credit = getattr(algorithm, "credit", "discounted")
        gamma = getattr(algorithm, "gamma", 1.0)
        if credit != "discounted" or gamma != 1.0:
            problems.append(
                f"algorithm.credit={credit}, gamma={gamma:g}: under TRL every token of an "
                "episode is credited with the episode's return; use algorithm.credit="
                "discounted with algorithm.gamma=1, or the native backend"
            )
        for key, fix in (
            ("target_kl", "TRL has no target-KL stop; use algorithm.kl_coef"),
            ("adaptive_kl_target", "TRL's KL weight is fixed; set algorithm.kl_coef"),
        ):
            if getattr(algorithm, key, None) is not None:
                problems.append(f"algorithm.{key}: {fix}, or the native backend")
        micro = getattr(algorithm, "microbatch_size", None)
        minibatch = getattr(algorithm, "minibatch_size", 1)
        batch_rule = _batch_rule(algorithm, processes)
        if batch_rule:
            problems.append(batch_rule)
        if micro is not None and minibatch % micro:
            problems.append(
                f"algorithm.microbatch_size={micro}: TRL accumulates whole micro-batches, "
                f"so it must divide algorithm.minibatch_size={minibatch}"
            )
        warm_start = getattr(algorithm, "warm_start", None)
        if warm_start is not None and (warm_start.demonstrations or warm_start.replay):
            problems.append(
                "algorithm.warm_start: supervised warm starts run on the native backend "
                "only; warm-start there and continue with --backend trl from the export"
            )
    problems += _grpo_config_problems(config)
    if config.trl.use_vllm and config.trl.vllm_mode == "server" and processes > 1:
        problems.append(
            "trl.vllm_mode=server: a vLLM server takes every process's prompts in "
            "lockstep, which turn-by-turn multi-turn rollouts cannot keep; use "
            "trl.vllm_mode=colocate (a vLLM engine in each process)"
        )
    if config.rollout.history_turns is not None:
        problems.append(
            "rollout.history_turns: an episode is trained as one growing sequence, so no "
            "turn can be dropped from the prompt; leave rollout.history_turns unset"
        )
    if config.rollout.final_temperature is not None:
        problems.append(
            "rollout.final_temperature: TRL scores replies at one temperature; leave "
            "rollout.final_temperature unset"
        )
    if config.rollout.invalid_action.policy == "reprompt":
        problems.append(
            "rollout.invalid_action.policy=reprompt: a re-prompt rewrites the episode's "
            "sequence; use fallback, random or end_episode with the TRL backend"
        )
    if problems:
        raise ConfigError("\n".join(problems))


# -- the mapping onto GRPOConfig ----------------------------------------------------------
#: GRPOConfig fields the run's other sections set (grpo_args): ``trl.*`` may not set them.
SET_FROM_THE_RUN = {
    "output_dir": "from output.dir", "seed": "from training.seed",
    "use_cpu": "from model.device", "learning_rate": "from algorithm.lr",
    "lr_scheduler_type": "from algorithm.anneal_lr",
    "warmup_steps": "from algorithm.warmup_steps",
    "max_grad_norm": "from algorithm.max_grad_norm",
    "num_generations": "from algorithm.group_size",
    "generation_batch_size": "from algorithm.episodes_per_update",
    "per_device_train_batch_size": "from algorithm.microbatch_size",
    "gradient_accumulation_steps": "from algorithm.minibatch_size",
    "num_iterations": "from algorithm.epochs", "epsilon": "from algorithm.clip_range",
    "beta": "from algorithm.kl_coef", "entropy_coef": "from algorithm.entropy_coef",
    "scale_rewards": "from algorithm.scale_by_std",
    "temperature": "from rollout.temperature",
    "max_completion_length": "from rollout.max_new_tokens", "top_p": "from rollout.top_p",
    "top_k": "from rollout.top_k", "max_steps": "from the training budget",
    "logging_steps": "to one log row per update",
    "save_strategy": "from output.checkpoint_every",
    "save_steps": "from output.checkpoint_every",
    "save_total_limit": "from output.keep_checkpoints",
    "remove_unused_columns": "to False: the rollout reads the dataset's seed column",
    "shuffle_dataset": "to False: seed groups follow the run's seed",
    "disable_tqdm": "to True: the run shows its own progress",
    "dataloader_num_workers": "to 0: the dataset is a list of seeds",
}


def _grpo_config_problems(config: RunConfig) -> list[str]:
    """Each ``trl.*`` key that is not a field of the installed TRL's ``GRPOConfig``, or
    is one the run sets from another section, as a line naming what to use instead."""
    import dataclasses
    import difflib

    from trl import GRPOConfig

    fields = {field.name for field in dataclasses.fields(GRPOConfig)}
    allowed = sorted(fields - set(SET_FROM_THE_RUN))
    problems = []
    for key, value in (config.trl.model_extra or {}).items():
        if key in SET_FROM_THE_RUN:
            problems.append(f"trl.{key}: the TRL backend sets it {SET_FROM_THE_RUN[key]}")
        elif key == "ds3_gather_for_generation" and not value:
            problems.append(
                "trl.ds3_gather_for_generation=false: the processes play episodes of "
                "different lengths, so ZeRO-3 must gather the parameters for the rollout "
                "(each forward pass would otherwise wait for the other processes' "
                "passes); leave it unset"
            )
        elif key not in fields:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            problems.append(
                f"trl.{key}: not a field of GRPOConfig in the installed TRL; {hint}"
                f"allowed: {', '.join(allowed)}"
            )
    return problems


def _batch_rule(algorithm: Any, processes: int) -> str:
    """The problem with an update's batch under TRL (each process trains minibatch_size
    episodes per step), else ``""``."""
    per_step = algorithm.minibatch_size * processes
    if algorithm.episodes_per_update % per_step == 0:
        return ""
    return (
        f"algorithm.episodes_per_update={algorithm.episodes_per_update} must be a "
        f"multiple of algorithm.minibatch_size x processes = {per_step} under the TRL "
        "backend (each process trains minibatch_size episodes per step)"
    )


def steps_per_update(config: RunConfig, algorithm: Any, world_size: int) -> int:
    """Optimizer steps in one generation batch: episodes_per_update / (minibatch x ranks)."""
    problem = _batch_rule(algorithm, world_size)
    if problem:
        raise ConfigError(problem)
    return algorithm.episodes_per_update // (algorithm.minibatch_size * world_size)


def episode_budget(config: RunConfig) -> int:
    """The episodes TRL's dataset and step count are sized for: the native budget, or,
    with a time budget alone, :data:`UNBOUNDED_EPISODES` (the clock stops the run)."""
    episodes, _ = run_budgets(config.training)
    return UNBOUNDED_EPISODES if episodes is None else episodes


def mixed_precision_bf16(asked: bool | None) -> bool:
    """``GRPOConfig.bf16``: what ``trl.bf16`` asks, else what ``accelerate launch`` was
    told (it passes ``--mixed_precision`` or its config file's ``mixed_precision`` to
    each process as ``ACCELERATE_MIXED_PRECISION``); the two disagreeing is refused."""
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if asked is None:
        return launched == "bf16"
    if launched in ("no", "fp16", "bf16", "fp8") and asked != (launched == "bf16"):
        raise ConfigError(
            f"trl.bf16={str(asked).lower()} but accelerate was launched with "
            f"mixed_precision={launched}: drop trl.bf16 (the launcher's setting is taken) "
            "or launch with the mixed precision you want"
        )
    return asked


def grpo_args(resolved: ResolvedConfig, output_dir: Path, world_size: int, use_cpu: bool):
    """TRL's ``GRPOConfig`` from the run's settings: the algorithm section maps onto its
    GRPO fields, ``trl.*`` onto the rest; ``max_steps`` comes from the episode budget."""
    from trl import GRPOConfig

    config, settings = resolved.config, resolved.config.trl
    algorithm: Any = resolved.algorithm  # GRPO's settings (check_supported)
    steps = steps_per_update(config, algorithm, world_size)
    updates = math.ceil(episode_budget(config) / algorithm.episodes_per_update)
    # transformers 5 renamed gradient checkpointing (the old name warns).
    fields = getattr(GRPOConfig, "__dataclass_fields__", {})
    checkpointing = (
        "activation_checkpointing"
        if "activation_checkpointing" in fields
        else "gradient_checkpointing"
    )
    renamed: dict[str, Any] = {checkpointing: settings.gradient_checkpointing}
    extra = dict(settings.model_extra or {})
    micro = algorithm.microbatch_size or algorithm.minibatch_size
    arguments: dict[str, Any] = dict(
        output_dir=str(output_dir / "checkpoints"),
        seed=config.training.seed,
        use_cpu=use_cpu,
        bf16=mixed_precision_bf16(settings.bf16),
        learning_rate=algorithm.lr,
        lr_scheduler_type="linear" if algorithm.anneal_lr else "constant",
        warmup_steps=algorithm.warmup_steps,
        max_grad_norm=algorithm.max_grad_norm,
        num_generations=algorithm.group_size,
        generation_batch_size=algorithm.episodes_per_update,
        # A minibatch is one optimizer step, accumulated from micro-batches when set.
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=algorithm.minibatch_size // micro,
        num_iterations=algorithm.epochs,
        epsilon=algorithm.clip_range,
        beta=algorithm.kl_coef,
        entropy_coef=algorithm.entropy_coef,
        scale_rewards="group" if algorithm.scale_by_std else "none",
        temperature=config.rollout.temperature,
        max_completion_length=config.rollout.max_new_tokens,
        top_p=config.rollout.top_p,
        top_k=config.rollout.top_k,
        max_steps=updates * steps * algorithm.epochs,
        loss_type=settings.loss_type,
        use_vllm=settings.use_vllm,
        vllm_mode=settings.vllm_mode,
        **renamed,
        logging_steps=steps * algorithm.epochs,  # one log row per update
        save_strategy="steps" if config.output.checkpoint_every else "no",
        save_steps=max(1, config.output.checkpoint_every) * steps * algorithm.epochs,
        save_total_limit=config.output.keep_checkpoints,
        report_to="none",
        disable_tqdm=True,
        shuffle_dataset=False,
        remove_unused_columns=False,
        dataloader_num_workers=0,
    )
    try:
        return GRPOConfig(**{**arguments, **extra})  # trl.* keys: checked by check_supported
    except (TypeError, ValueError) as error:
        given = ", ".join(f"trl.{key}={value!r}" for key, value in extra.items()) or "none"
        raise ConfigError(
            f"TRL's GRPOConfig refused the run's settings: {error} (trl.* settings given: "
            f"{given})"
        ) from None


def seed_dataset(config: RunConfig, group_size: int):
    """One row per seed group: ``prompt`` names the seed, ``seed`` holds it."""
    from datasets import Dataset

    groups = math.ceil(episode_budget(config) / group_size)
    if config.training.episodes is None:
        groups = min(groups, UNBOUNDED_EPISODES // group_size)
    seeds = np.random.default_rng(config.training.seed).integers(0, 2**31 - 1, size=groups)
    return Dataset.from_dict(
        {"prompt": [f"{SEED_PROMPT}{int(s)}" for s in seeds], "seed": [int(s) for s in seeds]}
    )


def seed_of(prompt: Any) -> int:
    text = prompt if isinstance(prompt, str) else str(prompt)
    if not text.startswith(SEED_PROMPT):
        raise LlamaGymError(f"a TRL dataset row that names no seed: {text[:60]!r}")
    return int(text[len(SEED_PROMPT) :])


# -- episodes as sequences ------------------------------------------------------------------
class SequenceEngine(RolloutEngine):
    """A rollout engine whose episodes are append-only token sequences: every turn's
    prompt is the sequence so far (earlier prompts and the sampled reply tokens as they
    were), then the tokens the chat template adds before the next reply. A native run
    renders each turn's prompt afresh instead; the TRL backend needs the model to have
    acted on exactly the tokens that are trained."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: id(slot) -> (slot, its sequence so far, the template text it renders)
        self._sequences: dict[int, tuple[Slot, list[int], str]] = {}
        self._rendered: list[str] = []

    def render_prompts(
        self, slots: Sequence[Slot], prefixes: Sequence[str] | None = None
    ) -> tuple[list[str], list[list[int]], list[list[dict[str, str]]]]:
        user_texts, ids, conversations = super().render_prompts(slots, prefixes)
        tokenizer = self.policy.tokenizer
        texts = render_chat(tokenizer, conversations)
        for row, slot in enumerate(slots):
            state = self._sequences.get(id(slot))
            if state is None or state[0] is not slot:
                continue  # a first turn: the template's own tokens
            _, sequence, so_far = state
            text = texts[row]
            if not text.startswith(so_far):
                raise LlamaGymError(
                    "the model's chat template renders an earlier turn differently once "
                    "the next one follows, so an episode cannot be trained as one "
                    "sequence; use the native backend for this model"
                )
            between = tokenizer(text[len(so_far) :], add_special_tokens=False)["input_ids"]
            if sequence and between and sequence[-1] == between[0] == self.policy.eos_id:
                between = between[1:]  # the reply already ended its turn
            ids[row] = sequence + between
        self._rendered = list(texts)
        return user_texts, ids, conversations

    def decide(
        self,
        slots: Sequence[Slot],
        greedy: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Turn]:
        turns = super().decide(slots, greedy, should_stop)
        for slot, turn, text in zip(slots, turns, self._rendered, strict=True):
            self._sequences[id(slot)] = (
                slot,
                turn.prompt_tokens + turn.action_tokens,
                text + turn.reply,
            )
        return turns

    def collect(self, *args: Any, **kwargs: Any) -> list[Episode]:
        try:
            return super().collect(*args, **kwargs)
        finally:
            self._sequences.clear()


@dataclass
class EpisodeSequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    #: per completion token: the sampler's log-probability of a reply token, NaN for
    #: the environment's and the template's (TRL leaves those uncorrected)
    logprobs: list[float]


def episode_sequence(episode: Episode, eos_id: int) -> EpisodeSequence:
    """One episode as TRL's (prompt, completion, env_mask): the first turn's prompt,
    then per turn the tokens between the previous reply and this one (mask 0) and the
    reply (mask 1); an end-of-turn token closes it (mask 0) unless the last reply did."""
    if not episode.turns:
        raise LlamaGymError("an episode without turns cannot be trained")
    first = episode.turns[0]
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    so_far = list(first.prompt_tokens)
    for position, turn in enumerate(episode.turns):
        if position:
            prompt = turn.prompt_tokens
            if prompt[: len(so_far)] != so_far:
                raise LlamaGymError(
                    f"turn {position + 1} of an episode does not extend the turns before it"
                )
            between = prompt[len(so_far) :]
            completion += between
            mask += [0] * len(between)
            logprobs += [math.nan] * len(between)
        completion += turn.action_tokens
        mask += [1] * len(turn.action_tokens)
        sampled = list(turn.logprobs)[: len(turn.action_tokens)]
        logprobs += sampled + [math.nan] * (len(turn.action_tokens) - len(sampled))
        so_far = turn.prompt_tokens + turn.action_tokens
    if not completion or completion[-1] != eos_id:
        completion.append(eos_id)
        mask.append(0)
        logprobs.append(math.nan)
    return EpisodeSequence(list(first.prompt_tokens), completion, mask, logprobs)


class _Sampler:
    """The rollout side of a :class:`~llamagym.models.policy.Policy` for TRL: it samples
    replies (with TRL's vLLM engine when ``trl.use_vllm`` is on, else the policy's
    ``generate``); TRL computes every log-probability it trains on itself, and corrects
    by vLLM's own where vLLM sampled."""

    def __init__(self, policy: Any, vllm: Any = None):
        self.policy = policy
        self.vllm = vllm
        self.tokenizer = policy.tokenizer
        self.eos_id = policy.eos_id
        self.max_context = policy.max_context

    def generate(self, prompts: Sequence[Sequence[int]], **settings: Any) -> Replies:
        if self.vllm is None:
            return self.policy.generate(prompts, **settings)
        # vLLM samples with the run's temperature, top-p and top-k (GRPOConfig's) for
        # max_new_tokens (its max_completion_length); a reply ends as the policy's do.
        # Its log-probabilities (top-1: the sampled token's, after temperature and the
        # other processors) are kept per reply token for TRL's importance-sampling
        # correction (see EpisodeRollouts.__call__).
        _, completions, logprobs, _ = self.vllm.generate(
            prompts=[list(prompt) for prompt in prompts], images=None, num_generations=1
        )
        prefixes = reply_prefixes(settings.get("reply_prefix", ""), len(prompts))
        replies, kept = [], []
        for completion, token_logprobs, prefix in zip(
            completions, logprobs, prefixes, strict=True
        ):
            reply = list(completion)
            if self.eos_id in reply:
                reply = reply[: reply.index(self.eos_id) + 1]
            reply = json_closed_at(self.tokenizer, reply, prefix)
            replies.append(reply)
            kept.append([float(top[0]) for top in token_logprobs[: len(reply)]])
        return Replies(replies, kept, [0.0] * len(replies))

    def score(self, *args: Any, **kwargs: Any) -> Any:
        raise LlamaGymError("score mode does not run under the TRL backend")


class EpisodeRollouts:
    """TRL's rollout function and reward function, over one agent's environments."""

    def __init__(self, agent: Any, tokenizer: Any, seed: int):
        self.agent = agent
        self.tokenizer = tokenizer
        self.seed = seed
        self.engine: SequenceEngine | None = None
        self.envs: list[Any] = []
        self._model: Any = None
        #: key -> (episode, its completion tokens), until its reward is read
        self.pending: dict[int, tuple[Episode, list[int]]] = {}
        self._next_key = 0
        #: the episodes played since the metrics were last written
        self.played: list[Episode] = []
        self.env_steps = 0
        self.episodes = 0
        self.rollout_seconds = 0.0

    def _engine_for(self, model: Any, vllm: Any = None) -> SequenceEngine:
        """The engine over ``model``, built once (the same object TRL trains)."""
        if self.engine is None or self._model is not model:
            from llamagym.models.policy import Policy

            training = model.training
            policy = Policy(model, self.tokenizer)
            model.train(training)  # TRL reads train/eval mode from the model
            self.engine = SequenceEngine(
                self.agent,
                _Sampler(policy, vllm),
                self.agent.config.rollout,
                seed=self.seed,
                max_failures_in_a_row=self.agent.config.training.max_env_failures,
            )
            self._model = model
            self.envs = [self.agent.make_env() for _ in range(self.agent.config.rollout.num_envs)]
        return self.engine

    def close(self) -> None:
        for env in self.envs:
            env.close()
        self.envs = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        import torch

        seeds = [seed_of(prompt) for prompt in prompts]
        started = time.perf_counter()
        episodes: dict[int, Episode] = {}
        # A sharded model's parameters are gathered once for all the turns, since the
        # processes play different numbers of forward passes (see training/sharded.py).
        with whole_model(trainer) as model:
            vllm = trainer.vllm_generation if trainer.use_vllm else None
            engine = self._engine_for(model, vllm)
            steps_before = engine.stats.env_steps
            training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    while len(episodes) < len(seeds):
                        # An episode an env failure dropped is played again with its seed.
                        wanted = [k for k in range(len(seeds)) if k not in episodes]
                        for episode in engine.collect(
                            self.envs, len(wanted), seeds=[seeds[k] for k in wanted]
                        ):
                            episodes[wanted[int(episode.group or 0)]] = episode
            finally:
                model.train(training)
        self.rollout_seconds += time.perf_counter() - started
        self.env_steps += engine.stats.env_steps - steps_before
        self.episodes += len(seeds)
        output: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "env_mask": [],
            "episode_key": [],
            "logprobs": [],
        }
        for k in range(len(seeds)):
            episode = episodes[k]
            sequence = episode_sequence(episode, engine.policy.eos_id)
            key = self._next_key
            self._next_key += 1
            self.pending[key] = (episode, sequence.completion_ids)
            output["prompt_ids"].append(sequence.prompt_ids)
            output["completion_ids"].append(sequence.completion_ids)
            output["env_mask"].append(sequence.env_mask)
            output["logprobs"].append(sequence.logprobs)
            output["episode_key"].append(key)
            self.played.append(episode)
        # vLLM's sampling log-probabilities, for TRL's importance-sampling correction
        # (GRPOTrainer._generate_and_score_completions: the difference to the training
        # model's own, over the tokens env_mask marks); without vLLM TRL reads none.
        if vllm is None:
            output["logprobs"] = None  # type: ignore[assignment]
        return output

    def reward(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        episode_key: list[int],
        seed: list[int],
        **_: Any,
    ) -> list[float]:
        """Each row's reward: the return (with shaping and penalties, what a native run
        trains on) of the episode that produced the row's tokens, checked."""
        rewards = []
        for row, key in enumerate(episode_key):
            episode, tokens = self.pending.pop(int(key))
            if list(completion_ids[row]) != tokens or episode.seed != int(seed[row]):
                raise LlamaGymError(
                    f"row {row} of a TRL batch is paired with another episode's tokens; "
                    "its reward would be another episode's return"
                )
            rewards.append(float(episode.total_reward))
        return rewards

    def take_metrics(self) -> dict[str, float]:
        """Rollout metrics over the episodes played since the last call."""
        from llamagym.training.algorithm import rollout_metrics

        played, self.played = self.played, []
        metrics = rollout_metrics(played) if played else {}
        if self.rollout_seconds:
            metrics["env_steps_per_second"] = self.env_steps / self.rollout_seconds
        return metrics


#: TRL's log keys and the LlamaGym metric each one means.
TRL_METRICS: Mapping[str, str] = {
    "loss": "policy_loss",
    "kl": "kl_ref",
    # TRL's entropy is over the whole vocabulary, per completion token; the native
    # backend's "entropy" is over the legal actions: another quantity, another name.
    "entropy": "entropy_vocab",
    "learning_rate": "lr",
    "grad_norm": "grad_norm",
    "reward_std": "return_std",
    "clip_ratio/region_mean": "clip_fraction",
    "completions/mean_length": "reply_tokens",
    "frac_reward_zero_std": "zero_variance_fraction",
}


# -- the run ------------------------------------------------------------------------------
def trl_checkpoint(path: Path) -> Path | None:
    """The TRL checkpoint to resume from: ``path`` itself when it is one
    (``checkpoint-N`` with TRL's ``trainer_state.json``), else the newest under a TRL
    run directory's ``checkpoints/``; None when ``path`` is neither."""
    path = Path(path)
    if (path / "trainer_state.json").is_file():
        return path
    found = [
        p
        for p in (path / "checkpoints").glob("checkpoint-*")
        if (p / "trainer_state.json").is_file()
    ]
    numbered = [p for p in found if p.name.removeprefix("checkpoint-").isdigit()]
    return max(numbered, key=lambda p: int(p.name.removeprefix("checkpoint-")), default=None)


def trl_run_dir(checkpoint: Path) -> Path:
    """The run directory a TRL checkpoint belongs to (``RUN/checkpoints/checkpoint-N``)."""
    return checkpoint.resolve().parent.parent


class TRLTrainer(Trainer):
    """A run whose optimisation is TRL's ``GRPOTrainer`` (see the module docstring): the
    same run directory, final evaluation and report as :class:`Trainer`'s. Checkpoints
    are TRL's (``checkpoints/checkpoint-N``, resumed by TRL), and the trained model is
    exported to ``model/`` at the end, which ``llamagym eval/play/export`` load."""

    run_files = (*RUN_FILES, RUN_EXPORT)

    @staticmethod
    def run_dir_of(checkpoint: Path) -> Path:
        return trl_run_dir(checkpoint)

    def _run(self) -> RunSummary:
        require_trl()
        check_supported(self.agent.resolved, distributed.world_size())
        from trl import GRPOTrainer

        from llamagym.models.loading import (
            load_model_and_tokenizer,
            lora_config,
            resolve_device,
            trains_through_lora,
        )
        config, agent, resolved = self.config, self.agent, self.agent.resolved
        rank, world = distributed.rank(), distributed.world_size()
        seed_everything(distributed.process_seed(config.training.seed, rank))
        resume = trl_checkpoint(self.resume_from) if self.resume_from is not None else None
        if self.resume_from is not None and resume is None:
            raise LlamaGymError(
                f"{str(self.resume_from)!r} holds no TRL checkpoint (checkpoints/"
                "checkpoint-N with trainer_state.json)"
            )
        self._replaces_a_run(resume)
        if distributed.is_main():
            check_writable(self.output_dir, resume is not None, create=False)
        make_first_env(agent)
        if resume is not None:
            self._read_resumed_files(resume)
        settings = config.model
        device = resolve_device(
            str(agent.device) if agent.device is not None else settings.device
        )
        algorithm: Any = resolved.algorithm
        steps = steps_per_update(config, algorithm, world) * algorithm.epochs
        # GRPOConfig first: under `accelerate launch` with DeepSpeed ZeRO-3 it makes
        # transformers create the model partitioned (zero.Init) as it loads.
        args = grpo_args(
            resolved, self.output_dir, world, use_cpu=torch.device(device).type == "cpu"
        )
        # TRL wraps the model in its LoRA adapter (peft_config); a quantized model gets
        # the loader's, which prepares the quantized weights for it first.
        quantized = settings.quantize is not None
        model, tokenizer = load_model_and_tokenizer(
            settings.name,
            device=device,
            dtype=None if settings.dtype == "auto" else settings.dtype,
            quantize=settings.quantize,
            lora=settings.lora if quantized else False,
            lora_rank=settings.lora_rank if quantized else None,
            lora_layers=settings.lora_layers if quantized else None,
            trust_remote_code=settings.trust_remote_code,
            seed=config.training.seed,
        )
        peft_config = None
        if not quantized and trains_through_lora(model, settings.lora):
            peft_config = lora_config(
                model, settings.name, settings.lora_rank, settings.lora_layers
            )
        if config.training.threads is not None:
            torch.set_num_threads(config.training.threads)
        # Everything that can refuse the run has run: now the directory is written.
        self._prepare_output_dir(resume)
        self._transcripts = TranscriptLog(
            self.output_dir / TRANSCRIPTS if distributed.is_main() else None
        )
        self._write_config()
        rollouts = EpisodeRollouts(
            agent, tokenizer, distributed.process_seed(config.training.seed, rank)
        )
        history: list[dict[str, Any]] = []
        clock = _Clock(self, rollouts, history, steps, resume)
        with _quiet_trl():
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=[cast(Any, rollouts.reward)],
                args=args,
                train_dataset=seed_dataset(config, algorithm.group_size),
                processing_class=tokenizer,
                rollout_func=rollouts,
                peft_config=peft_config,
                callbacks=[clock],
            )
        # The run's own progress bar and metrics.jsonl stand in for TRL's printed logs.
        trainer.remove_callback(PrinterCallback)
        if self.progress is not None and distributed.is_main():
            self.progress.start(
                None
                if config.training.minutes and config.training.episodes is None
                else episode_budget(config),
                config.training.minutes,
                clock.episodes_before,
                clock.seconds_before,
            )
        try:
            with self._stop_on_signals(), _quiet_trl():
                trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            if self.progress is not None:
                self.progress.stop()
            rollouts.close()
        self.stop_signal = self._signal_received
        counters = Counters(
            updates=clock.updates,
            episodes=clock.episodes,
            env_steps=clock.env_steps,
            seconds=clock.seconds(),
        )
        distributed.barrier()
        summary = RunSummary(
            self.output_dir,
            counters.episodes,
            counters.updates,
            counters.env_steps,
            counters.seconds,
            last_metrics=history[-1] if history else {},
            checkpoint=trl_checkpoint(self.output_dir),
            interrupted=self.stop_signal,
            resumed_from=resume,
            greedy=config.training.eval_greedy,
        )
        # Every process takes part in gathering a sharded model; the main one alone
        # evaluates and exports it (see training/sharded.py).
        weights = full_state_dict(trainer)
        with whole_model(trainer) as trained:
            if distributed.is_main():
                self._evaluate_and_export(trained, tokenizer, summary, counters, history,
                                          weights)
        return summary

    def _evaluate_and_export(
        self,
        trained: Any,
        tokenizer: Any,
        summary: RunSummary,
        counters: Counters,
        history: list[dict[str, Any]],
        weights: Mapping[str, Any] | None,
    ) -> None:
        """The main process's end of a run: the greedy evaluation, the export to
        ``RUN/model`` (from ``weights`` when the model was sharded) and the report."""
        from llamagym.models.policy import Policy
        from llamagym.training.export import export_agent

        agent, config = self.agent, self.config
        agent.use_policy(Policy(trained, tokenizer))
        record = None
        if self.stop_signal is None and config.training.eval_episodes:
            summary.evaluation, summary.baselines, record = self._evaluate(counters)
            history.append(record)
        summary.checkpoint = export_agent(
            agent,
            self.output_dir / RUN_EXPORT,
            evaluation=record,
            training=counters.as_dict(),
            overwrite=True,
            weights=weights,
        )
        self._report(summary, history)


@contextlib.contextmanager
def _quiet_trl() -> Iterator[None]:
    """TRL's notice about its experimental rollout function and transformers' about a
    renamed attribute TRL reads say nothing a user can act on."""
    previous = os.environ.get("TRL_EXPERIMENTAL_SILENCE")
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            yield
    finally:
        if previous is None:
            os.environ.pop("TRL_EXPERIMENTAL_SILENCE", None)
        else:
            os.environ["TRL_EXPERIMENTAL_SILENCE"] = previous


class _Clock(TrainerCallback):
    """What a native run's loop does around an update, as TRL callbacks: a metrics row
    per update (TRL's log mapped onto LlamaGym's names, beside the rollout's own), the
    progress bar, transcripts, and the time budget and stop signals, agreed by every
    process at the end of an optimizer step (the stopped run saves a checkpoint)."""

    def __init__(
        self,
        owner: TRLTrainer,
        rollouts: EpisodeRollouts,
        history: list[dict[str, Any]],
        steps_per_update: int,
        resume: Path | None,
    ):
        self.owner = owner
        self.rollouts = rollouts
        self.history = history
        self.steps_per_update = steps_per_update
        self.episodes_per_update = owner.agent.resolved.algorithm.episodes_per_update
        minutes = owner.config.training.minutes
        self.time_budget = 60 * minutes if minutes else None
        self.started = time.perf_counter()
        self.episodes_before = self.env_steps_before = 0
        self.seconds_before = 0.0
        self.recent: deque[float] = deque(maxlen=MOVING_AVERAGE_EPISODES)
        if resume is not None:
            earlier = records_until(
                read_metrics(owner.output_dir / METRICS), self._update_of_checkpoint(resume)
            )
            rewrite_records(owner.output_dir / METRICS, earlier)
            history += earlier
            if earlier:
                last = earlier[-1]
                self.episodes_before = int(last.get("total_episodes", 0))
                self.seconds_before = float(last.get("seconds", 0.0))
                self.env_steps_before = int(last.get("env_steps", 0))
        self.updates = 0
        self.episodes = self.episodes_before
        self.env_steps = self.env_steps_before

    def _update_of_checkpoint(self, checkpoint: Path) -> int:
        state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
        return int(state.get("global_step", 0)) // self.steps_per_update

    def seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if not logs or "loss" not in logs:
            return  # the summary TRL logs once training ends
        self.updates = state.global_step // self.steps_per_update
        played = list(self.rollouts.played)
        rollout = self.rollouts.take_metrics()
        # Every process logs at the same steps: the rollout numbers cover them all, as
        # after a native update (each process plays its own share of the episodes).
        shares = distributed.all_gather(
            {
                "returns": [episode.env_return for episode in played],
                "turns": sum(len(episode.turns) for episode in played),
                "invalid": sum(episode.invalid_replies for episode in played),
                "episodes": self.rollouts.episodes,
                "env_steps": self.rollouts.env_steps,
                "env_steps_per_second": rollout.get("env_steps_per_second", 0.0),
            }
        )
        returns = [value for share in shares for value in share["returns"]]
        turns = sum(share["turns"] for share in shares)
        if returns:
            rollout.update(
                episodes=float(len(returns)),
                return_mean=sum(returns) / len(returns),
                invalid_rate=sum(share["invalid"] for share in shares) / max(1, turns),
                episode_length=turns / len(returns),
            )
        if "env_steps_per_second" in rollout:
            rollout["env_steps_per_second"] = sum(s["env_steps_per_second"] for s in shares)
        self.episodes = self.episodes_before + sum(share["episodes"] for share in shares)
        self.env_steps = self.env_steps_before + sum(share["env_steps"] for share in shares)
        self.recent.extend(returns)
        row: dict[str, Any] = {
            "kind": "update",
            "update": self.updates,
            "total_episodes": self.episodes,
            "env_steps": self.env_steps,
            "seconds": self.seconds(),
            **rollout,
            "return_moving_average": float(np.mean(self.recent)) if self.recent else 0.0,
        }
        for key, name in TRL_METRICS.items():
            value = logs.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                row[name] = float(value)
        self.history.append(row)
        if self.owner.config.output.rank_records:
            model = kwargs["model"]
            trained = [p for p in model.parameters() if p.requires_grad]
            self.owner._record_rank(self.updates, played, trained)
        if distributed.is_main():
            agent = self.owner.agent
            append_record(self.owner.output_dir / METRICS, row)
            self.owner._transcripts.add(
                transcript(agent, episode, "training", self.updates)
                for episode in played[:PER_UPDATE]
            )
            # The loggers (TensorBoard, W&B, a plugin's), as after a native update.
            metrics = {key: value for key, value in row.items() if key != "kind"}
            with isolated_rng():
                agent.plugins.update_end(agent, self.updates, metrics, run=self.owner.context)
        if self.owner.progress is not None:
            self.owner.progress.update(self.episodes, row["seconds"], row)

    def on_step_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        stop = self.owner._signal_received is not None or (
            self.time_budget is not None and self.seconds() >= self.time_budget
        )
        if any(distributed.all_gather(stop)):
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"
