"""``llamagym report``: rebuild a run's report.md and learning_curve.png from its files."""

from __future__ import annotations

from pathlib import Path

import typer

from llamagym.cli.app import app
from llamagym.errors import LlamaGymError


@app.command("report")
def report_command(
    run_dir: Path = typer.Argument(..., help="A run directory (holding metrics.jsonl)."),
) -> None:
    """Regenerate report.md and learning_curve.png from metrics.jsonl and config.yaml."""
    from llamagym.training.checkpoint.store import META, run_dir_of
    from llamagym.training.records.report import METRICS, write_report

    if (run_dir / META).is_file():  # a checkpoint was given: use the run it belongs to
        run_dir = run_dir_of(run_dir)
    if not (run_dir / METRICS).is_file():
        raise LlamaGymError(
            f"{str(run_dir)!r} holds no {METRICS}; pass the directory of a run "
            "(`llamagym run ... --output DIR`)"
        )
    files = write_report(run_dir)
    typer.echo(f"report: {files.markdown}")
    if files.curve is not None:
        typer.echo(f"learning curve: {files.curve}")
