"""``llamagym record``: demonstrations from an agent's baseline, for the SFT warm-start."""

from __future__ import annotations

from pathlib import Path

import typer

from llamagym.cli.app import app
from llamagym.cli.run_commands import resolve_run_config
from llamagym.config import check_episode_memory, check_seed


@app.command("record")
def record_command(
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    baseline: str = typer.Option(..., "--baseline", "-b", help="One of the agent's baselines."),
    output: Path = typer.Option(..., "--output", "-o", help="The JSONL file to write."),
    episodes: int = typer.Option(1000, "--episodes", "-n", min=1, help="Episodes to play."),
    seed: int = typer.Option(0, "--seed", help="Seed of the recorded episodes."),
    model: str = typer.Option(
        None, "--model", "-m",
        help="The model the run will train: its defaults shape the prompts (and the mode).",
    ),
    mode: str = typer.Option(
        None, "--mode", help="score or generate: the run's mode (default: the agent's)."
    ),
    outcome: list[str] = typer.Option(
        [], "--outcome", help="Keep only episodes with this outcome (repeatable), e.g. won."
    ),
    config_file: Path = typer.Option(None, "--config", "-c", help="YAML/TOML/JSON config."),
    assignments: list[str] = typer.Option([], "--set", help="KEY=VALUE, e.g. agent.games=20"),
) -> None:
    """Play one of the agent's baselines and write each decision as a demonstration:
    the conversation the model sees in the run's mode, answered with the baseline's
    action (in score mode, with the legal actions it was chosen from). Train on it
    first with `--set algorithm.warm_start.demonstrations=FILE`, the same --model and
    --mode; `llamagym run AGENT --warm-start NAME` records a baseline's successful
    episodes and trains on them in one step."""
    from llamagym.rollout.demonstrations import check_recording, record_demonstrations

    check_seed(seed, "--seed")
    check_episode_memory(episodes, "--episodes")  # every demonstration is held until written
    # The prompts are the ones the run renders: its model's defaults and its mode.
    flags = {key: value for key, value in (("model.name", model), ("rollout.mode", mode))
             if value is not None}
    agent_class, resolved = resolve_run_config(agent, config_file, assignments, flags)
    task = agent_class(config=resolved)
    check_recording(task, baseline, outcome)
    # An engine that only renders prompts: no run, no algorithm, no warm start.
    engine = task.evaluation_engine(1)
    try:
        recording = record_demonstrations(
            engine, baseline, episodes, output, seed=seed, outcomes=outcome
        )
    finally:
        engine.close()
    kept = f"{recording.kept_episodes:,} of " if outcome else ""
    typer.echo(
        f"{recording.demonstrations:,} demonstrations from {kept}{recording.episodes:,} "
        f"episodes of {baseline!r} (mean return {recording.mean_return:+.3f}) written to "
        f"{recording.path}"
    )
    if outcome and not recording.demonstrations:
        typer.echo(f"no episode ended {' or '.join(outcome)}: play more (--episodes)", err=True)
    typer.echo(f"train on them first: --set algorithm.warm_start.demonstrations={recording.path}")
