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

The settings' side (what carries over, ``GRPOConfig``, the seed dataset) is in
``settings.py`` beside it; the rollout function and the sequences in ``rollout.py``; a
sharded model's gathering in ``sharded.py``. This module is the run: the trainer, its
callbacks and the end of a run.
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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from transformers import PrinterCallback, TrainerCallback

from llamagym import distributed
from llamagym.display import printable
from llamagym.errors import LlamaGymError
from llamagym.models import loading
from llamagym.models.lora_choice import trains_through_lora
from llamagym.models.policy import Policy
from llamagym.paths import check_own_entry
from llamagym.resolver.trl_arguments import episode_budget, grpo_args, require_trl, steps_per_update
from llamagym.schedule import Schedule
from llamagym.training.checkpoint.store import CHECKPOINTS
from llamagym.training.loop.run_directory import RUN_FILES, check_writable
from llamagym.training.loop.run_start import make_first_env
from llamagym.training.loop.run_state import (
    MOVING_AVERAGE_EPISODES,
    Counters,
    RunSummary,
    isolated_rng,
    make_engine,
    seed_everything,
)
from llamagym.training.loop.trainer import Trainer
from llamagym.training.records.export import RUN_EXPORT, export_agent
from llamagym.training.records.report import (
    METRICS,
    append_record,
    records_until,
    rewrite_records,
)
from llamagym.training.records.run_files import read_metrics
from llamagym.training.records.transcripts import PER_UPDATE, TRANSCRIPTS, TranscriptLog, transcript
from llamagym.trl_backend.rollout import EpisodeRollouts
from llamagym.trl_backend.settings import check_supported, seed_dataset
from llamagym.trl_backend.sharded import full_state_dict, whole_model

logger = logging.getLogger(__name__)

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
    """The run directory a TRL checkpoint belongs to (``RUN/checkpoints/checkpoint-N``),
    as given: a link on the way is not followed out of it (and is refused when the run
    checks its own entries, :func:`check_trl_entries`)."""
    return Path(os.path.abspath(checkpoint)).parent.parent.resolve()


def check_trl_entries(directory: Path) -> None:
    """What a TRL-backend run writes beside a native run's files, each missing or its
    own folder (never a link out of the run directory): ``model/`` and TRL's
    ``checkpoints/checkpoint-N``."""
    check_own_entry(directory / RUN_EXPORT, folder=True)
    for checkpoint in sorted((directory / CHECKPOINTS).glob("checkpoint-*")):
        check_own_entry(checkpoint, folder=True)


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
        config, agent, resolved = self.config, self.agent, self.agent.resolved
        rank, world = distributed.rank(), distributed.world_size()
        seed_everything(distributed.process_seed(config.training.seed, rank))
        resume = self._checkpoint_to_resume()
        check_trl_entries(self.output_dir)
        self.directory.replaces_a_run(resume)
        if distributed.is_main():
            check_writable(self.output_dir, resume is not None, create=False)
        make_first_env(agent)
        if resume is not None:
            self._read_resumed_files(resume)
        settings = config.model
        device = loading.resolve_device(
            str(agent.device) if agent.device is not None else settings.device
        )
        algorithm: Any = resolved.algorithm
        steps = steps_per_update(algorithm, world) * algorithm.epochs
        # GRPOConfig first: under `accelerate launch` with DeepSpeed ZeRO-3 it makes
        # transformers create the model partitioned (zero.Init) as it loads.
        args = grpo_args(
            config, algorithm, self.output_dir, world, use_cpu=torch.device(device).type == "cpu"
        )
        model, tokenizer, peft_config = self._load_model(device)
        if config.training.threads is not None:
            torch.set_num_threads(config.training.threads)
        # Everything that can refuse the run has run: now the directory is written.
        self.directory.claim(resume)
        self._transcripts = TranscriptLog(
            self.output_dir / TRANSCRIPTS if distributed.is_main() else None
        )
        self._write_config()
        rollouts = EpisodeRollouts(
            agent, tokenizer, distributed.process_seed(config.training.seed, rank)
        )
        history: list[dict[str, Any]] = []
        clock = _Clock(self, rollouts, history, steps, algorithm.episodes_per_update, resume)
        with _quiet_trl():
            trainer = printable_grpo_trainer(
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
        self._train(trainer, clock, rollouts, resume)
        self.stop_signal = self._signals.received
        counters = Counters(
            updates=clock.updates,
            episodes=clock.episodes,
            env_steps=clock.env_steps,
            seconds=clock.seconds(),
        )
        distributed.barrier()
        summary = RunSummary(
            self.output_dir, counters.episodes, counters.updates, counters.env_steps,
            counters.seconds, last_metrics=history[-1] if history else {},
            checkpoint=trl_checkpoint(self.output_dir), interrupted=self.stop_signal,
            resumed_from=resume, greedy=config.training.eval_greedy,
        )
        # Every process takes part in gathering a sharded model; the main one alone
        # evaluates and exports it (see trl_backend/sharded.py).
        weights = full_state_dict(trainer)
        with whole_model(trainer) as trained:
            if distributed.is_main():
                self._evaluate_and_export(trained, tokenizer, summary, counters, history,
                                          weights)
        return summary

    def _checkpoint_to_resume(self) -> Path | None:
        """The TRL checkpoint ``--resume`` names, or None for a new run."""
        if self.resume_from is None:
            return None
        resume = trl_checkpoint(self.resume_from)
        if resume is None:
            raise LlamaGymError(
                f"{str(self.resume_from)!r} holds no TRL checkpoint (checkpoints/"
                "checkpoint-N with trainer_state.json)"
            )
        return resume

    def _load_model(self, device: str) -> tuple[Any, Any, Any]:
        """The model, its tokenizer and the LoRA config TRL wraps it in (None: none).

        TRL wraps the model in its LoRA adapter (peft_config); a quantized model gets
        the loader's, which prepares the quantized weights for it first."""
        settings = self.config.model
        quantized = settings.quantize is not None
        model, tokenizer = loading.load_model_and_tokenizer(
            settings.name,
            device=device,
            dtype=None if settings.dtype == "auto" else settings.dtype,
            quantize=settings.quantize,
            lora=settings.lora if quantized else False,
            lora_rank=settings.lora_rank if quantized else None,
            lora_layers=settings.lora_layers if quantized else None,
            trust_remote_code=settings.trust_remote_code,
            seed=self.config.training.seed,
        )
        peft_config = None
        if not quantized and trains_through_lora(model, settings.lora):
            peft_config = loading.lora_config(
                model, settings.name, settings.lora_rank, settings.lora_layers
            )
        return model, tokenizer, peft_config

    def _train(self, trainer: Any, clock: Any, rollouts: Any, resume: Path | None) -> None:
        """TRL's training loop, under the run's progress bar and signal handling."""
        config = self.config
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
            with self._signals, _quiet_trl():
                trainer.train(resume_from_checkpoint=str(resume) if resume else None)
        finally:
            if self.progress is not None:
                self.progress.stop()
            rollouts.close()

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
        agent, config = self.agent, self.config
        # The trained policy goes back to the caller on the summary.
        policy = summary.policy = Policy(trained, tokenizer)
        record = None
        if self.stop_signal is None and config.training.eval_episodes:
            engine = make_engine(agent, policy, config, Schedule(config.rollout), observe=False)
            summary.evaluation, summary.baselines, record = self._evaluate(counters, engine)
            history.append(record)
        summary.checkpoint = export_agent(
            agent,
            policy,
            self.output_dir / RUN_EXPORT,
            evaluation=record,
            training=counters.as_dict(),
            overwrite=True,
            weights=weights,
        )
        self._report(summary, history)


def printable_grpo_trainer(**arguments: Any) -> Any:
    """TRL's ``GRPOTrainer`` whose ``log_completions`` table shows the episodes' text
    escaped (:func:`~llamagym.display.printable`): a completion holds the env's
    observations and the model's replies, data that must not drive the terminal. The
    completions TRL keeps for that table (and its ``completions/`` files) are the
    escaped text."""
    from trl import GRPOTrainer

    class PrintableGRPOTrainer(GRPOTrainer):
        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if self.log_completions:
                for column in ("prompt", "completion"):
                    kept: Any = self._logs[column]
                    self._logs[column] = deque(map(_printable_entry, kept), maxlen=kept.maxlen)
            super().log(logs, start_time)

    return PrintableGRPOTrainer(**arguments)


def _printable_entry(entry: Any) -> Any:
    """A prompt or completion as TRL logs it (text, or a conversation's messages) with
    its text escaped."""
    if isinstance(entry, str):
        return printable(entry)
    if isinstance(entry, list):
        return [
            {**m, "content": printable(m["content"])}
            if isinstance(m, dict) and isinstance(m.get("content"), str) else m
            for m in entry
        ]
    return entry


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
        episodes_per_update: int,
        resume: Path | None,
    ):
        self.owner = owner
        self.rollouts = rollouts
        self.history = history
        self.steps_per_update = steps_per_update
        self.episodes_per_update = episodes_per_update
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
        stop = self.owner._signals.received is not None or (
            self.time_budget is not None and self.seconds() >= self.time_budget
        )
        if any(distributed.all_gather(stop)):
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no"
