"""One training run: collect episodes, update, log, checkpoint, evaluate, report.

The loop is the same for a fresh run and a resumed one: a resumed run first loads the
checkpoint's weights, optimizer, counters and every random state, then carries on, so
from the checkpoint's update on it writes the metrics the unbroken run would have.
Its parts live beside it: the start and the resume in :mod:`.run_start`, an update's
numbers in :mod:`.update_metrics`, the final evaluation in :mod:`.final_evaluation`.
SIGINT (Ctrl-C) and SIGTERM stop the run within seconds, write a checkpoint and return;
a second signal aborts at once. A signal (or the time budget running out) during a
collection drops that unfinished batch: its finished episodes are not trained on, and
the engine's and the global random states go back to where the last update left them,
so the checkpoint is exactly the last completed update's. A signal, or the time budget
running out, during an update ends it at the next minibatch boundary (the run's
``Control.should_stop``); the weights after the steps taken are kept, and the update's
metrics say ``update_interrupted: 1``. A run out of time then evaluates as usual.

With several processes (:mod:`llamagym.distributed`) every process runs this loop on its
own environments and episodes; after each update they exchange a small summary (their
episodes' returns, turns and env steps, rank 0's elapsed time), and before each any stop
signal, so every process counts the same episodes and time and stops after the same
update. With several processes both stops, the signal and the time budget, are only
checked between updates, where the processes agree on them; a long collection or update
then runs to its end. The metrics logged are over
all processes for the rollout (``return_mean``, ``return_moving_average``,
``invalid_rate``, ``episode_length``, ``episodes``, ``total_episodes``, ``env_steps``,
``env_steps_per_second``, ``env_failures``) and rank 0's own for the algorithm's numbers
(losses, KL, entropy, ...). Rank 0 alone writes the run directory, calls the
``update_end`` hooks (the loggers) and evaluates; a resumed run loads the same checkpoint
everywhere.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym import distributed
from llamagym import moved_name as _moved_name
from llamagym.errors import EnvFailureError, WriteError
from llamagym.models.policy import Policy, name_tokens
from llamagym.paths import write_atomically
from llamagym.plugin_runtime.registry import RunContext
from llamagym.rollout import carried
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.evaluation import EvalResult
from llamagym.schedule import Control, run_budgets
from llamagym.task import Task
from llamagym.training.checkpoint import errors as checkpoint_errors
from llamagym.training.checkpoint import store as checkpoints
from llamagym.training.loop.baseline_warm_start import (
    baseline_demonstrations,
    check_resumed_demonstrations,
    warm_start_limit,
    warn_if_long,
)
from llamagym.training.loop.budget import (
    TIME_BUDGET,
    CollectionWatch,
    budget_fraction,
    refuse_a_spent_budget,
    stop_cause,
)
from llamagym.training.loop.final_evaluation import evaluate_run
from llamagym.training.loop.learning_signal import LearningSignal
from llamagym.training.loop.release_memory import release_freed_memory
from llamagym.training.loop.run_directory import (
    PLUGINS,
    RANK_RECORDS,
    RUN_FILES,
    RunDirectory,
    check_writable,
    default_output_dir,
)
from llamagym.training.loop.run_start import make_first_env, restore_run, warn_if_plugins_changed
from llamagym.training.loop.run_state import (
    MOVING_AVERAGE_EPISODES,
    Counters,
    RandomState,
    Run,
    RunParts,
    RunSummary,
    Training,
    isolated_rng,
    make_engine,
    reseed_process,
    seed_everything,
)
from llamagym.training.loop.stop_signals import StopSignals
from llamagym.training.loop.update_metrics import (
    check_skipped_steps,
    count_update,
    warn_if_first_update_moved_far,
)
from llamagym.training.loop.update_size import first_collection_enough, fit_to_budget
from llamagym.training.records.report import METRICS, append_record, write_report
from llamagym.training.records.run_files import read_metrics, read_transcripts
from llamagym.training.records.transcripts import (
    PER_UPDATE,
    TRANSCRIPTS,
    TranscriptLog,
    transcript,
)

logger = logging.getLogger(__name__)


class Trainer:
    """Trains ``agent`` with its configured algorithm, on the policy and run ``parts``
    builds (``Trainer(agent, agent.session)``); ``resume_from`` is a checkpoint
    directory or a run directory (its newest checkpoint)."""

    def __init__(self, agent: Task, parts: RunParts, progress: Any = None,
                 resume_from: Path | str | None = None):
        self.agent = agent
        self.parts = parts
        self.config = agent.config
        self.progress = progress
        directory = self.config.output.dir or default_output_dir(self.config.agent.name)
        # Every process uses rank 0's directory (a default name holds the time).
        self.output_dir = Path(distributed.all_gather(str(directory))[0])
        #: What observers (loggers) are told about the run; only rank 0 writes files.
        self.context = RunContext(
            self.output_dir if distributed.is_main() else None,
            rank=distributed.rank(),
            world_size=distributed.world_size(),
        )
        self.resume_from = Path(resume_from) if resume_from is not None else None
        #: The signal that stops the run, agreed by every process before each update.
        self.stop_signal: str | None = None
        #: this process's own: the first SIGINT/SIGTERM while the run is in its loop
        self._signals = StopSignals(
            "this update" if distributed.world_size() > 1 else "this step"
        )
        self._last_checkpoint: Path | None = None
        self._last_checkpoint_update = -1
        self._config_dict: dict[str, Any] = {}
        self._config_yaml = ""
        self._time_used: Callable[[], float] = lambda: 0.0  # the run's clock, once it runs
        self._time_budget: float | None = None  # seconds, once the run has started
        self._transcripts = TranscriptLog(None)  # the run directory's, once it is ready
        #: the plugins a resumed checkpoint recorded; compared after the first update
        self._resumed_plugins: list[dict[str, Any]] | None = None
        #: the checks that the run can still learn (a resumed run's: after its restore)
        self._learning_signal = LearningSignal(agent)
        #: where the run writes, claimed (its lock taken) just before the first write
        self.directory = RunDirectory(
            self.output_dir, self.run_files, self.run_dir_of, self.config.output.overwrite
        )

    # -- set-up -------------------------------------------------------------------
    #: What a new run in a directory that holds an older one replaces.
    run_files: tuple[str, ...] = RUN_FILES

    @staticmethod
    def run_dir_of(checkpoint: Path) -> Path:
        """The run directory a checkpoint of this trainer's belongs to."""
        return checkpoints.run_dir_of(checkpoint)

    def _write_config(self) -> None:
        agent_name = self.config.agent.name
        self._config_dict = self.config.model_dump(mode="json")
        self._config_yaml = self.agent.resolved.to_yaml(
            header=[
                f"LlamaGym run configuration, agent {agent_name!r}, written "
                f"{datetime.now().isoformat(timespec='seconds')}.",
                f"Run it again: llamagym run {agent_name} --config THIS_FILE --output NEW_DIR",
                "'# from ...' marks a value set above the built-in defaults.",
                "",
            ],
        )
        if distributed.is_main():
            write_atomically(self.output_dir / "config.yaml", self._config_yaml)

    def _read_resumed_files(self, checkpoint: Path) -> list[dict[str, Any]]:
        """The metrics of the run a resume continues, read (and its transcripts and a
        baseline warm start's demonstrations checked) before anything is written: a
        damaged or missing file stops the resume in one line naming it, with every file
        as it was."""
        if self.run_dir_of(checkpoint) == self.output_dir.resolve():
            read_transcripts(self.output_dir / TRANSCRIPTS)
        check_resumed_demonstrations(self.agent, self.run_dir_of(checkpoint))
        return read_metrics(self.run_dir_of(checkpoint) / METRICS)

    def _restore(
        self, run: Run, checkpoint: Path, counters: Counters, earlier: list[dict[str, Any]]
    ) -> list[dict[str, Any]]:
        """Load the checkpoint into ``run``; return the metrics history up to it
        (``earlier``: the records of the run it belongs to)."""
        metrics_file = self.output_dir / METRICS if distributed.is_main() else None
        history, self._resumed_plugins = restore_run(
            run, checkpoint, counters, earlier, metrics_file
        )
        self._last_checkpoint, self._last_checkpoint_update = checkpoint, counters.updates
        return history

    def _show_phase(self, text: str) -> None:
        if self.progress is not None and hasattr(self.progress, "phase"):
            self.progress.phase(text, self._time_used())

    def _show_epoch(self, epoch: int, epochs: int) -> None:
        self._show_phase(f"update epoch {epoch}/{epochs}")

    def _stop_reason(self) -> str | None:
        """Why this process should stop now (one process only): the signal received
        ("SIGTERM"...), else "time budget" once it is used up, else None."""
        if self._signals.received is not None:
            return self._signals.received
        if self._time_budget is not None and self._time_used() >= self._time_budget:
            return TIME_BUDGET
        return None

    def _stop_requested(self) -> bool:
        """What the algorithm checks between minibatches."""
        return self._stop_reason() is not None

    def _checkpoint(self, training: Training) -> Path:
        """Rank 0 writes the checkpoint of ``training``'s run; every process returns its
        path."""
        counters = training.counters
        name = checkpoints.checkpoint_name(counters.updates)
        path = self.output_dir / checkpoints.CHECKPOINTS / name
        if distributed.is_main():
            plugins = self.agent.plugins.participants()
            path = checkpoints.save_training_checkpoint(
                self.output_dir,
                training.run,
                counters.as_dict(),
                self._config_dict,
                self._config_yaml,
                keep=self.config.output.keep_checkpoints,
                plugins=plugins,
            )
            text = json.dumps(plugins, indent=1) + "\n"
            write_atomically(self.output_dir / PLUGINS, text)
            logger.debug("checkpoint written: %s", path)
        self._last_checkpoint, self._last_checkpoint_update = path, counters.updates
        return path

    def _record_rank(self, update: int, batch: list[Any], parameters: Any) -> None:
        """``output.rank_records``: this process's episodes and the digest of the weights
        it trained (``parameters``) after an update."""
        rank = distributed.rank()
        record = {
            "update": update,
            "rank": rank,
            "episodes": len(batch),
            "seeds": [episode.seed for episode in batch],
            "parameters_sha256": distributed.parameters_digest(parameters),
        }
        directory = self.output_dir / RANK_RECORDS
        directory.mkdir(parents=True, exist_ok=True)
        append_record(directory / f"rank-{rank}.jsonl", record)

    # -- the run --------------------------------------------------------------------
    def run(self) -> RunSummary:
        """Train, evaluate and report, as the run directory's one writer (its lock is
        held from the directory's first write to the end)."""
        try:
            return self._run()
        except WriteError as error:  # a run file (metrics, transcripts, config) failed
            raise WriteError(f"{error}, {checkpoints.how_to_continue(self.output_dir)}") from error
        finally:
            self.directory.release()

    def _run(self) -> RunSummary:
        """The run's phases: start, then per update collect, update, record and (when
        due) checkpoint, until the budget is spent or a stop is asked for; then finish."""
        training = self._start()
        try:
            with self._signals:
                while not self._should_stop(training):
                    batch = self._collect(training)
                    if batch is None:  # cut short: its episodes are dropped, the run ends
                        break
                    update_metrics = self._update(training, batch)
                    self._record(training, batch, update_metrics)
                    if training.counters.updates == 1:
                        self._fit_update_size(training)
                    every = self.config.output.checkpoint_every
                    if every and training.counters.updates % every == 0:
                        self._checkpoint(training)
            # The last checkpoint, while the envs of the episodes in progress are open.
            if self._last_checkpoint_update != training.counters.updates:
                self._checkpoint(training)
        finally:
            if self.progress is not None:
                self.progress.stop()
            training.run.engine.close()
        return self._finish(training)

    def _check_carried(self, checkpoint: Path, meta: dict[str, Any], policy: Policy) -> None:
        """Refuse a checkpoint whose episodes in progress are not what the engine saves
        for this run's mode and model (:func:`carried.check_saved`), before anything of
        the run is written; their replay against the env checks the rest."""
        saved = ((meta.get("state") or {}).get("engine") or {}).get("carried")
        if saved is None:
            return
        try:
            carried.check_saved(
                saved, self.config.rollout.mode, len(policy.tokenizer),
                lambda name: name_tokens(policy.tokenizer, policy.eos_id, [name])[0],
            )
        except ValueError as error:
            raise checkpoint_errors.damaged(
                checkpoint, f"{error}; --resume from an earlier checkpoint, or start a fresh run"
            ) from None

    def _start(self) -> Training:
        """Refuse what cannot run, prepare the run directory, load the model, build the
        run's parts around rank 0's weights, restore a resumed run, start the clocks."""
        config, agent = self.config, self.agent
        rank = distributed.rank()
        seed_everything(distributed.process_seed(config.training.seed, rank))
        resume_checkpoint = None
        meta: dict[str, Any] = {}
        earlier: list[dict[str, Any]] = []
        if self.resume_from is not None:
            resume_checkpoint = checkpoints.find_checkpoint(self.resume_from)
            meta = checkpoints.read_meta(resume_checkpoint)
            checkpoints.check_compatible(
                meta, config.model_dump(mode="json"), resume_checkpoint
            )
            earlier = self._read_resumed_files(resume_checkpoint)
            refuse_a_spent_budget(config.agent.name, self.resume_from, meta, config.training)
        # Every refusal comes before the run directory is touched: a damaged run file, a
        # directory that holds another run or cannot be written, a missing env, a model
        # that does not load.
        self.directory.replaces_a_run(resume_checkpoint)
        if distributed.is_main():
            check_writable(self.output_dir, resume_checkpoint is not None, create=False)
        make_first_env(agent)
        policy = self.parts.policy  # loads the model, drawing from the streams as it always has
        if resume_checkpoint is not None:
            self._check_carried(resume_checkpoint, meta, policy)
        self.directory.claim(resume_checkpoint)
        # Rank 0 keeps the transcripts; the others keep theirs in memory only.
        self._transcripts = TranscriptLog(
            self.output_dir / TRANSCRIPTS if distributed.is_main() else None
        )

        # Every process starts from rank 0's weights; then the run's parts are built
        # around them, the algorithm told how to stop and show its epochs.
        distributed.broadcast_parameters(policy.trainable_parameters())
        agent.plugins.reset_participants()  # this run's, not an earlier one's in the process
        several = distributed.world_size() > 1
        episode_budget, time_budget = run_budgets(config.training)
        # A fresh run's time budget counts from here, its warm start's included.
        built = time.perf_counter()
        control = Control(
            # One process stops within an update; several only between updates, where
            # they agree (a stop inside would break their lockstep).
            should_stop=(lambda: False) if several else self._stop_requested,
            on_epoch=self._show_epoch,
            warm_start=warm_start_limit(time_budget, meta or None, several),  # meta: a resume
        )
        resumed_run = None if resume_checkpoint is None else self.run_dir_of(resume_checkpoint)
        with baseline_demonstrations(agent, policy, self.output_dir, resumed_run) as recorded:
            run = self.parts.start_run(control, recorded)  # with its warm start, if any
        warm_start_seconds = 0.0 if resume_checkpoint is not None else time.perf_counter() - built
        counters = Counters()
        history: list[dict[str, Any]] = []
        if resume_checkpoint is not None:
            history = self._restore(run, resume_checkpoint, counters, earlier)  # last: sets RNGs
        # After the checkpoint is restored (its episodes in progress replayed and checked):
        # a resume refused there leaves the run's files as they were.
        self._write_config()
        self._learning_signal = LearningSignal(agent, history)  # what it said is not said again
        if rank > 0:
            # Its own episodes and samples. A checkpoint holds rank 0's random streams:
            # the other processes derive theirs from the seed, their rank and the update.
            seed = distributed.process_seed(config.training.seed, rank, counters.updates)
            reseed_process(run, seed)

        training = Training(
            run, counters,
            history, deque(counters.recent_returns, maxlen=MOVING_AVERAGE_EPISODES),
            episode_budget, time_budget, resume_checkpoint, several,
            started=time.perf_counter() - warm_start_seconds, seconds_before=counters.seconds,
            warm_start_seconds=warm_start_seconds,
        )
        warn_if_long(warm_start_seconds, time_budget, run.algorithm)
        if self.progress is not None:
            self.progress.start(episode_budget, config.training.minutes, counters.episodes,
                                counters.seconds + warm_start_seconds)
        self._time_used, self._time_budget = training.time_used, time_budget
        return training

    def _should_stop(self, training: Training) -> bool:
        """Before each update: a signal to any process stops them all before the same
        update; else the spent budget."""
        signals = distributed.all_gather(self._signals.received)
        self.stop_signal = next((name for name in signals if name), None)
        counters = training.counters
        return (
            self.stop_signal is not None
            or (training.episode_budget is not None
                and counters.episodes >= training.episode_budget)
            or (training.time_budget is not None and counters.seconds >= training.time_budget)
        )

    def _collect(self, training: Training) -> list[Any] | None:
        """One update's episodes, or None when the collection was cut short (a signal or
        the time budget): then none is trained on, and the random streams go back to the
        last update's, so its checkpoint resumes exactly."""
        engine, algorithm, counters = training.run.engine, training.run.algorithm, training.counters
        training.update_started = time.perf_counter()
        training.steps_before = engine.stats.env_steps
        training.failures_before = engine.stats.env_failures
        # Schedules (e.g. learning-rate annealing) read the share of the budget used
        # before this update.
        training.run.schedule.set_progress(
            budget_fraction(counters, training.episode_budget, training.time_budget)
        )
        wanted = algorithm.episodes_per_update
        watch = CollectionWatch(
            self.progress, self._time_used, self._stop_reason, wanted, not training.several
        )
        before = None if training.several else RandomState.capture(engine)
        carry = self.config.rollout.carry_episodes and algorithm.group_size == 1
        enough = None
        if carry and counters.updates == 0:  # the first ends at its share of the budget
            enough = first_collection_enough(
                self.agent, training.rl_budget(), training.resume_checkpoint is not None
            )
        watch.show()
        try:
            batch = engine.play(
                wanted,
                carry=carry,
                enough=enough,
                policy_version=counters.updates,
                group_size=algorithm.group_size,
                on_episode=watch.on_episode,
                should_stop=watch.should_stop,
            )
        except EnvFailureError as error:
            # The weights are fine: keep them, and say how to go on.
            if not distributed.is_main():
                raise EnvFailureError(
                    f"{error}; every process stops: fix the environment, then "
                    f"continue with --resume {self.output_dir}"
                ) from error
            path = self._checkpoint(training)
            raise EnvFailureError(
                f"{error}; checkpoint written to {path}: fix the environment, "
                f"then continue with --resume {self.output_dir}"
            ) from error
        if watch.reason is None or before is None:
            return batch
        training.seconds_used, training.dropped = training.time_used(), len(batch)
        before.restore(engine)
        logger.warning(
            "%s during the collection of update %d: its %d finished episode(s) (of %d) "
            "are dropped, not trained on; the run ends at update %d",
            stop_cause(watch.reason),
            counters.updates + 1,
            training.dropped,
            wanted,
            counters.updates,
        )
        return None

    def _fit_update_size(self, training: Training) -> None:
        """After the first update: fewer episodes per update where the time budget
        would hold too few (:mod:`.update_size`); the new size in config.yaml."""
        said = fit_to_budget(
            self.agent, training.run.algorithm, training.counters.episodes,
            training.counters.seconds - training.warm_start_seconds, training.rl_budget(),
            resumed=training.resume_checkpoint is not None,
        )
        if said is None:
            return
        logger.warning("%s", said)
        self._write_config()

    def _update(self, training: Training, batch: list[Any]) -> dict[str, float]:
        """The algorithm's update on ``batch``; too many in a row that skipped their
        steps (a non-finite loss or gradient) end the run."""
        algorithm = training.run.algorithm
        self._show_phase("updating")  # until the algorithm reports its epochs
        skipped_before = algorithm.skipped_updates
        release_freed_memory()  # the collection's freed blocks, before the update's peak
        update_metrics = algorithm.update(batch)
        release_freed_memory()
        check_skipped_steps(
            training, algorithm.skipped_updates - skipped_before,
            self.config.training.max_skipped_updates, self._last_checkpoint,
        )
        return update_metrics

    def _record(
        self, training: Training, batch: list[Any], update_metrics: dict[str, float]
    ) -> None:
        """Count the update over every process, and write it down: metrics.jsonl (with
        a diagnosis when the run cannot learn), the transcripts, the loggers' update_end
        hooks, the progress line."""
        agent, config, counters = self.agent, self.config, training.counters
        metrics = count_update(training, batch, update_metrics)
        training.metrics = metrics
        training.history.append({"kind": "update", **metrics})
        diagnoses = self._learning_signal.add(batch, metrics)  # every process: a collective
        training.history.extend(diagnoses)
        if counters.updates == 1:
            warn_if_first_update_moved_far(metrics, config)
        if self._resumed_plugins is not None:
            warn_if_plugins_changed(self._resumed_plugins, agent.plugins.participants())
            self._resumed_plugins = None
        if metrics.get("update_interrupted"):
            logger.warning(
                "update %d was cut short at a minibatch boundary (%s); the weights after "
                "the steps it took are kept",
                counters.updates,
                stop_cause(self._stop_reason()),
            )
        if config.output.rank_records:
            self._record_rank(
                counters.updates, batch, training.run.policy.trainable_parameters()
            )
        if distributed.is_main():
            append_record(self.output_dir / METRICS, {"kind": "update", **metrics})
            for diagnosis in diagnoses:
                append_record(self.output_dir / METRICS, diagnosis)
            self._transcripts.add(
                transcript(agent, episode, "training", counters.updates)
                for episode in batch[:PER_UPDATE]
            )
            with isolated_rng():
                agent.plugins.update_end(agent, counters.updates, metrics, run=self.context)
        if self.progress is not None:
            self.progress.update(counters.episodes, counters.seconds, metrics)
        logger.debug(
            "update %d: %d episodes, return %+.3f (moving average %+.3f), invalid %.1f%%",
            counters.updates,
            counters.episodes,
            metrics["return_mean"],
            metrics["return_moving_average"],
            100 * metrics["invalid_rate"],
        )

    def _finish(self, training: Training) -> RunSummary:
        """After the last checkpoint: (rank 0, unless stopped) the final evaluation
        beside the baselines, and the report."""
        config, counters = self.config, training.counters
        # A signal after the last update still skips the evaluation (no collective follows).
        self.stop_signal = self.stop_signal or self._signals.received
        distributed.barrier()  # every process has finished training; rank 0 goes on alone
        summary = RunSummary(
            self.output_dir,
            counters.episodes,
            counters.updates,
            counters.env_steps,
            counters.seconds if training.seconds_used is None else training.seconds_used,
            last_metrics=training.metrics,
            checkpoint=self._last_checkpoint,
            interrupted=self.stop_signal,
            resumed_from=training.resume_checkpoint,
            greedy=config.training.eval_greedy,
            dropped_episodes=training.dropped,
            policy=training.run.policy,
        )
        if not distributed.is_main():
            return summary
        if self.stop_signal is None and config.training.eval_episodes:
            run = training.run
            engine = make_engine(run.agent, run.policy, config, run.schedule, observe=False)
            summary.evaluation, summary.baselines, record = self._evaluate(counters, engine)
            training.history.append(record)
        self._report(summary, training.history)
        return summary

    def _report(self, summary: RunSummary, history: list[dict[str, Any]]) -> None:
        """report.md and the learning curve from ``history``, when ``output.report``."""
        if not self.config.output.report:
            return
        try:
            files = write_report(self.output_dir, history, self._config_dict)
            summary.report, summary.curve = files.markdown, files.curve
        except Exception as error:  # a failed picture must not lose a finished run
            logger.warning("could not write the report: %s: %s", type(error).__name__, error)

    def _evaluate(
        self, counters: Counters, engine: RolloutEngine
    ) -> tuple[EvalResult, list[EvalResult], dict]:
        """The final evaluation beside the baselines, on ``engine`` (one of its own:
        :func:`~llamagym.training.loop.run_state.make_engine` with ``observe=False``),
        recorded in the run directory."""
        return evaluate_run(
            engine, self.config, self.progress, self._transcripts, self.output_dir, counters
        )


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
