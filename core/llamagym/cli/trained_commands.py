"""``llamagym export`` (a trained agent as a standard transformers/peft directory) and
``llamagym play`` (watch it act, as transcripts)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.text import Text

from llamagym.cli.app import app, report_plugin_problems
from llamagym.config import check_episode_memory
from llamagym.display import printable
from llamagym.errors import LlamaGymError
from llamagym.training.records.run_files import read_metrics, read_transcripts
from llamagym.training.records.transcripts import TRANSCRIPTS, render, transcript


@app.command("export")
def export_command(
    run: Path = typer.Argument(..., help="A run directory, or one of its checkpoints."),
    to: Path = typer.Option(..., "--to", help="The directory to write (new or empty)."),
    checkpoint: int = typer.Option(
        None, "--checkpoint", min=0, help="The update whose checkpoint to export (default: newest)."
    ),
    merge: bool = typer.Option(
        False, "--merge", help="Merge a LoRA adapter into the base model (one standalone model)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace the files an export writes, and delete the other kind's model files "
        "(adapter vs whole model); other files in DIR stay.",
    ),
) -> None:
    """Write a trained agent as a directory plain transformers (and peft) load: the LoRA
    adapter or the whole model, the tokenizer with its chat template, the run's sampling
    settings, the value head, and a model card with its evaluation beside the baselines."""
    from llamagym.agent import load_agent
    from llamagym.training.checkpoint import store as checkpoints
    from llamagym.training.records.export import check_export_target, export_agent
    from llamagym.training.records.report import METRICS

    report_plugin_problems()
    check_export_target(to, overwrite)  # before the model loads
    source = run
    if checkpoint is not None:
        source = checkpoints.run_dir_of(checkpoints.find_checkpoint(run)) / (
            f"{checkpoints.CHECKPOINTS}/{checkpoints.checkpoint_name(checkpoint)}"
        )
        if not source.is_dir():
            raise LlamaGymError(
                f"{str(run)!r} has no checkpoint of update {checkpoint}; its checkpoints: "
                + ", ".join(p.name for p in checkpoints.list_checkpoints(source.parents[1]))
            )
    # The weights as trained: a frozen trunk kept in bfloat16 for speed is rounded, and
    # an export is a model for elsewhere.
    agent = load_agent(source, overrides={"model": {"trunk_dtype": "float32"}})
    meta = agent.checkpoint_meta or {}
    update = meta.get("update")
    metrics = checkpoints.run_dir_of(agent.checkpoint or source) / METRICS
    evaluations = [
        record for record in read_metrics(metrics)
        if record.get("kind") == "evaluation" and record.get("update") == update
    ]
    directory = export_agent(
        agent,
        agent.policy,
        to,
        merge=merge,
        evaluation=evaluations[-1] if evaluations else None,
        training=meta.get("counters"),
        overwrite=overwrite,
    )
    typer.echo(f"exported {agent.config.agent.name} (update {update}) to {printable(directory)}")


@app.command("play")
def play_command(
    run: Path = typer.Argument(..., help="A run directory, a checkpoint or an export."),
    episodes: int = typer.Option(3, "--episodes", "-n", min=1, help="Episodes to play."),
    greedy: bool = typer.Option(True, "--greedy/--sample", help="Argmax or sampled actions."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the episodes."),
    kept: bool = typer.Option(
        False, "--kept", help="Print the last N transcripts the run kept instead of playing."
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the run's model run Python code of its own (never taken from the run; "
        "only for a model whose code you trust).",
    ),
) -> None:
    """Play a trained agent and print each episode as a transcript: the system prompt,
    every observation, the model's reply (or the chosen action's probability), the
    action, the reward, and the return. What the model and the env wrote is shown with
    its control characters escaped; with --kept a damaged transcript is skipped with
    one warning."""
    import torch

    from llamagym.agent import load_agent
    from llamagym.rollout.evaluation import evaluation_seeds

    console = Console()
    if kept:
        path = run / TRANSCRIPTS
        records = read_transcripts(path, on_damage="skip", keep_last=episodes)
        if not records:
            held = "no transcript that can be read" if path.is_file() else f"no {TRANSCRIPTS}"
            raise LlamaGymError(f"{str(run)!r} holds {held}; pass a run directory")
        for record in records:
            console.print(Text(render(record)), soft_wrap=True)
            console.print()
        return
    check_episode_memory(episodes, "--episodes")  # played, then printed: held at once
    report_plugin_problems()
    agent = load_agent(
        run, overrides={"rollout": {"num_envs": 1}}, trust_remote_code=trust_remote_code
    )
    engine = agent.evaluation_engine()  # one env: the run's num_envs is overridden above
    agent.policy.eval()
    try:
        with torch.no_grad():
            played = engine.play(episodes, greedy=greedy, seeds=evaluation_seeds(seed, episodes))
    finally:
        engine.close()
    update = (agent.checkpoint_meta or {}).get("update", 0)
    for episode in played:
        console.print(Text(render(transcript(agent, episode, "played", update))), soft_wrap=True)
        console.print()
