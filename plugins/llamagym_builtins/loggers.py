"""The built-in metric loggers, plugins on the ``update_end`` / ``episode_end`` hooks.

* ``tensorboard-logger``: scalars in ``<run>/tensorboard/`` when the ``tensorboard``
  package is installed and ``output.tensorboard`` is on (the default).
* ``wandb-logger``: Weights & Biases, only when ``WANDB_PROJECT`` is set; ``wandb`` is
  never imported otherwise, so a default run makes no network call.

``metrics.jsonl`` (one line per update, fields in :mod:`llamagym.training.records.report`) is not a
plugin: the trainer writes it, and the report is made from it.

Each takes the run directory from the hook's ``run`` argument
(:class:`~llamagym.plugin_runtime.registry.RunContext`) and does nothing when it is
``None``: for an agent driven outside a run (``Agent.act``) and on ranks other than 0.
Any of them can be turned off like any plugin: ``LLAMAGYM_DISABLE_PLUGINS=tensorboard-logger``.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

from llamagym.display import code_block
from llamagym.plugin_runtime.hookspecs import hookimpl
from llamagym.plugin_runtime.registry import RunContext

logger = logging.getLogger(__name__)


class TensorBoardLogger:
    """Scalars per update (x axis: training episodes) and a histogram of the returns
    of the episodes each update trained on."""

    def __init__(self) -> None:
        self._writers: dict[Path, Any] = {}
        # Per run directory, so episodes of one run never land in another's histogram.
        self._returns: dict[Path, list[float]] = {}
        self._warned = False
        atexit.register(self.close)

    def _writer(self, run_dir: Path, first_step: int) -> Any:
        writer = self._writers.get(run_dir)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step drops events a crashed run wrote past the checkpoint that
            # this (resumed) run starts from, so the curves carry no duplicates.
            writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=first_step)
            self._writers[run_dir] = writer
        return writer

    @staticmethod
    def _enabled(agent: Any) -> bool:
        output = getattr(getattr(agent, "config", None), "output", None)
        return bool(getattr(output, "tensorboard", False))

    @hookimpl
    def llamagym_episode_end(self, agent: Any, episode: Any, run: RunContext) -> None:
        if run.run_dir is not None and not run.evaluation and self._enabled(agent):
            self._returns.setdefault(run.run_dir, []).append(float(episode.env_return))

    @hookimpl
    def llamagym_update_end(
        self, agent: Any, update: int, metrics: dict[str, float], run: RunContext
    ) -> None:
        run_dir = run.run_dir
        if run_dir is None or not self._enabled(agent):
            return
        if importlib.util.find_spec("tensorboard") is None:
            if not self._warned:
                logger.info("tensorboard is not installed; pip install tensorboard for curves")
                self._warned = True
            return
        import numpy as np

        step = int(metrics.get("total_episodes", update))
        writer = self._writer(run_dir, step)
        for key, value in metrics.items():
            if isinstance(value, (int, float)):
                writer.add_scalar(f"train/{key}", value, step)
        returns = np.asarray(self._returns.pop(run_dir, []), dtype=float)
        returns = returns[np.isfinite(returns)]  # a NaN reward must not break the logger
        if returns.size:
            writer.add_histogram("train/episode_return", returns, step)
        from llamagym.training.records.transcripts import render

        texts = [render(record) for record in update_transcripts(run_dir, update)]
        if texts:  # markdown: each transcript as a code block it cannot close
            blocks = ("\n".join(code_block(text)) for text in texts)
            writer.add_text("transcripts", "\n\n".join(blocks), step)
        writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()


def update_transcripts(run_dir: Path, update: int) -> list[dict[str, Any]]:
    """The transcripts the trainer kept for ``update`` (written before the loggers run)."""
    from llamagym.training.records.run_files import read_transcripts
    from llamagym.training.records.transcripts import TRANSCRIPTS

    return [
        record for record in read_transcripts(run_dir / TRANSCRIPTS, on_damage="skip")
        if record.get("update") == update and record.get("kind") == "training"
    ]


class WandbLogger:
    """Logs each update to W&B when ``WANDB_PROJECT`` is set (``WANDB_ENTITY``,
    ``WANDB_MODE=offline`` and the rest of wandb's own variables apply as usual)."""

    def __init__(self) -> None:
        self._runs: dict[Path, Any] = {}
        self._unavailable = False
        atexit.register(self.close)

    @hookimpl
    def llamagym_update_end(
        self, agent: Any, update: int, metrics: dict[str, float], run: RunContext
    ) -> None:
        project = os.environ.get("WANDB_PROJECT")
        run_dir = run.run_dir
        if not project or run_dir is None or self._unavailable:
            return
        wandb_run = self._runs.get(run_dir)
        if wandb_run is None:
            try:
                import wandb
            except ImportError:
                logger.warning(
                    "WANDB_PROJECT is set but wandb is not installed (pip install wandb); "
                    "W&B logging is off for this run"
                )
                self._unavailable = True
                return
            wandb_run = wandb.init(
                project=project,
                name=run_dir.name,
                dir=str(run_dir),
                config=agent.config.model_dump(mode="json"),
            )
            self._runs[run_dir] = wandb_run
        logged: dict[str, Any] = dict(metrics)
        records = update_transcripts(run_dir, update)
        if records:
            import wandb

            from llamagym.training.records.transcripts import render

            logged["transcripts"] = wandb.Table(
                columns=["update", "kind", "seed", "return", "transcript"],
                data=[[r.get("update"), r.get("kind"), r.get("seed"), r.get("return"),
                       render(r)] for r in records],
            )
        wandb_run.log(logged, step=update)

    def close(self) -> None:
        for run in self._runs.values():
            run.finish()
        self._runs.clear()


tensorboard_logger = TensorBoardLogger()
wandb_logger = WandbLogger()
