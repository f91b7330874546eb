"""The end of a run: the trained agent and each of its baselines on the same seeded
episodes, the evaluation's line in metrics.jsonl and its transcripts."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llamagym.config import check_episode_memory
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.evaluation import EvalResult, evaluate_agent, evaluate_baseline
from llamagym.training.loop.run_state import Counters
from llamagym.training.records.report import METRICS, append_record
from llamagym.training.records.transcripts import PER_UPDATE, TranscriptLog, transcript


def evaluate_run(
    engine: RolloutEngine,
    config: Any,
    progress: Any,
    transcripts: TranscriptLog,
    output_dir: Path,
    counters: Counters,
) -> tuple[EvalResult, list[EvalResult], dict]:
    """The final evaluation of a run that stands at ``counters`` on ``engine`` (one of
    its own, closed at the end), beside the baselines,
    shown on ``progress`` when it can show one; its record is appended to the run's
    metrics and returned with the results."""
    started = time.perf_counter()
    played: list[Any] = []
    # A progress display that can show an evaluation (RunProgress) gets a bar for it.
    display = getattr(progress, "evaluation", None)
    with display() if display is not None else contextlib.nullcontext() as on_progress:
        result, baselines = evaluate_with_baselines(
            engine,
            config.training.eval_episodes,
            config.training.seed,
            greedy=config.training.eval_greedy,
            examples=played,
            on_progress=on_progress,
            # A run with a time budget gives its evaluation as long again, at most.
            seconds=60 * config.training.minutes if config.training.minutes else None,
        )
    transcripts.add(
        transcript(engine.agent, episode, "evaluation", counters.updates)
        for episode in played[:PER_UPDATE]
    )
    record = {
        "kind": "evaluation",
        "update": counters.updates,
        "total_episodes": counters.episodes,
        "seconds": time.perf_counter() - started,
        "greedy": config.training.eval_greedy,
        **result.as_dict(),
        "baselines": [b.as_dict() for b in baselines],
    }
    append_record(output_dir / METRICS, record)
    return result, baselines, record


def evaluate_with_baselines(
    engine: RolloutEngine,
    episodes: int,
    seed: int,
    greedy: bool = True,
    examples: list | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
    seconds: float | None = None,
) -> tuple[EvalResult, list[EvalResult]]:
    """The policy on ``engine`` (one of its own, closed at the end) and each of its
    task's baselines on the same ``episodes`` seeded episodes
    (``examples`` receives the agent's episodes). ``on_progress`` is told ``(policy,
    finished, episodes)`` as each one plays, ``policy`` being ``"agent"`` or the
    baseline's name (e.g. :class:`llamagym.training.loop.progress.EvaluationProgress`).
    ``seconds`` bounds the agent's evaluation (:func:`evaluate_agent`)."""
    check_episode_memory(episodes, "the evaluation's episodes")

    def progress_of(name: str) -> Callable[[int, int], None] | None:
        if on_progress is None:
            return None
        report = on_progress
        return lambda finished, total: report(name, finished, total)

    played: list = []
    agent = engine.agent
    result = evaluate_agent(
        engine,
        episodes,
        seed=seed,
        greedy=greedy,
        examples=played,
        on_progress=progress_of("agent"),
        seconds=seconds,
    )
    if examples is not None:
        examples += played
    # The baselines play the very episodes the agent finished (all of them, unless the
    # time budget cut the evaluation short).
    seeds = None if len(played) == episodes else sorted(e.seed for e in played)
    baselines = [
        evaluate_baseline(agent, name, episodes, seed=seed, on_progress=progress_of(name),
                          seeds=seeds)
        for name in agent.baselines
    ]
    return result, baselines
