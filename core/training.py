"""One training run: collect episodes, update, log, checkpoint, evaluate, summarise."""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from llamagym.checkpoint import save_checkpoint
from llamagym.evaluation import EvalResult, evaluate_agent, evaluate_baseline

logger = logging.getLogger(__name__)

DEFAULT_EPISODES = 1000


@dataclass
class RunSummary:
    output_dir: Path
    episodes: int
    updates: int
    env_steps: int
    seconds: float
    evaluation: EvalResult | None = None
    baselines: list[EvalResult] = field(default_factory=list)
    last_metrics: dict[str, float] = field(default_factory=dict)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_output_dir(agent_name: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{agent_name or 'agent'}-{stamp}"


class Trainer:
    def __init__(self, agent: Any, progress: Any = None):
        self.agent = agent
        self.config = agent.config
        self.progress = progress
        self.output_dir = Path(self.config.output.dir or default_output_dir(self.config.agent.name))

    def run(self) -> RunSummary:
        config, agent = self.config, self.agent
        if config.training.threads:
            torch.set_num_threads(config.training.threads)
        seed_everything(config.training.seed)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(
            yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
        )
        algorithm = agent.algorithm
        engine = agent.engine
        envs = [agent.make_env() for _ in range(config.rollout.num_envs)]
        episode_budget = config.training.episodes
        if episode_budget is None and config.training.minutes is None:
            episode_budget = DEFAULT_EPISODES
        deadline = (
            time.perf_counter() + 60 * config.training.minutes
            if config.training.minutes
            else None
        )
        started = time.perf_counter()
        episodes_seen = updates = 0
        recent: deque[float] = deque(maxlen=500)
        metrics: dict[str, float] = {}
        log_path = self.output_dir / "metrics.jsonl"
        progress = self.progress
        if progress is not None:
            progress.start(episode_budget, config.training.minutes)
        try:
            with log_path.open("w") as log:
                while True:
                    if episode_budget is not None and episodes_seen >= episode_budget:
                        break
                    if deadline is not None and time.perf_counter() >= deadline:
                        break
                    batch = engine.collect(
                        envs, algorithm.episodes_per_update, group_size=algorithm.group_size
                    )
                    metrics = algorithm.update(batch)
                    updates += 1
                    episodes_seen += len(batch)
                    recent.extend(e.env_return for e in batch)
                    elapsed = time.perf_counter() - started
                    metrics.update(
                        update=float(updates),
                        total_episodes=float(episodes_seen),
                        env_steps=float(engine.stats.env_steps),
                        env_steps_per_second=engine.stats.env_steps / max(elapsed, 1e-9),
                        return_moving_average=float(np.mean(recent)),
                        env_failures=float(engine.stats.env_failures),
                        seconds=elapsed,
                    )
                    log.write(json.dumps({"kind": "update", **metrics}) + "\n")
                    log.flush()
                    agent.plugins.update_end(agent, updates, metrics)
                    if progress is not None:
                        progress.update(episodes_seen, elapsed, metrics)
                    else:
                        logger.info(
                            "update %d: episodes %d, return(ma) %+.3f, invalid %.1f%%",
                            updates,
                            episodes_seen,
                            metrics["return_moving_average"],
                            100 * metrics["invalid_rate"],
                        )
        finally:
            if progress is not None:
                progress.stop()
            for env in envs:
                env.close()
        seconds = time.perf_counter() - started
        save_checkpoint(
            agent.policy,
            self.output_dir / "checkpoint",
            {
                "agent": config.agent.name,
                "algorithm": config.algorithm.name,
                "model": config.model.name,
                "updates": updates,
                "episodes": episodes_seen,
                "config": config.model_dump(mode="json"),
            },
        )
        summary = RunSummary(
            self.output_dir, episodes_seen, updates, engine.stats.env_steps, seconds,
            last_metrics=metrics,
        )
        if config.training.eval_episodes:
            summary.evaluation, summary.baselines = evaluate_with_baselines(
                agent, config.training.eval_episodes, config.training.seed
            )
            with log_path.open("a") as log:
                record = {"kind": "evaluation", **summary.evaluation.as_dict()}
                record["baselines"] = [b.as_dict() for b in summary.baselines]
                log.write(json.dumps(record) + "\n")
        return summary


def evaluate_with_baselines(
    agent: Any, episodes: int, seed: int
) -> tuple[EvalResult, list[EvalResult]]:
    result = evaluate_agent(agent, episodes, seed=seed, greedy=True)
    baselines = [evaluate_baseline(agent, name, episodes, seed=seed) for name in agent.baselines]
    return result, baselines
