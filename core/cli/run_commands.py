"""Commands that train and evaluate: ``run`` and ``eval``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from llamagym.cli.app import app, report_plugin_problems
from llamagym.errors import LlamaGymError


def resolve_run_config(agent_name: str, config_file: Path | None, assignments: list[str],
                       flags: dict[str, Any]) -> tuple[Any, Any]:
    """Agent class and validated RunConfig, from every layer in precedence order."""
    from llamagym.agent import make_algorithm_config
    from llamagym.config import build_config, parse_assignment, read_config_file
    from llamagym.plugin_manager import get_plugins

    plugins = get_plugins()
    report_plugin_problems()
    agent_class = plugins.get("agent", agent_name).load()
    layers: list[dict[str, Any]] = [{"agent": {"name": agent_name}}, dict(agent_class.defaults)]
    if config_file is not None:
        layers.append(read_config_file(config_file))
    layers += [parse_assignment(assignment) for assignment in assignments]
    flag_layer: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is not None:
            section, key = dotted.split(".")
            flag_layer.setdefault(section, {})[key] = value
    layers.append(flag_layer)
    config = build_config(*layers)
    make_algorithm_config(config, plugins)  # unknown algorithm or bad keys fail here
    return agent_class, config


@app.command("run")
def run_command(
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    algorithm: str = typer.Option(None, "--algorithm", "-a", help="Algorithm name."),
    model: str = typer.Option(None, "--model", "-m", help="'tiny', a Hub id or a local dir."),
    mode: str = typer.Option(None, "--mode", help="score or generate."),
    episodes: int = typer.Option(None, "--episodes", "-n", help="Training episodes."),
    minutes: float = typer.Option(None, "--minutes", help="Wall-clock training budget."),
    num_envs: int = typer.Option(None, "--num-envs", help="Environments in lockstep."),
    seed: int = typer.Option(None, "--seed", help="Random seed."),
    eval_episodes: int = typer.Option(None, "--eval-episodes", help="Greedy eval episodes."),
    output: Path = typer.Option(None, "--output", "-o", help="Run directory."),
    config_file: Path = typer.Option(None, "--config", "-c", help="YAML/TOML/JSON config."),
    assignments: list[str] = typer.Option([], "--set", help="KEY=VALUE, e.g. algorithm.lr=1e-4"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Train AGENT online, then evaluate it greedily beside its baselines."""
    from rich.console import Console

    flags = {
        "algorithm.name": algorithm, "model.name": model, "rollout.mode": mode,
        "training.episodes": episodes, "training.minutes": minutes,
        "rollout.num_envs": num_envs, "training.seed": seed,
        "training.eval_episodes": eval_episodes, "output.dir": output,
        "output.quiet": quiet or None,
    }
    if minutes is not None and episodes is None:
        flags["training.episodes"] = None
        assignments = [*assignments, "training.episodes=null"]
    agent_class, config = resolve_run_config(agent, config_file, assignments, flags)

    from llamagym.progress import RunProgress, summary_table
    from llamagym.training import Trainer

    console = Console()
    console.print(
        f"[bold]llamagym run {agent}[/]: algorithm {config.algorithm.name}, model "
        f"{config.model.name}, mode {config.rollout.mode}, {config.rollout.num_envs} envs"
    )
    agent_object = agent_class(config=config)
    trainer = Trainer(agent_object, progress=None if config.output.quiet else RunProgress())
    summary = trainer.run()
    console.print(
        f"trained {summary.episodes} episodes ({summary.env_steps} env steps, "
        f"{summary.updates} updates) in {summary.seconds:.0f}s; run saved to {summary.output_dir}"
    )
    if summary.evaluation is not None:
        console.print(summary_table(summary))


@app.command("eval")
def eval_command(
    agent: str = typer.Argument(..., help="Agent name."),
    checkpoint: Path = typer.Option(..., "--checkpoint", help="A run's checkpoint directory."),
    episodes: int = typer.Option(1000, "--episodes", "-n", help="Evaluation episodes."),
    greedy: bool = typer.Option(True, "--greedy/--sample", help="Argmax or sampled actions."),
    seed: int = typer.Option(0, "--seed", help="Seed of the evaluation episodes."),
) -> None:
    """Evaluate a checkpoint: mean return with a 95% CI, beside the baselines."""
    from rich.console import Console

    from llamagym.checkpoint import load_checkpoint, read_meta
    from llamagym.config import build_config
    from llamagym.evaluation import evaluate_agent, evaluate_baseline
    from llamagym.progress import summary_table
    from llamagym.training import RunSummary

    meta = read_meta(checkpoint)
    if meta.get("agent") != agent:
        raise LlamaGymError(
            f"checkpoint {str(checkpoint)!r} was trained for agent {meta.get('agent')!r}, "
            f"not {agent!r}"
        )
    from llamagym.plugin_manager import get_plugins

    agent_class = get_plugins().get("agent", agent).load()
    config = build_config(meta["config"])
    agent_object = agent_class(config=config)
    load_checkpoint(agent_object.policy, checkpoint)
    result = evaluate_agent(agent_object, episodes, seed=seed, greedy=greedy)
    baselines = [evaluate_baseline(agent_object, name, episodes, seed) for name in agent_class.baselines]
    summary = RunSummary(checkpoint, 0, 0, 0, 0.0, result, baselines)
    Console().print(summary_table(summary))
    Console().print(f"invalid replies: {result.invalid_rate:.2%}")
