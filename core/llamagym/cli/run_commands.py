"""The command that trains: ``run`` (and the config resolution other commands share)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.logging import RichHandler

from llamagym.cli.app import app, report_plugin_problems
from llamagym.cli.launcher import SIGNAL_EXIT_CODES, launch_processes
from llamagym.config.files import parse_assignment, read_config_file, refuse_code_settings
from llamagym.display import PrintableFormatter, printable, shown
from llamagym.errors import LlamaGymError
from llamagym.plugin_runtime.manager import get_plugins

#: The config key each of ``run``'s flags sets; ``SWITCHES`` are its on/off flags.
FLAG_KEYS = {
    "algorithm": "algorithm.name", "model": "model.name", "mode": "rollout.mode",
    "episodes": "training.episodes", "minutes": "training.minutes",
    "num_envs": "rollout.num_envs", "seed": "training.seed", "threads": "training.threads",
    "eval_episodes": "training.eval_episodes", "checkpoint_every": "output.checkpoint_every",
    "output": "output.dir", "quiet": "output.quiet", "backend": "training.backend",
    "trust_remote_code": "model.trust_remote_code",
    "warm_start": "algorithm.warm_start.baseline",
}
SWITCHES = {"quiet", "trust_remote_code"}
#: The help of ``run``'s flags whose help takes more than a line.
HELP = {
    "episodes": "Training episodes. Without --minutes it replaces the time budget of the "
    "agent's defaults, a --config file or --set; with it, whichever ends first.",
    "minutes": "Wall-clock training budget. Without --episodes it replaces the episode "
    "budget of the agent's defaults, a --config file or --set.",
    "num_processes": "Train data-parallel in N processes, started through accelerate's "
    "launcher (each steps its own envs; gradients are averaged).",
    "backend": "native (default): LlamaGym's algorithms; trl: TRL's GRPOTrainer optimises "
    "(vLLM, DeepSpeed, FSDP through accelerate; needs the trl extra).",
    "trust_remote_code": "Let the model run Python code of its own (never taken from a "
    "config file, --set or a checkpoint; only for a model whose code you trust).",
    "warm_start": "One of the agent's baselines, or expert for the one that plays best: "
    "its successful episodes are recorded in the run's mode and model "
    "(RUN_DIR/demonstrations.jsonl) and trained on before RL "
    "(= --set algorithm.warm_start.baseline=NAME).",
}


def command_line_layers(
    config_file: Path | None, assignments: list[str], flags: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    """The layers a command line gives, lowest precedence first: the ``--config`` file,
    each ``--set``, then the typed flags (those not given are left out)."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_file is not None:
        data = read_config_file(config_file)
        refuse_code_settings(data, f"config file {str(config_file)!r}")
        layers.append((f"file {config_file}", data))
    layers += [("--set", parse_assignment(assignment)) for assignment in assignments]
    flag_layer: dict[str, Any] = {}
    for dotted, value in flags.items():
        if value is not None:
            *sections, key = dotted.split(".")
            holder = flag_layer
            for section in sections:
                holder = holder.setdefault(section, {})
            holder[key] = value
    layers.append(("flag", flag_layer))
    return layers


def resolve_run_config(
    agent_name: str,
    config_file: Path | None,
    assignments: list[str],
    flags: dict[str, Any],
    base: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """Agent class and :class:`~llamagym.resolver.layers.ResolvedConfig` of a command line.

    ``base`` (a resumed checkpoint's config) replaces the agent's defaults: a resumed
    run continues with the settings it was trained with unless told otherwise.
    Everything is validated here, before a model or an environment loads: a bad value
    anywhere is a ``ConfigError`` naming each problem on its own line.
    """
    from llamagym.resolver.layers import resolve_agent_config

    plugins = get_plugins()
    report_plugin_problems()
    agent_class = plugins.registry.get("agent", agent_name).load()
    later = command_line_layers(config_file, assignments, flags)
    later.insert(0, ("argument", {"agent": {"name": agent_name}}))
    resolved = resolve_agent_config(agent_class, later, base=base, plugins=plugins)
    return agent_class, resolved


def configure_logging(console: Any, quiet: bool, verbose: bool) -> None:
    """Log lines through rich on ``console``, so they print above the live progress bar
    instead of tearing through it; ``--quiet`` keeps warnings only, ``--verbose`` adds a
    line per update."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        # Replace the plain stderr handler of logging.basicConfig (and ours from an
        # earlier command in this process); leave any other handler alone.
        plain = type(handler) is logging.StreamHandler and handler.stream is sys.stderr
        if plain or getattr(handler, "_llamagym_cli", False):
            root.removeHandler(handler)
    handler = RichHandler(console=console, show_path=False, show_time=False, markup=False)
    handler.setFormatter(PrintableFormatter())
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


def _budget_source(source: str | None, flag: str) -> str:
    """Where a budget value came from, in words (``source``: its config layer)."""
    if source is None:
        return "the built-in default"
    named = {
        "flag": flag,
        "agent defaults": "the agent's defaults",
        "checkpoint": "the resumed run",
    }
    return named.get(source, source)  # --set, file PATH, pretrained-model defaults, ...


def _budget(resolved: Any, replaced: str | None = None) -> str:
    """The line that says which training budget applies and where it came from.

    Both ``training.episodes`` and ``training.minutes`` set: the run ends at whichever
    is reached first. One of ``--episodes`` and ``--minutes`` without the other replaces
    the other budget of any layer below the flags; ``replaced`` says which, in words
    (:func:`_replaced_budget`). Neither set: the built-in 1,000 episodes."""
    from llamagym.schedule import DEFAULT_EPISODES

    training, sources = resolved.config.training, resolved.sources
    episodes_from = _budget_source(sources.get("training.episodes"), "--episodes")
    minutes_from = _budget_source(sources.get("training.minutes"), "--minutes")
    if training.episodes is not None and training.minutes is not None:
        origin = (
            f"both from {episodes_from}"
            if episodes_from == minutes_from
            else f"episodes from {episodes_from}, minutes from {minutes_from}"
        )
        return (
            f"budget: {training.episodes:,} episodes or {training.minutes:g} min, "
            f"whichever ends first ({origin})"
        )
    if training.episodes is not None:
        return f"budget: {training.episodes:,} episodes ({episodes_from}{replaced or ''})"
    if training.minutes is not None:
        return f"budget: {training.minutes:g} min ({minutes_from}{replaced or ''})"
    return (
        f"budget: {DEFAULT_EPISODES:,} episodes (the built-in default: neither "
        "training.episodes nor training.minutes is set)"
    )


@app.command("run")
def run_command(
    context: typer.Context,
    agent: str = typer.Argument(..., help="Agent name (see `llamagym list`)."),
    algorithm: str = typer.Option(None, "--algorithm", "-a", help="Algorithm name."),
    model: str = typer.Option(None, "--model", "-m", help="'tiny', a Hub id or a local dir."),
    mode: str = typer.Option(None, "--mode", help="score or generate."),
    episodes: int = typer.Option(None, "--episodes", "-n", help=HELP["episodes"]),
    minutes: float = typer.Option(None, "--minutes", help=HELP["minutes"]),
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
    num_processes: int = typer.Option(None, "--num-processes", help=HELP["num_processes"]),
    backend: str = typer.Option(None, "--backend", help=HELP["backend"]),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help=HELP["trust_remote_code"]
    ),
    warm_start: str = typer.Option(None, "--warm-start", help=HELP["warm_start"]),
) -> None:
    """Train AGENT online, then evaluate it beside its baselines and write a report."""
    from llamagym import distributed
    from llamagym.training.checkpoint.trust import check_model_source

    _check_num_processes(num_processes)
    run_arguments = command_words(context, leave_out={"num_processes"})

    # Each flag sets one key; a switch left off sets nothing (a lower layer may set it).
    flags = {key: context.params[name] or None if name in SWITCHES else context.params[name]
             for name, key in FLAG_KEYS.items()}
    given = list(assignments)
    if (minutes is None) != (episodes is None):
        # One budget given on the command line replaces the other one from below.
        other = "training.episodes" if episodes is None else "training.minutes"
        assignments = [*assignments, f"{other}=null"]
    base, resume_checkpoint, resume_meta = _resumed(resume, output, flags)
    agent_class, resolved = resolve_run_config(agent, config_file, assignments, flags, base)
    config = resolved.config
    replaced = None
    if assignments != given:
        replaced = _replaced_budget(agent, agent_class, config_file, given, flags, base)
    if resume_meta is not None and config.model.name == (base or {}).get("model", {}).get("name"):
        # The model the checkpoint names (another one is refused when the run starts).
        assert resume_checkpoint is not None  # it came with its metadata
        check_model_source(
            resume_meta, config.model.name, config.model.trust_remote_code, resume_checkpoint
        )
    trl = config.training.backend == "trl"
    if trl:
        _check_trl_backend(resolved, num_processes)
    if num_processes is not None and num_processes > 1:
        # Everything above is checked once, here; each process then runs the command
        # again without --num-processes.
        raise typer.Exit(launch_processes(num_processes, run_arguments))
    try:
        # Several processes: each its own device (cuda:RANK); the config keeps what was asked.
        device = distributed.start(config.model.device, sharding=trl)
        agent_object = agent_class(config=resolved, device=device)
        _train(agent, agent_object, config, resume_checkpoint, verbose, _budget(resolved, replaced))
    except distributed.ProcessLostError as error:
        raise typer.Exit(_lost_process(error)) from None
    finally:
        distributed.finish()


def _lost_process(error: LlamaGymError) -> int:
    """Another process died or stopped answering: the launcher of ``--num-processes``
    says so in one line, from the error file torchrun gives each process and reads back
    (the other processes of the run may give up at the same moment: one line, not one
    per process); under another launcher this process says it. The exit code tells the
    launcher which it was."""
    from llamagym import distributed

    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's format, its message a plain string
        record = {"message": str(error), "timestamp": int(time.time())}
        Path(error_file).write_text(json.dumps(record), encoding="utf-8")
    if not os.environ.get(distributed.LAUNCHER_VARIABLE):
        typer.secho(f"error: {printable(str(error))}", fg="red", err=True)
    return distributed.PROCESS_LOST_EXIT_CODE


def _check_trl_backend(resolved: Any, num_processes: int | None) -> None:
    """``--backend trl``: TRL is installed, and supports what the config asks of it."""
    from llamagym import distributed
    from llamagym.resolver.trl_arguments import require_trl
    from llamagym.trl_backend.settings import check_supported

    require_trl()
    check_supported(resolved, num_processes or distributed.launched_processes())


def _check_num_processes(num_processes: int | None) -> None:
    from llamagym import distributed

    if num_processes is None:
        return
    if num_processes < 1:
        raise LlamaGymError(f"--num-processes must be at least 1, got {num_processes}")
    if num_processes > 1 and distributed.launched_processes() > 1:
        raise LlamaGymError(
            "--num-processes cannot be used in a process a launcher started "
            f"({distributed.launched_processes()} processes already)"
        )


def _resumed(
    resume: Path | None, output: Path | None, flags: dict[str, Any]
) -> tuple[dict[str, Any] | None, Path | None, dict[str, Any] | None]:
    """What ``--resume`` continues: the run's config as the lowest layer, the checkpoint,
    and its metadata (None for a TRL checkpoint, which has its own). Without ``--output``
    the run continues in the directory the checkpoint belongs to (set in ``flags``)."""
    if resume is None:
        return None, None, None
    from llamagym.training.checkpoint import store as checkpoints
    from llamagym.training.checkpoint.trust import untrusted_config
    from llamagym.trl_backend.trainer import trl_checkpoint, trl_run_dir

    trl_resume = trl_checkpoint(resume)
    if trl_resume is not None:
        # A TRL-backend run: TRL's checkpoint, and the run's config.yaml.
        run_dir = trl_run_dir(trl_resume)
        base = untrusted_config({"config": read_config_file(run_dir / "config.yaml")})
        if output is None:
            flags["output.dir"] = run_dir
        return base, trl_resume, None
    # The newest intact checkpoint of a run directory (a damaged one is skipped with a
    # warning); one given by name must be intact.
    checkpoint = checkpoints.find_checkpoint(resume)
    meta = checkpoints.read_meta(checkpoint)
    checkpoints.check_format(meta, checkpoint)
    if output is None:
        # Continue in the directory the checkpoint belongs to, wherever it now is.
        flags["output.dir"] = checkpoints.run_dir_of(checkpoint)
    # The checkpoint's config, but never its model.trust_remote_code: only the flag can.
    return untrusted_config(meta), checkpoint, meta


def _replaced_budget(
    agent: str,
    agent_class: Any,
    config_file: Path | None,
    given: list[str],
    flags: dict[str, Any],
    base: dict[str, Any] | None,
) -> str | None:
    """What the budget flag given alone replaced (the other budget of a lower layer),
    as the end of the budget line; None if no layer below set it."""
    from llamagym.resolver.layers import resolve_agent_config

    below = resolve_agent_config(
        agent_class,
        [("argument", {"agent": {"name": agent}}), *command_line_layers(config_file, given, flags)],
        base=base,
    )
    training, sources = below.config.training, below.sources
    if flags["training.minutes"] is not None and training.episodes is not None:
        budget, key, flag = f"{training.episodes:,} episodes", "training.episodes", "--episodes"
    elif flags["training.episodes"] is not None and training.minutes is not None:
        budget, key, flag = f"{training.minutes:g} min", "training.minutes", "--minutes"
    else:
        return None
    return (
        f"; replaces the {budget} of {_budget_source(sources.get(key), flag)}: add {flag} "
        "to keep both, whichever ends first"
    )


def _train(
    agent: str,
    agent_object: Any,
    config: Any,
    resume_checkpoint: Path | None,
    verbose: bool,
    budget: str,
) -> None:
    from llamagym import distributed
    from llamagym.training.loop.progress import RunProgress, summary_table
    from llamagym.training.loop.trainer import Trainer

    main_process = distributed.is_main()
    console = Console(quiet=not main_process)  # the other processes print nothing
    status = Console(stderr=True)
    configure_logging(status, config.output.quiet or not main_process, verbose and main_process)
    if not main_process:
        logging.getLogger("llamagym").setLevel(logging.ERROR)
    progress = None if config.output.quiet or not main_process else RunProgress(status)
    trainer_class: type[Trainer] = Trainer
    if config.training.backend == "trl":
        from llamagym.trl_backend.trainer import TRLTrainer

        trainer_class = TRLTrainer
    trainer = trainer_class(
        agent_object, agent_object.session, progress=progress, resume_from=resume_checkpoint
    )
    processes = distributed.world_size()
    # Names may come from a resumed checkpoint's config: shown, never read as markup.
    console.print(
        f"[bold]llamagym run {shown(agent)}[/]: {shown(config.algorithm.name)} on "
        f"{shown(config.model.name)} ({config.rollout.mode} mode, "
        f"{config.rollout.num_envs} envs"
        + (f" in each of {processes} processes" if processes > 1 else "")
        + f"), seed {config.training.seed}"
        + (f", resuming {shown(resume_checkpoint)}" if resume_checkpoint else "")
    )
    # Printed with --quiet too: it is one line, and says when the run will end.
    console.print(budget, markup=False, highlight=False, soft_wrap=True)
    console.print(f"run directory: {shown(trainer.output_dir)}")
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
    console.print(f"checkpoint: {shown(summary.checkpoint)}")
    if summary.report is not None:
        # Only a picture that was drawn is named.
        curve = f"  (learning curve: {summary.curve})" if summary.curve is not None else ""
        console.print(f"report: {summary.report}{curve}", markup=False, soft_wrap=True)
