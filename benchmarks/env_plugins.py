"""What a small model learns on the TextArena and BabyAI env plugins: for each agent,
its baselines, the untrained model (zero-shot) and the model after a training run, all
evaluated greedily on the same evaluation seeds.

    nice -n 19 python benchmarks/env_plugins.py                  # tiny, the seven agents
    nice -n 19 python benchmarks/env_plugins.py --model smollm2-135m --zero-shot-only
    nice -n 19 python benchmarks/env_plugins.py --model smollm2-135m --minutes 30
    python benchmarks/env_plugins.py --quick --agents babyai     # a smoke run
    python benchmarks/env_plugins.py --agents textarena-tower-of-hanoi:TowerOfHanoi-v0-medium
    python benchmarks/env_plugins.py --agents vault --model smollm2-135m --minutes 10 \
        --eval-episodes 20 --warm-start follow-the-draft     # a newcomer's env
    python benchmarks/env_plugins.py --agents textarena-frozen-lake --model smollm2-135m \
        --minutes 40 --eval-episodes 20 --curve-every 6      # success against minutes
    python benchmarks/env_plugins.py --agents openenv --serve-echo --model smollm2-135m \
        --minutes 10 --eval-episodes 20                      # an OpenEnv env, served

``--serve-echo`` serves the echo env OpenEnv's own ``openenv init`` makes (a step echoes
the message sent, rewarded by its length up to 1.0 at 10 characters; its episodes never
end) with uvicorn on 127.0.0.1 for the whole run, and gives agent ``openenv`` its URL and
three messages to choose from (``--agents openenv --serve-echo``): an env LlamaGym did
not write, reached over OpenEnv.

``vault`` is a package as a newcomer writes one: ``llamagym new-plugin vault --env-class``,
its env and agent replaced by the text game in ``benchmarks/newcomer_game/`` (one reward
at the end; random play wins ~1%, its expert baseline 100%), installed with pip into this
Python before anything runs. ``--warm-start BASELINE`` gives every run that flag
(``expert``: each agent's own expert baseline, one command for every agent); ``--set
KEY=VALUE`` every command that setting (``rollout.explore=all`` turns a lever off).

An agent is its name, or ``NAME:VARIANT`` for another game or level than its default
(the agent's ``game`` or ``level`` option). For each, one at a time:

1. ``llamagym eval AGENT --model M -n N --seed E --json``: the untrained model, greedy,
   beside the baselines the agent names (``random``, and its expert: a solver, an oracle
   or BabyAI's bot), all on the evaluation seeds E, E+1, ...;
2. ``llamagym run AGENT --model M --seed S --episodes K`` (or ``--minutes``), the
   command a user types with the agent's defaults, its own final evaluation off;
3. ``llamagym eval AGENT --checkpoint RUN -n N --seed E --json``: the trained agent on
   the same seeds.

With ``--curve-every K`` the run checkpoints every K updates and keeps them all, and each
checkpoint is evaluated as in 3: the row's ``curve`` holds the share won at each, against
the training minutes its update ended at, and a plot of it is written beside the result.

Every number comes from ``llamagym eval``'s JSON: mean return with its 95% CI, the share
of episodes won (``won`` or ``success``), the share the game ended for invalid moves,
and the share of replies that named no legal move. Every process runs with ``--threads``
torch threads (default 2) and this script's niceness, which the result records.
Result: ``benchmarks/results/env-plugins-<model>.json`` (``-quick`` for ``--quick``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    budget_arguments,
    log,
    pyplot,
    recorded_arguments,
    refuse_dirty_tree,
    stop_process,
    worker_environment,
    write_script_result,
)
from llamagym.training.loop.learning_signal import DIAGNOSIS  # noqa: E402

AGENTS = (
    "textarena-frozen-lake",
    "textarena-guess-the-number",
    "textarena-lights-out",
    "textarena-mastermind",
    "textarena-sudoku",
    "textarena-tower-of-hanoi",
    "babyai",
)
#: The agent options that choose a game or level (``NAME:VARIANT``).
VARIANT_OPTIONS = ("game", "level")
#: The outcomes that mean the episode was won, as the agents name them.
WIN_OUTCOMES = ("won", "success")
INVALID_OUTCOME = "invalid move"
DEFAULT_EPISODES = 320  # training episodes per agent when no budget is given
DEFAULT_EVAL_EPISODES = 100
EVAL_SEED = 10_000  # evaluation episodes' seeds start here, away from training's
MAX_EVAL_EPISODES = 10_000
COMMAND_TIMEOUT_SECONDS = 3 * 3600
NAME = "env-plugins"


# -- pure parts -------------------------------------------------------------------------
def result_name(model: str) -> str:
    """``env-plugins-<model>``, the model's name made safe for a file name."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model).strip("-.") or "model"
    return f"{NAME}-{slug[:80]}"


def split_agent(spec: str) -> tuple[str, str | None]:
    """``NAME`` or ``NAME:VARIANT`` -> (name, variant or None)."""
    name, _, variant = spec.partition(":")
    return name, (variant or None)


def eval_line(agent: str, subject: Sequence[str], episodes: int, seed: int, threads: int,
              assignments: Sequence[str]) -> list[str]:
    """``llamagym eval AGENT SUBJECT -n N --seed E --json --quiet --set ...``; ``subject``
    is ``--model M`` or ``--checkpoint RUN``."""
    line = ["eval", agent, *subject, "-n", str(episodes), "--seed", str(seed), "--json",
            "--quiet", "--set", f"training.threads={threads}"]
    for assignment in assignments:
        line += ["--set", assignment]
    return line


def run_line(agent: str, model: str, seed: int, budget: Mapping[str, float], output: Path,
             threads: int, assignments: Sequence[str]) -> list[str]:
    """``llamagym run AGENT --model M --seed S --episodes K|--minutes M ...``, the run's
    own final evaluation off (the trained agent is evaluated by ``llamagym eval``); the
    budget given is the run's only one."""
    line = ["run", agent, "--model", model, "--seed", str(seed),
            *budget_arguments(budget.get("episodes"), budget.get("minutes")),
            "--threads", str(threads), "--eval-episodes", "0", "--output", str(output),
            "--quiet", "--set", "output.report=false"]
    for assignment in assignments:
        line += ["--set", assignment]
    return line


def summarise(evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """One policy's numbers from ``llamagym eval --json``: mean return and CI, the share
    won, the share ended by invalid moves, the share of replies naming no legal move."""
    outcomes = evaluation.get("outcomes") or {}
    won = next((outcomes[key] for key in WIN_OUTCOMES if key in outcomes), None)
    return {
        "episodes": evaluation["episodes"],
        "mean": evaluation["mean"],
        "ci95": evaluation["ci95"],
        "won": won,
        "invalid_move": outcomes.get(INVALID_OUTCOME),
        "invalid_reply": evaluation["invalid_rate"],
        "outcomes": dict(outcomes),
        "distinct_episodes": evaluation.get("distinct_episodes"),
    }


def summarise_training(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A run's ``metrics.jsonl`` records -> its updates, episodes, time, curve and the
    dead-signal findings the run itself said (its ``diagnosis`` records)."""
    updates = [r for r in records if r.get("kind") == "update"]
    last = updates[-1] if updates else {}
    return {
        "updates": len(updates),
        "episodes": int(last.get("total_episodes", 0)),
        "env_steps": int(last.get("env_steps", 0)),
        "train_seconds": float(last.get("seconds", 0.0)),
        "curve": [{"update": int(r["update"]), "seconds": float(r["seconds"]),
                   "return_mean": float(r["return_mean"]),
                   "invalid_rate": r.get("invalid_rate")} for r in updates],
        "diagnoses": [{"update": int(r["update"]), "finding": str(r["finding"]),
                       "message": str(r["message"])}
                      for r in records if r.get("kind") == DIAGNOSIS],
    }


def budget_of(args: argparse.Namespace, agent: str | None = None) -> dict[str, float]:
    """``{"episodes": K}`` or ``{"minutes": M}``: the training budget ``agent``'s run
    gets (``--agent-episodes`` over ``--episodes``; without ``agent``, the default)."""
    if args.minutes is not None:
        return {"minutes": args.minutes}
    named = dict(args.agent_episodes)
    if agent in named:
        return {"episodes": named[agent]}
    return {"episodes": args.episodes or (16 if args.quick else DEFAULT_EPISODES)}


def agent_budget(text: str) -> tuple[str, int]:
    """``AGENT=K`` -> (AGENT, K), K a whole number above 0."""
    agent, _, count = text.partition("=")
    if not agent or not count.isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give AGENT=EPISODES, e.g. "
                                         "textarena-mastermind=16")
    return agent, int(count)


# -- commands ---------------------------------------------------------------------------
def llamagym_executable() -> str:
    return shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"


class CommandFailed(RuntimeError):
    """A ``llamagym`` command exited with an error: the agent's row records it."""


def failure(command: str, code: int, stderr: str) -> str:
    """One line: which command failed, how, and its last word on it (a process killed
    by a signal had none: its last line was whatever it printed before)."""
    if code < 0:
        how = f"killed by signal {-code}"
        if code == -9:
            how += ": the kernel's out-of-memory killer, or a kill"
        return f"`{command}` failed ({how})"
    said = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    return f"`{command}` failed (exit {code}): {said[-1][:300] if said else 'no message'}"


def run_llamagym(words: Sequence[str], threads: int) -> tuple[str, float]:
    """Run ``llamagym WORDS`` (stdout, wall seconds). A command that refuses its input
    (exit 2) stops the benchmark in one line; any other failure is a CommandFailed."""
    started = time.perf_counter()
    done = subprocess.run([llamagym_executable(), *words], env=worker_environment(threads),
                          capture_output=True, text=True, check=False,
                          timeout=COMMAND_TIMEOUT_SECONDS)
    if done.returncode == 2:
        print(f"{NAME}: " + failure(f"llamagym {' '.join(words[:2])}", 2, done.stderr),
              file=sys.stderr)
        raise SystemExit(2)
    if done.returncode != 0:
        raise CommandFailed(failure(f"llamagym {' '.join(words[:2])}", done.returncode,
                                    done.stderr))
    return done.stdout, time.perf_counter() - started


def evaluate(agent: str, subject: Sequence[str], args: argparse.Namespace,
             assignments: Sequence[str]) -> dict[str, Any]:
    words = eval_line(agent, subject, args.eval_episodes, args.eval_seed, args.threads,
                      assignments)
    stdout, seconds = run_llamagym(words, args.threads)
    data = json.loads(stdout)
    return {"command": "llamagym " + " ".join(words), "seconds": seconds,
            "agent": summarise(data),
            "baselines": {b["name"]: summarise(b) for b in data.get("baselines", [])}}


def variant_assignments(agent: str, variant: str | None, model: str) -> tuple[list[str], str]:
    """The ``--set`` that picks ``variant`` and the env id the agent then plays (its
    ``game`` or ``level``), from the agent's validated options; a bad name or variant
    stops with the agent's own one-line message."""
    from llamagym.cli.run_commands import resolve_run_config
    from llamagym.errors import LlamaGymError

    try:
        _, resolved = resolve_run_config(agent, None, [], {"model.name": model})
        options = resolved.agent_options
        key = next((k for k in VARIANT_OPTIONS if hasattr(options, k)), None)
        if variant is not None and key is None:
            raise LlamaGymError(f"agent {agent!r} has no game or level option: "
                                f"give it without ':{variant}'")
        assignments = [] if variant is None else [f"agent.{key}={variant}"]
        if assignments:
            _, resolved = resolve_run_config(agent, None, assignments, {"model.name": model})
        env_id = getattr(resolved.agent_options, key, None) if key else agent
    except LlamaGymError as error:  # bad input: one line, exit code 2, as argparse does
        print(f"{NAME}: {' '.join(str(error).split())}", file=sys.stderr)
        raise SystemExit(2) from error
    return assignments, str(env_id)


DONE_FILE = "env-plugins-run.json"


def train(words: Sequence[str], output: Path, threads: int) -> float | None:
    """Run the training command into ``output`` (its wall seconds). A run directory that
    this exact command already finished (``--keep-runs``) is kept, not run again."""
    done = output / DONE_FILE
    if done.is_file():
        record = json.loads(done.read_text(encoding="utf-8"))
        if record.get("words") == list(words):
            log(NAME, f"{output.name}: finished before, kept")
            return record.get("wall_seconds")
    shutil.rmtree(output, ignore_errors=True)
    log(NAME, f"llamagym {' '.join(words)}")
    _, wall = run_llamagym(words, threads)
    done.write_text(json.dumps({"words": list(words), "wall_seconds": wall}), encoding="utf-8")
    return wall


def measure(spec: str, args: argparse.Namespace, runs: Path) -> dict[str, Any]:
    """One agent: baselines and zero-shot, then (unless --zero-shot-only) a training run
    and its trained agent, on the same evaluation seeds."""
    agent, variant = split_agent(spec)
    assignments, env_id = variant_assignments(agent, variant, args.model)
    assignments = [*assignments, *args.set]
    log(NAME, f"{agent} ({env_id}): zero-shot and baselines")
    evaluated = [*assignments, *args.eval_set]  # what the evaluations play on
    zero_shot = evaluate(agent, ["--model", args.model], args, evaluated)
    row: dict[str, Any] = {"agent": agent, "env_id": env_id, "set": assignments,
                           "eval_set": args.eval_set,
                           "baselines": zero_shot.pop("baselines"), "zero_shot": zero_shot}
    if args.zero_shot_only:
        return row
    output = runs / f"{agent}-{variant or 'default'}-seed{args.seed}".replace("/", "-")
    budget = budget_of(args, spec)
    words = run_line(agent, args.model, args.seed, budget, output, args.threads, assignments)
    if args.warm_start:
        words += ["--warm-start", args.warm_start]
    if args.curve_every:
        words += ["--checkpoint-every", str(args.curve_every),
                  "--set", f"output.keep_checkpoints={CURVE_KEEP}"]
    training: dict[str, Any] = {"command": "llamagym " + " ".join(recorded_arguments(words)),
                                **budget}
    try:
        wall = train(words, output, args.threads)
    except CommandFailed as error:  # recorded in the row; the next agent still runs
        log(NAME, f"{agent}: {error}")
        return {**row, "training": {**training, "failed": str(error)}}
    metrics = output / "metrics.jsonl"  # absent when the budget ended inside update 1
    records = [json.loads(line) for line in metrics.read_text().splitlines()] \
        if metrics.is_file() else []
    training.update({"wall_seconds": wall, **summarise_training(records)})
    trained = evaluate(agent, ["--checkpoint", str(output)], args, evaluated)
    trained.pop("baselines")
    trained["command"] = trained["command"].replace(str(output), "RUN_DIR")
    row = {**row, "training": training, "trained": trained}
    if args.curve_every:
        row["curve"] = checkpoint_curve(agent, output, records, args, evaluated)
    return row


#: Checkpoints a curve's run keeps: all of them, for any run this benchmark makes.
CURVE_KEEP = 10_000


def checkpoint_curve(agent: str, output: Path, records: Sequence[Mapping[str, Any]],
                     args: argparse.Namespace, assignments: Sequence[str]) -> list[dict]:
    """Each checkpoint of the run in ``output`` evaluated greedily on the evaluation
    seeds: its update, the training minutes that update ended at, its numbers."""
    minutes = {int(r["update"]): float(r["seconds"]) / 60 for r in records
               if r.get("kind") == "update"}
    points = []
    for directory in sorted((output / "checkpoints").glob("update-[0-9]*")):
        if not directory.name.removeprefix("update-").isdigit():  # a set-aside copy
            continue
        update = int(directory.name.removeprefix("update-"))
        log(NAME, f"{agent}: evaluating {directory.name}")
        numbers = evaluate(agent, ["--checkpoint", str(directory)], args, assignments)
        points.append({"update": update, "minutes": minutes.get(update),
                       **numbers["agent"]})
    return points


def plot_curves(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Share won against training minutes (the untrained model at 0), a line per agent
    with a curve; None without matplotlib or curves. ``python benchmarks/env_plugins.py
    --plot RESULT`` draws it again from a result file."""
    curves = [row for row in rows if row.get("curve")]
    plt = pyplot()
    if plt is None or not curves:
        return None
    figure, axis = plt.subplots(figsize=(7, 4))
    for row in curves:
        points = [p for p in row["curve"] if p["minutes"] is not None and p["won"] is not None]
        zero_shot = row["zero_shot"]["agent"]["won"]
        if zero_shot is not None:  # the untrained model, at minute 0
            points.insert(0, {"minutes": 0.0, "won": zero_shot})
        axis.plot([p["minutes"] for p in points], [100 * p["won"] for p in points],
                  marker="o", label=row["agent"])
    axis.set_xlabel("training minutes")
    axis.set_ylabel("won, greedy (%)")
    axis.set_ylim(0, 100)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


# -- the newcomer's env ------------------------------------------------------------------
#: The agent of a package as a newcomer makes one: ``llamagym new-plugin vault
#: --env-class``, its env and agent replaced by the game in benchmarks/newcomer_game/ (a
#: text game with one reward at the end), installed into this Python with pip.
NEWCOMER = "vault"
NEWCOMER_GAME = Path(__file__).resolve().parent / "newcomer_game"


def install_newcomer(folder: Path) -> None:
    """Write the newcomer's package with ``llamagym new-plugin`` into ``folder``, put its
    game in, and ``pip install -e`` it (its entry point is then a real one)."""
    package = folder / f"llamagym-{NEWCOMER}"
    shutil.rmtree(package, ignore_errors=True)
    # An earlier measurement's install holds the name: new-plugin refuses a name in use.
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "--quiet", "--yes",
                    f"llamagym-{NEWCOMER}"], check=False, capture_output=True)
    run_llamagym(["new-plugin", NEWCOMER, "--env-class", "--dir", str(folder)], 1)
    for name in ("env.py", "agent.py"):
        shutil.copyfile(NEWCOMER_GAME / name, package / "src" / f"llamagym_{NEWCOMER}" / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "-e",
                    str(package)], check=True)
    # This process reads the agent's options too: the new install's path files, read.
    for directory in site.getsitepackages():
        site.addsitedir(directory)
    importlib.invalidate_caches()
    log(NAME, f"installed {package.name} (llamagym new-plugin {NEWCOMER} --env-class)")


#: Agent openenv on the echo env: its fields, three messages (rewards 0.2, 0.5 and 1.0 a
#: step), and an end to its episodes, which the env never ends.
ECHO_SETS = ("agent.text_field=echoed_message", "agent.action_field=message",
             "agent.actions=hi,hello,hello_there_friend", "agent.max_episode_steps=4")


@contextlib.contextmanager
def serve_echo(folder: Path) -> Iterator[str]:
    """OpenEnv's echo env, made by ``openenv init echo_env`` in ``folder`` and served by
    uvicorn on 127.0.0.1 (a free port) until the block ends: its ws:// URL."""
    openenv = shutil.which("openenv", path=str(Path(sys.executable).parent))
    if openenv is None:
        raise SystemExit(f"{NAME}: --serve-echo needs OpenEnv: pip install -e llamagym_openenv")
    shutil.rmtree(folder / "echo_env", ignore_errors=True)
    subprocess.run([openenv, "init", "echo_env"], cwd=folder, check=True,
                   capture_output=True, timeout=120)
    app = folder / "echo_env" / "server" / "app.py"
    # The template serves one session; a run plays several envs at once.
    app.write_text(app.read_text().replace("max_concurrent_envs=1,", "max_concurrent_envs=64,"))
    log_file = folder / "echo_env" / "server.log"
    with log_file.open("w") as sink:
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
             "--port", "0"], cwd=folder / "echo_env", stdout=sink, stderr=subprocess.STDOUT,
            env=worker_environment(1))
    try:
        deadline, port = time.monotonic() + 60, None
        while port is None and server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            found = re.search(r"running on http://127\.0\.0\.1:(\d+)", log_file.read_text())
            port = found and found.group(1)
        if port is None:
            raise SystemExit(f"{NAME}: the echo env's server did not start: "
                             f"{log_file.read_text()[-500:]}")
        log(NAME, f"OpenEnv's echo env served on ws://127.0.0.1:{port}")
        yield f"ws://127.0.0.1:{port}"
    finally:
        stop_process(server)


# -- the command line -------------------------------------------------------------------
def positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", nargs="+", default=list(AGENTS), metavar="AGENT",
                        help="agents to measure, NAME or NAME:VARIANT (default: the six "
                        "textarena agents and babyai)")
    parser.add_argument("--model", default="tiny",
                        help="the model: tiny, smollm2-135m or any model name (default tiny)")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--episodes", type=positive(int),
                        help=f"training episodes per agent (default {DEFAULT_EPISODES}; "
                        "16 with --quick)")
    budget.add_argument("--minutes", type=positive(float),
                        help="training minutes per agent instead of an episode budget")
    parser.add_argument("--agent-episodes", type=agent_budget, action="append", default=[],
                        metavar="AGENT=K", help="training episodes of one agent (as given "
                        "in --agents), over --episodes; repeatable")
    parser.add_argument("--seed", type=int, default=0, help="training seed (default 0)")
    parser.add_argument("--warm-start", metavar="BASELINE",
                        help="the runs warm-start from this baseline of each agent "
                        "(llamagym run --warm-start)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for every agent's commands (evaluations and runs), "
                        "e.g. rollout.explore=all; repeatable")
    parser.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a setting for the evaluations only, after --set: held-out "
                        "games, e.g. agent.fold=test; repeatable")
    parser.add_argument("--eval-episodes", type=positive(int), default=None,
                        help=f"evaluation episodes per policy (default "
                        f"{DEFAULT_EVAL_EPISODES}; 4 with --quick; at most {MAX_EVAL_EPISODES})")
    parser.add_argument("--eval-seed", type=int, default=EVAL_SEED,
                        help=f"the first evaluation seed (default {EVAL_SEED})")
    parser.add_argument("--threads", type=positive(int), default=2,
                        help="torch threads of every process (default 2)")
    parser.add_argument("--zero-shot-only", action="store_true",
                        help="baselines and the untrained model only, no training")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 4 evaluation episodes, 16 training episodes")
    parser.add_argument("--curve-every", type=positive(int), metavar="K",
                        help="checkpoint every K updates and evaluate each: the share won "
                        "against training minutes, in the result and a plot beside it")
    parser.add_argument("--serve-echo", action="store_true",
                        help="serve OpenEnv's echo env (openenv init) and point agent "
                        "openenv at it, with three messages to choose from")
    parser.add_argument("--keep-runs", type=Path, help="keep the run directories here")
    parser.add_argument("--output", type=Path,
                        help="the result file (default: results/env-plugins-<model>.json)")
    add_allow_dirty(parser)
    return parser


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options, checked: a bad value exits 2 with one line naming it."""
    arguments = parser()
    args = arguments.parse_args(argv)
    args.eval_episodes = args.eval_episodes or (4 if args.quick else DEFAULT_EVAL_EPISODES)
    if args.eval_episodes > MAX_EVAL_EPISODES:
        arguments.error(f"--eval-episodes {args.eval_episodes} is over "
                        f"{MAX_EVAL_EPISODES}: give fewer")
    if args.curve_every and args.zero_shot_only:
        arguments.error("--curve-every evaluates a run's checkpoints: give it without "
                        "--zero-shot-only")
    if args.serve_echo and [split_agent(spec)[0] for spec in args.agents] != ["openenv"]:
        arguments.error("--serve-echo serves an env for agent openenv: give --agents openenv")
    if args.minutes is not None and args.agent_episodes:
        arguments.error("--agent-episodes is an episode budget: give it without --minutes")
    unknown = sorted({agent for agent, _ in args.agent_episodes} - set(args.agents))
    if unknown:
        arguments.error(f"--agent-episodes names {', '.join(unknown)}, not among --agents: "
                        "give an agent exactly as --agents does")
    for spec in args.agents:
        agent, variant = split_agent(spec)
        if not re.fullmatch(r"[A-Za-z0-9._-]+", agent) or (
                variant is not None and not re.fullmatch(r"[A-Za-z0-9._-]+", variant)):
            arguments.error(f"--agents {spec!r}: give NAME or NAME:VARIANT (letters, digits, "
                            "'.', '_', '-'), e.g. textarena-sudoku:Sudoku-v0-easy")
    return args


def measure_all(args: argparse.Namespace, runs: Path) -> list[dict[str, Any]]:
    """Every agent's row, one at a time."""
    for spec in args.agents:  # every name and variant checked before anything runs
        variant_assignments(*split_agent(spec), args.model)
    rows = []
    for spec in args.agents:
        try:
            rows.append(measure(spec, args, runs))
        except CommandFailed as error:  # an evaluation failed: said in the row
            log(NAME, f"{spec}: {error}")
            agent, variant = split_agent(spec)
            rows.append({"agent": agent, "env_id": variant_assignments(
                agent, variant, args.model)[1], "failed": str(error)})
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if len(argv) == 2 and argv[0] == "--plot":  # a result's plot drawn again
        result = Path(argv[1])
        plotted = plot_curves(json.loads(result.read_text(encoding="utf-8"))["agents"],
                              result.with_suffix(".png"))
        print(f"written to {plotted}" if plotted else f"{result}: no curve to plot")
        return 0
    args = parse_arguments(argv)
    refuse_dirty_tree(NAME, args.quick, args.allow_dirty)
    started = time.perf_counter()
    runs = args.keep_runs or Path(tempfile.mkdtemp(prefix="llamagym-env-plugins-"))
    runs.mkdir(parents=True, exist_ok=True)
    try:
        if NEWCOMER in {split_agent(spec)[0] for spec in args.agents}:
            install_newcomer(runs)
        with contextlib.ExitStack() as stack:
            if args.serve_echo:
                url = stack.enter_context(serve_echo(runs))
                args.set = [f"agent.url={url}", *ECHO_SETS, *args.set]
            rows = measure_all(args, runs)
        if args.serve_echo:
            rows = [{**row, "env_id": "echo_env (openenv init)"} for row in rows]
    finally:
        if args.keep_runs is None:
            shutil.rmtree(runs, ignore_errors=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "niceness": os.nice(0),
        "zero_shot_only": args.zero_shot_only,
        "budget": None if args.zero_shot_only else budget_of(args),
        "training_seed": args.seed,
        "warm_start": args.warm_start,
        "curve_every": args.curve_every,
        "set": args.set,
        "eval_set": args.eval_set,
        "eval_episodes": args.eval_episodes,
        "eval_seed": args.eval_seed,
        "greedy": True,
        "agents": rows,
        "total_seconds": time.perf_counter() - started,
    }
    name = result_name(args.model)
    output = args.output or Path(__file__).resolve().parent / "results" / (
        f"{name}{'-quick' if args.quick else ''}.json")
    path = write_script_result(name, args.quick, output, result, argv)
    plotted = plot_curves(rows, path.with_suffix(".png"))
    for row in rows:
        if "zero_shot" not in row:
            print(f"{row['agent']} ({row['env_id']}): {row['failed']}")
            continue
        line = f"{row['agent']} ({row['env_id']}): zero-shot {_won(row['zero_shot'])}"
        if "failed" in row.get("training", {}):
            line += f", training {row['training']['failed']}"
        if "trained" in row:
            line += f", trained {_won(row['trained'])}"
        for point in row.get("curve", []):
            line += f"; update {point['update']}: {_share(point['won'])}"
        print(line)
    print(f"written to {path}" + (f" and {plotted}" if plotted else ""))
    return 0


def _share(won: float | None) -> str:
    return "–" if won is None else f"{won:.0%}"


def _won(evaluation: Mapping[str, Any]) -> str:
    numbers = evaluation["agent"]
    return f"won {_share(numbers['won'])}, mean return {numbers['mean']:+.3f}"


if __name__ == "__main__":
    raise SystemExit(main())
