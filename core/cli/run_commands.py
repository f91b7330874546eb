"""Commands that train and evaluate: ``run`` and ``eval``."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import typer

from llamagym.cli.app import app, report_plugin_problems
from llamagym.errors import LlamaGymError

#: Exit codes of a run stopped by a signal, as a shell reports them (128 + signal).
SIGNAL_EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143}


def command_line_layers(
    config_file: Path | None, assignments: list[str], flags: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The layers a command line gives, lowest precedence first: the ``--config`` file,
    each ``--set``, then the typed flags (those not given are left out)."""
    from llamagym.config import parse_assignment, read_config_file

    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file is not None:
        layers.append((f"file {config_file}", read_config_file(config_file)))
    layers += [("--set", parse_assignment(assignment)) for assignment in assignments]
    flag_layer: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is not None:
            section, key = dotted.split(".")
            flag_layer.setdefault(section, {})[key] = value
    layers.append(("flag", flag_layer))
    return layers


def resolve_run_config(
    agent_name: str,
    config_file: Path | None,
    assignments: list[str],
    flags: dict[str, Any],
    base: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Agent class and :class:`~llamagym.config.ResolvedConfig` of a command line.

    ``base`` (a resumed checkpoint's config) replaces the agent's defaults: a resumed
    run continues with the settings it was trained with unless told otherwise.
    Everything is validated here, before a model or an environment loads: a bad value
    anywhere is a ``ConfigError`` naming each problem on its own line.
    """
    from llamagym.plugin_manager import get_plugins
    from llamagym.run import resolve_agent_config

    plugins = get_plugins()
    report_plugin_problems()
    agent_class = plugins.get("agent", agent_name).load()
    later = command_line_layers(config_file, assignments, flags)
    later.insert(0, ("argument", {"agent": {"name": agent_name}}))
    resolved = resolve_agent_config(agent_class, later, base=base, plugins=plugins)
    return agent_class, resolved


def configure_logging(console: Any, quiet: bool, verbose: bool) -> None:
    """Log lines through rich on ``console``, so they print above the live progress bar
    instead of tearing through it; ``--quiet`` keeps warnings only, ``--verbose`` adds a
    line per update."""
    from rich.logging import RichHandler

    root = logging.getLogger()
    for handler in list(root.handlers):
        # Replace the plain stderr handler of logging.basicConfig (and ours from an
        # earlier command in this process); leave any other handler alone.
        plain = type(handler) is logging.StreamHandler and handler.stream is sys.stderr
        if plain or getattr(handler, "_llamagym_cli", False):
            root.removeHandler(handler)
    handler = RichHandler(console=console, show_path=False, show_time=False, markup=False)
    handler._llamagym_cli = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    logging.getLogger("llamagym").setLevel(level)
    if quiet:
        import transformers

        transformers.utils.logging.disable_progress_bar()


def command_words(context: typer.Context, leave_out: set[str]) -> list[str]:
    """The command's arguments and options as given, without the parameters named in
    ``leave_out``: what a launched process runs again."""
    words: list[str] = []
    for parameter in context.command.params:
        value = context.params.get(parameter.name)
        if parameter.name in leave_out or value is None or value is False or value == []:
            continue
        if parameter.param_type_name == "argument":
            words.append(str(value))
        elif getattr(parameter, "is_flag", False):  # an option (typer's or click's class)
            words.append(parameter.opts[0])
        elif parameter.multiple:
            for item in value:
                words += [parameter.opts[0], str(item)]
        else:
            words += [parameter.opts[0], str(value)]
    return words


def launch_processes(count: int, run_arguments: list[str]) -> int:
    """``llamagym run RUN_ARGUMENTS`` in ``count`` processes through accelerate's
    launcher (torchrun underneath; on a machine without GPUs every process runs on the
    CPU and they talk over gloo); returns the exit code of the run.

    The launcher runs in this process rather than as ``python -m accelerate...``: run as
    a program it ends any failed run with exit code 1 and a traceback, while here the
    failed process's own exit code (2 for a bad input, 130/143 after a signal) is
    passed on and its own one-line message is all that is printed."""
    try:
        from accelerate.commands.launch import launch_command, launch_command_parser
    except ImportError:
        raise LlamaGymError(
            f"--num-processes {count} needs the package 'accelerate': pip install accelerate"
        ) from None
    import torch.distributed.run  # noqa: F401  (torchrun's loggers, quieted below)
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # --multi_gpu is accelerate's name for its torchrun launcher, for GPUs and CPUs alike.
    launcher = launch_command_parser().parse_args(
        [
            *("--multi_gpu", "--num_processes", str(count), "--num_machines", "1"),
            *("--mixed_precision", "no", "--dynamo_backend", "no"),
            *("--main_process_port", "0"),  # a free port: runs side by side never collide
            *("-m", "llamagym.cli", "run", *run_arguments),
        ]
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default, without its warning
    # torchrun logs a failed or signalled process; that process says what happened itself.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        launch_command(launcher)
    except SignalException as error:
        return 128 + int(error.sigval)
    except ChildFailedError as error:
        rank, failure = min(error.failures.items())
        code = failure.exitcode if failure.exitcode >= 0 else 128 - failure.exitcode
        if code not in (2, *SIGNAL_EXIT_CODES.values()):
            reason = (
                f"signal {signal.Signals(-failure.exitcode).name}"
                if failure.exitcode < 0
                else f"exit code {failure.exitcode}"
            )
            typer.secho(f"error: process {rank} of {count} ended with {reason}", fg="red", err=True)
        return code
    return 0


def _budget(config: Any) -> str:
    training = config.training
    if training.episodes is not None:
        text = f"{training.episodes:,} episodes"
        return text + (f" or {training.minutes:g} min" if training.minutes else "")
    if training.minutes is not None:
        return f"{training.minutes:g} min"
    return "1,000 episodes"


@app.command("run")
def run_command(
    context: typer.Context,
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    algorithm: str = typer.Option(None, "--algorithm", "-a", help="Algorithm name."),
    model: str = typer.Option(None, "--model", "-m", help="'tiny', a Hub id or a local dir."),
    mode: str = typer.Option(None, "--mode", help="score or generate."),
    episodes: int = typer.Option(None, "--episodes", "-n", help="Training episodes."),
    minutes: float = typer.Option(None, "--minutes", help="Wall-clock training budget."),
    num_envs: int = typer.Option(None, "--num-envs", help="Environments in lockstep."),
    seed: int = typer.Option(None, "--seed", help="Random seed."),
    threads: int = typer.Option(None, "--threads", help="torch threads."),
    eval_episodes: int = typer.Option(None, "--eval-episodes", help="Final eval episodes."),
    checkpoint_every: int = typer.Option(
        None, "--checkpoint-every", help="Checkpoint every K updates (0 = only at the end)."
    ),
    output: Path = typer.Option(None, "--output", "-o", help="Run directory."),
    config_file: Path = typer.Option(None, "--config", "-c", help="YAML/TOML/JSON config."),
    assignments: list[str] = typer.Option([], "--set", help="KEY=VALUE, e.g. algorithm.lr=1e-4"),
    resume: Path = typer.Option(
        None, "--resume", help="Continue a run: its directory or one of its checkpoints."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar (CI)."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Log a line per update."),
    num_processes: int = typer.Option(
        None,
        "--num-processes",
        help="Train data-parallel in N processes, started through accelerate's launcher "
        "(each steps its own envs; gradients are averaged).",
    ),
) -> None:
    """Train AGENT online, then evaluate it beside its baselines and write a report."""
    from llamagym.training import checkpoint as checkpoints
    from llamagym.training import distributed

    if num_processes is not None:
        if num_processes < 1:
            raise LlamaGymError(f"--num-processes must be at least 1, got {num_processes}")
        if num_processes > 1 and distributed.launched_processes() > 1:
            raise LlamaGymError(
                "--num-processes cannot be used in a process a launcher started "
                f"({distributed.launched_processes()} processes already)"
            )
    run_arguments = command_words(context, leave_out={"num_processes"})

    flags = {
        "algorithm.name": algorithm, "model.name": model, "rollout.mode": mode,
        "training.episodes": episodes, "training.minutes": minutes,
        "rollout.num_envs": num_envs, "training.seed": seed, "training.threads": threads,
        "training.eval_episodes": eval_episodes, "output.checkpoint_every": checkpoint_every,
        "output.dir": output, "output.quiet": quiet or None,
    }
    if minutes is not None and episodes is None:
        # A time budget given on the command line replaces an episode budget from below.
        assignments = [*assignments, "training.episodes=null"]
    base = resume_checkpoint = resume_meta = None
    if resume is not None:
        # The newest intact checkpoint of a run directory (a damaged one is skipped with a
        # warning); one given by name must be intact.
        resume_checkpoint = checkpoints.find_checkpoint(resume)
        resume_meta = checkpoints.read_meta(resume_checkpoint)
        checkpoints.check_format(resume_meta, resume_checkpoint)
        # The checkpoint's config, but never its model.trust_remote_code: only --set can.
        base = checkpoints.untrusted_config(resume_meta)
        if output is None:
            # Continue in the directory the checkpoint belongs to, wherever it now is.
            flags["output.dir"] = checkpoints.run_dir_of(resume_checkpoint)
    agent_class, resolved = resolve_run_config(agent, config_file, assignments, flags, base)
    config = resolved.config
    if resume_meta is not None and config.model.name == (base or {}).get("model", {}).get("name"):
        # The model the checkpoint names (another one is refused when the run starts).
        checkpoints.check_model_source(
            resume_meta, config.model.name, config.model.trust_remote_code, resume_checkpoint
        )
    if num_processes is not None and num_processes > 1:
        # Everything above is checked once, here; each process then runs the command
        # again without --num-processes.
        raise typer.Exit(launch_processes(num_processes, run_arguments))
    # Several processes: each its own device (cuda:RANK); the config keeps what was asked.
    device = distributed.start(config.model.device)
    agent_object = agent_class(config=resolved, device=device)
    try:
        _train(agent, agent_object, config, resume_checkpoint, verbose)
    finally:
        distributed.finish()


def _train(
    agent: str, agent_object: Any, config: Any, resume_checkpoint: Path | None, verbose: bool
) -> None:
    from rich.console import Console

    from llamagym.training import distributed
    from llamagym.training.progress import RunProgress, summary_table
    from llamagym.training.trainer import Trainer

    main_process = distributed.is_main()
    console = Console(quiet=not main_process)  # the other processes print nothing
    status = Console(stderr=True)
    configure_logging(status, config.output.quiet or not main_process, verbose and main_process)
    if not main_process:
        logging.getLogger("llamagym").setLevel(logging.ERROR)
    progress = None if config.output.quiet or not main_process else RunProgress(status)
    trainer = Trainer(agent_object, progress=progress, resume_from=resume_checkpoint)
    processes = distributed.world_size()
    console.print(
        f"[bold]llamagym run {agent}[/]: {config.algorithm.name} on {config.model.name} "
        f"({config.rollout.mode} mode, {config.rollout.num_envs} envs"
        + (f" in each of {processes} processes" if processes > 1 else "")
        + f"), {_budget(config)}, seed {config.training.seed}"
        + (f", resuming {resume_checkpoint}" if resume_checkpoint else "")
    )
    console.print(f"run directory: {trainer.output_dir}")
    summary = trainer.run()
    if summary.interrupted and not main_process:
        raise typer.Exit(SIGNAL_EXIT_CODES.get(summary.interrupted, 1))
    if summary.interrupted:
        typer.secho(
            f"stopped by {summary.interrupted} after update {summary.updates} "
            f"({summary.episodes:,} episodes); checkpoint {summary.checkpoint}\n"
            f"continue with: llamagym run {agent} --resume {summary.output_dir}",
            fg="yellow",
            err=True,
        )
        raise typer.Exit(SIGNAL_EXIT_CODES.get(summary.interrupted, 1))
    console.print(
        f"trained {summary.episodes:,} episodes ({summary.env_steps:,} env steps, "
        f"{summary.updates} updates) in {summary.seconds:.0f}s"
    )
    if summary.evaluation is not None:
        console.print(summary_table(summary))
    console.print(f"checkpoint: {summary.checkpoint}")
    if summary.report is not None:
        curve = summary.output_dir / "learning_curve.png"
        console.print(f"report: {summary.report}  (learning curve: {curve})")


@app.command("eval")
def eval_command(
    agent: str = typer.Argument(..., help="Agent name."),
    checkpoint: Path = typer.Option(
        ..., "--checkpoint", help="A run directory (its newest checkpoint) or a checkpoint."
    ),
    episodes: int = typer.Option(1000, "--episodes", "-n", min=1, help="Evaluation episodes."),
    greedy: bool = typer.Option(True, "--greedy/--sample", help="Argmax or sampled actions."),
    seed: int = typer.Option(0, "--seed", help="Seed of the evaluation episodes."),
    num_envs: int = typer.Option(None, "--num-envs", min=1, help="Environments in lockstep."),
    as_json: bool = typer.Option(False, "--json", help="Print the results as JSON."),
    assignments: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE over the checkpoint's config, e.g. model.dtype=bfloat16"
    ),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Let the checkpoint's model run Python code of its own (never taken from the "
        "checkpoint; only for a model whose code you trust).",
    ),
) -> None:
    """Evaluate a checkpoint: mean return with a 95% CI, beside the baselines."""
    from rich.console import Console

    from llamagym.config import deep_merge, parse_assignment
    from llamagym.run import load_agent

    report_plugin_problems()
    overrides: dict[str, Any] = {}
    for assignment in assignments:
        overrides = deep_merge(overrides, parse_assignment(assignment))
    overrides = deep_merge(overrides, {"training": {"seed": seed}})
    if num_envs is not None:
        overrides = deep_merge(overrides, {"rollout": {"num_envs": num_envs}})
    agent_object = load_agent(
        checkpoint, overrides=overrides, agent=agent, trust_remote_code=trust_remote_code
    )
    directory, meta = agent_object.checkpoint, agent_object.checkpoint_meta
    assert directory is not None and meta is not None, "load_agent() records its checkpoint"
    configure_logging(Console(stderr=True), quiet=as_json, verbose=False)

    from llamagym.training.progress import evaluation_table
    from llamagym.training.trainer import evaluate_with_baselines

    result, baselines = evaluate_with_baselines(agent_object, episodes, seed, greedy=greedy)
    if as_json:
        typer.echo(json.dumps({
            "checkpoint": str(directory), "greedy": greedy, "seed": seed,
            **result.as_dict(), "baselines": [b.as_dict() for b in baselines],
        }, indent=2))
        return
    console = Console()
    console.print(
        f"[bold]{agent}[/] checkpoint {directory}: update {meta.get('update', '?')}, "
        f"{meta.get('episodes', 0):,} training episodes; evaluation seed {seed}"
    )
    console.print(evaluation_table(result, baselines, greedy=greedy))
    console.print(
        f"agent: mean return {result.mean:+.3f}, 95% CI [{result.mean - result.ci95:+.3f}, "
        f"{result.mean + result.ci95:+.3f}], invalid replies {result.invalid_rate:.2%}"
    )
