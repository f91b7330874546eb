"""The command that evaluates: ``eval``, a checkpoint or an untrained model beside the
agent's baselines."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.text import Text

from llamagym.cli.app import app, report_plugin_problems
from llamagym.cli.run_commands import configure_logging, resolve_run_config
from llamagym.config import check_episode_memory, deep_merge
from llamagym.config.files import parse_assignment
from llamagym.display import shown
from llamagym.errors import LlamaGymError


def _agent_to_evaluate(
    agent: str,
    checkpoint: Path | None,
    model: str | None,
    mode: str | None,
    seed: int,
    num_envs: int | None,
    assignments: list[str],
    given: dict[str, Any],
    trust_remote_code: bool,
) -> tuple[Any, str, dict[str, str]]:
    """The agent ``llamagym eval`` plays: a checkpoint's, or ``model`` untrained as a run
    would start it; with the heading line and the JSON key that say which. ``given`` is
    ``assignments`` (the ``--set`` lines) parsed."""
    from llamagym.agent import load_agent

    if model is not None:
        flags = {
            "model.name": model, "rollout.mode": mode, "rollout.num_envs": num_envs,
            "training.seed": seed, "model.trust_remote_code": trust_remote_code or None,
        }
        agent_class, resolved = resolve_run_config(agent, None, assignments, flags)
        return agent_class(config=resolved), f"model {shown(model)} untrained (zero-shot)", {
            "model": model
        }
    overrides = deep_merge(given, {"training": {"seed": seed}})
    if num_envs is not None:
        overrides = deep_merge(overrides, {"rollout": {"num_envs": num_envs}})
    if mode is not None:
        overrides = deep_merge(overrides, {"rollout": {"mode": mode}})
    assert checkpoint is not None, "eval_command gives a checkpoint or a model"
    loaded = load_agent(
        checkpoint, overrides=overrides, agent=agent, trust_remote_code=trust_remote_code
    )
    directory, meta = loaded.checkpoint, loaded.checkpoint_meta
    assert directory is not None and meta is not None, "load_agent() records its checkpoint"
    heading = (
        f"checkpoint {shown(directory)}: update {meta.get('update', '?')}, "
        f"{meta.get('episodes', 0):,} training episodes"
    )
    return loaded, heading, {"checkpoint": str(directory)}


@app.command(
    "eval",
    help="Evaluate a checkpoint, or a model untrained (--model): mean return with a 95% CI, "
    "beside the baselines.\n\n"
    # One line per paragraph: the help keeps a later paragraph's line breaks.
    "A progress bar on stderr shows the episodes played, when stderr is a terminal and "
    "neither --quiet nor --set output.quiet=true is given; --json output on stdout is "
    "the JSON alone.",
)
def eval_command(
    agent: str = typer.Argument(..., help="Agent name."),
    checkpoint: Path = typer.Option(
        None, "--checkpoint", help="A run directory (its newest checkpoint) or a checkpoint."
    ),
    model: str = typer.Option(
        None,
        "--model",
        "-m",
        help="Instead of a checkpoint: this model untrained (zero-shot), as a run would "
        "start it ('tiny', a registry name, a Hub id or a local dir).",
    ),
    mode: str = typer.Option(None, "--mode", help="score or generate (default: the agent's)."),
    episodes: int = typer.Option(1000, "--episodes", "-n", min=1, help="Evaluation episodes."),
    greedy: bool = typer.Option(True, "--greedy/--sample", help="Argmax or sampled actions."),
    seed: int = typer.Option(0, "--seed", help="Seed of the evaluation episodes."),
    num_envs: int = typer.Option(None, "--num-envs", min=1, help="Environments in lockstep."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    quiet: bool = typer.Option(
        False, "--quiet", "-q", help="No progress bar; warnings only (also output.quiet)."
    ),
    assignments: list[str] = typer.Option(
        [],
        "--set",
        help="KEY=VALUE over the checkpoint's config (with --model: over the agent's "
        "defaults), e.g. model.dtype=bfloat16",
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the checkpoint's model run Python code of its own (never taken from the "
        "checkpoint; only for a model whose code you trust).",
    ),
) -> None:
    """Evaluate a checkpoint or an untrained model (the help text is above)."""
    _check_one_subject(checkpoint, model)
    check_episode_memory(episodes, "--episodes")  # before the model loads
    report_plugin_problems()
    given: dict[str, Any] = {}
    for assignment in assignments:
        given = deep_merge(given, parse_assignment(assignment))
    agent_object, heading, evaluated = _agent_to_evaluate(
        agent, checkpoint, model, mode, seed, num_envs, assignments, given, trust_remote_code
    )
    # Only this command's own --quiet or --set: a checkpoint trained with --quiet (CI)
    # does not silence a later evaluation.
    quiet = quiet or bool(given.get("output", {}).get("quiet"))
    status = Console(stderr=True)
    configure_logging(status, quiet=as_json or quiet, verbose=False)

    from llamagym.training.loop.final_evaluation import evaluate_with_baselines
    from llamagym.training.loop.progress import EvaluationProgress

    display = contextlib.nullcontext() if quiet else EvaluationProgress(status)
    with display as progress:
        result, baselines = evaluate_with_baselines(
            agent_object.evaluation_engine(), episodes, seed, greedy=greedy,
            on_progress=progress,
        )
    if as_json:
        typer.echo(json.dumps({
            **evaluated, "mode": agent_object.config.rollout.mode, "greedy": greedy,
            "seed": seed,
            **result.as_dict(), "baselines": [b.as_dict() for b in baselines],
        }, indent=2))
        return
    _print_results(agent, heading, agent_object.config.rollout.mode, seed, result, baselines,
                   greedy=greedy, untrained=model is not None)
    if model is not None:
        from llamagym.training.loop.learning_signal import before_training

        nothing_to_learn = before_training(agent_object, result, baselines)
        if nothing_to_learn is not None:
            Console().print(Text(nothing_to_learn))


def _check_one_subject(checkpoint: Path | None, model: str | None) -> None:
    """``eval`` evaluates a checkpoint or a model, exactly one of them."""
    if (checkpoint is None) == (model is None):
        raise LlamaGymError(
            "give --checkpoint RUN_DIR to evaluate a trained agent, or --model NAME to "
            "evaluate a model untrained (zero-shot), not both"
            if checkpoint is not None
            else "nothing to evaluate: give --checkpoint RUN_DIR (a trained agent) or "
            "--model NAME (a model untrained, zero-shot; e.g. --model smollm2-135m)"
        )


def _print_results(
    agent: str, heading: str, mode: str, seed: int, result: Any, baselines: list[Any], *,
    greedy: bool, untrained: bool,
) -> None:
    """The evaluation as a table beside the baselines, and the agent's line below it."""
    from llamagym.training.loop.progress import evaluation_table

    console = Console()
    console.print(f"[bold]{shown(agent)}[/] {heading}, {mode} mode; evaluation seed {seed}")
    label = "untrained model" if untrained else "trained agent"
    console.print(evaluation_table(result, baselines, greedy=greedy, agent_label=label))
    interval = (
        f"all {result.episodes:,} episodes identical (no CI)"
        if result.identical
        else f"95% CI [{result.mean - result.ci95:+.3f}, {result.mean + result.ci95:+.3f}]"
    )
    console.print(
        f"agent: mean return {result.mean:+.3f}, {interval}, "
        f"invalid replies {result.invalid_rate:.2%}"
    )
