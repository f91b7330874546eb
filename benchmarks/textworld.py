"""TextWorld in score mode: success rate on the training games and on unseen ones, beside
the random-admissible and walkthrough baselines (and, for a pretrained model, its
zero-shot success).

    python benchmarks/textworld.py            # tiny, 20 games (3 rooms, quests of 2-3), 15 min
    python benchmarks/textworld.py --quick    # 4 games, 1 min of training: a smoke run
    python benchmarks/textworld.py --model smollm2-135m --minutes 30 --training-only
    python benchmarks/textworld.py --model smollm2-135m --preset w2-o3-q4 --minutes 30

1. The games are generated (or found in the cache) first, so generation never eats into
   the training budget: the training pool has seeds 0..N-1, the unseen pool seeds
   1000..1000+N-1, both with the same parameters (with ``--preset``, a published game
   set: the unseen pool is its held-out test pool, ``agent.pool=test``).
2. Training is the CLI a user would type (``llamagym run textworld --minutes M --seed S
   --set agent.games=N ... --output DIR --quiet``), with the agent's default settings.
3. The final checkpoint then plays every game of each pool once, greedily (one env per
   game, so each game counts exactly once), and a game is a success when it is won
   within the agent's step limit. The random baseline plays each game several times;
   the walkthrough once (a check that every game is winnable).

Results go to ``benchmarks/results/textworld.json`` (``textworld-quick.json`` for
``--quick``), beside the target of at least 90% on the training games.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable,
    # and keep this file's folder off the path, or `import textworld` would find this file
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    refuse_dirty_tree,
    write_script_result,
)

TARGET = 0.9  # the tiny model, 15 minutes
PRETRAINED_TARGET = 0.5  # a pretrained model (SmolLM2-135M), 30 minutes on a 2-core CPU
UNSEEN_FIRST_SEED = 1000


def game_settings(games: int, first_seed: int, world_size: int, quest: tuple[int, int],
                  max_steps: int) -> dict[str, Any]:
    return {
        "games": games,
        "first_seed": first_seed,
        "world_size": world_size,
        "quest_min_length": quest[0],
        "quest_max_length": quest[1],
        "max_episode_steps": max_steps,
    }


def train_command(seed: int, minutes: float, output: Path, settings: dict[str, Any],
                  extra: list[str], model: str = "tiny") -> list[str]:
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    line = [
        executable, "run", "textworld",
        "--model", model,
        "--minutes", str(minutes),
        "--seed", str(seed),
        "--eval-episodes", "0",  # evaluated below, game by game
        "--output", str(output),
        "--quiet",
        "--set", "output.report=false",
    ]
    for key, value in settings.items():
        line += ["--set", f"agent.{key}={value}"]
    for assignment in extra:
        line += ["--set", assignment]
    return line


def run_measured(line: list[str]) -> tuple[int, str, float]:
    """Run the training command; its exit code, its stderr and its peak resident set
    size in GB (the training process's own, from the kernel's accounting of it)."""
    with tempfile.TemporaryFile(mode="w+") as stderr:
        process = subprocess.Popen(line, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        # Linux counts ru_maxrss in KiB, macOS in bytes.
        scale = 1024**3 if sys.platform == "darwin" else 1024**2
        return process.returncode, stderr.read(), usage.ru_maxrss / scale


def load_trained_agent(run_dir: Path) -> Any:
    from llamagym import load_agent

    return load_agent(run_dir, agent="textworld")


def untrained_agent(model: str, settings: dict[str, Any], extra: list[str]) -> Any:
    """The agent as a run would start it: the model before any update, and before any
    warm start (the algorithm's settings, demonstrations among them, are left out)."""
    from llamagym.cli.run_commands import resolve_run_config

    assignments = [f"agent.{key}={value}" for key, value in settings.items()]
    assignments += [item for item in extra if not item.startswith("algorithm.")]
    agent_class, resolved = resolve_run_config("textworld", None, assignments,
                                               {"model.name": model})
    return agent_class(config=resolved)


def play_agent(agent: Any, game_files: list[Path]) -> list[dict[str, Any]]:
    """One greedy episode per game, ``num_envs`` games at a time."""
    import torch

    chunk = agent.config.rollout.num_envs
    outcomes = []
    agent.policy.eval()
    with torch.no_grad():
        for start in range(0, len(game_files), chunk):
            files = game_files[start : start + chunk]
            envs = [agent.make_env([path]) for path in files]
            try:
                # Episode k starts on env k (each env holds one game), so the seeds only
                # matter for reproducibility, not for which game is played.
                episodes = agent.engine.collect(envs, len(envs), greedy=True,
                                                seeds=list(range(len(envs))))
            finally:
                for env in envs:
                    env.close()
            for episode in episodes:
                outcomes.append({
                    "game": Path(str(episode.info.get("game_file", ""))).parent.name,
                    "won": bool(episode.info.get("won")),
                    "steps": episode.length,
                    # what each turn sent the game (agent.parser=game: what it wrote)
                    "commands": [turn.env_action if turn.action_index is None
                                 else turn.legal_actions[turn.action_index]
                                 for turn in episode.turns],
                })
    return sorted(outcomes, key=lambda outcome: outcome["game"])


def play_baselines(agent: Any, game_files: list[Path], random_episodes: int) -> dict[str, float]:
    from llamagym_textworld.baselines import (
        RandomAdmissiblePolicy,
        WalkthroughPolicy,
        play_episode,
    )

    wins = {"random": [], "walkthrough": []}
    for index, path in enumerate(game_files):
        env = agent.make_env([path])
        try:
            for k in range(random_episodes):
                policy = RandomAdmissiblePolicy(seed=1000 * index + k)
                wins["random"].append(play_episode(env, policy, seed=k).won)
            wins["walkthrough"].append(play_episode(env, WalkthroughPolicy(), seed=0).won)
        finally:
            env.close()
    return {name: statistics.fmean(values) for name, values in wins.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 games, 1 minute: a smoke run.")
    parser.add_argument("--minutes", type=float, help="Training budget per seed.")
    parser.add_argument("--games", type=int, help="Games per pool (training and unseen).")
    parser.add_argument("--seeds", type=int, nargs="+", help="Training seeds to run.")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="Extra KEY=VALUE for the training run, e.g. algorithm.lr=2e-3.")
    parser.add_argument("--keep-runs", type=Path, help="Keep run directories here.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    parser.add_argument("--training-only", action="store_true",
                        help="Measure the training games only (for a slow model).")
    parser.add_argument("--model", default="tiny",
                        help="Model to train; any but tiny is also measured zero-shot.")
    parser.add_argument("--preset", choices=["w2-o3-q4", "w4-o6-q8"],
                        help="A published game set (agent.preset); its unseen games are "
                        "its held-out test pool (agent.pool=test).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    quick = args.quick
    refuse_dirty_tree("textworld", quick, args.allow_dirty)
    minutes = args.minutes or (1.0 if quick else 15.0)
    games = args.games or (4 if quick else 20)
    seeds = args.seeds or [0]
    world_size, nb_objects, quest = 3, 5, (2, 3)
    max_steps = 10 if quick else 30
    unseen_first_seed = UNSEEN_FIRST_SEED
    from llamagym_textworld.agent import PRESETS, TEST_POOL_OFFSET
    from llamagym_textworld.games import make_games

    if args.preset:
        preset = PRESETS[args.preset]
        world_size, nb_objects = preset["world_size"], preset["nb_objects"]
        quest = (preset["quest_min_length"], preset["quest_max_length"])
        max_steps, unseen_first_seed = preset["max_episode_steps"], TEST_POOL_OFFSET
    random_episodes = 2 if quick else 5
    extra = list(args.extra)
    if quick:  # small updates, so the one-minute budget holds several of them
        extra = ["algorithm.episodes_per_update=8", *extra]

    started = time.perf_counter()
    pools: dict[str, list[Path]] = {}
    for pool, first_seed in (("training", 0), ("unseen", unseen_first_seed)):
        if pool == "unseen" and args.training_only:
            continue
        pools[pool] = make_games(games, first_seed=first_seed, world_size=world_size,
                                 nb_objects=nb_objects, quest_length=quest)
    generation_seconds = time.perf_counter() - started
    print(f"{len(pools) * games} games ready in {generation_seconds:.0f}s", flush=True)

    runs_dir = args.keep_runs or Path(tempfile.mkdtemp(prefix="llamagym-textworld-bench-"))
    runs_dir.mkdir(parents=True, exist_ok=True)
    settings = game_settings(games, 0, world_size, quest, max_steps)
    settings["nb_objects"] = nb_objects
    runs = []
    baselines: dict[str, dict[str, float]] = {}
    zero_shot = None
    if args.model != "tiny":  # the tiny model's untrained weights are random: nothing to see
        untrained = untrained_agent(args.model, settings, extra)
        zero_shot = {pool: statistics.fmean(o["won"] for o in play_agent(untrained, files))
                     for pool, files in pools.items()}
        print(f"zero-shot success: {zero_shot}", flush=True)
        del untrained
    for seed in seeds:
        output = runs_dir / f"seed{seed}"
        shutil.rmtree(output, ignore_errors=True)
        line = train_command(seed, minutes, output, settings, extra, args.model)
        print("$", " ".join(line), flush=True)
        run_started = time.perf_counter()
        returncode, stderr, peak_rss_gb = run_measured(line)
        if returncode != 0:
            raise RuntimeError(f"seed {seed} failed ({returncode}):\n{stderr[-2000:]}")
        train_wall = time.perf_counter() - run_started
        metrics = output / "metrics.jsonl"  # absent when the budget ended inside update 1
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        records = [json.loads(line) for line in lines]
        updates = [r for r in records if r.get("kind") == "update"]
        agent = load_trained_agent(output)
        outcomes = {pool: play_agent(agent, files) for pool, files in pools.items()}
        if not baselines:  # the same for every seed: games and step limit do not change
            baselines = {pool: play_baselines(agent, files, random_episodes)
                         for pool, files in pools.items()}
        runs.append({
            "seed": seed,
            "success": {pool: statistics.fmean(o["won"] for o in found)
                        for pool, found in outcomes.items()},
            "updates": len(updates),
            "episodes": int(updates[-1]["total_episodes"]) if updates else 0,
            "env_steps": int(updates[-1]["env_steps"]) if updates else 0,
            "train_seconds": float(updates[-1]["seconds"]) if updates else 0.0,
            "wall_seconds": train_wall,
            "train_peak_rss_gb": peak_rss_gb,
            # Mean return of the sampled training episodes, batch by batch (the games
            # give 1 point, for the win, so without a progress reward or other shaping a
            # batch's mean return is its win rate).
            "training_curve": [{"seconds": float(r["seconds"]), "update": int(r["update"]),
                                "return": float(r["return_mean"]),
                                "episode_length": float(r["episode_length"])}
                               for r in updates],
            "games": outcomes,
            "command": " ".join(line[1:]),
        })

    summary = {
        pool: statistics.fmean(run["success"][pool] for run in runs) for pool in pools
    }
    target = TARGET if args.model == "tiny" else PRETRAINED_TARGET
    result = {
        "model": args.model,
        "mode": "generate" if "rollout.mode=generate" in extra else "score",
        "preset": args.preset,
        "nb_objects": nb_objects,
        "zero_shot_success": zero_shot,
        "minutes_per_seed": minutes,
        "games_per_pool": games,
        "world_size": world_size,
        "quest_length": list(quest),
        "max_episode_steps": max_steps,
        "summary": {
            "success_training_games": summary["training"],
            "success_unseen_games": summary.get("unseen"),
            "target_training_games": target,
            "meets_target": summary["training"] >= target,
            "baselines": baselines,
        },
        "runs": runs,
        "generation_seconds": generation_seconds,
        "total_seconds": time.perf_counter() - started,
    }
    path = write_script_result("textworld", quick, args.output, result)
    if args.keep_runs is None:
        shutil.rmtree(runs_dir, ignore_errors=True)

    for run in runs:
        print(f"seed {run['seed']}: {run['episodes']} episodes in {run['train_seconds']:.0f}s "
              f"(peak RSS {run['train_peak_rss_gb']:.2f} GB); "
              + ", ".join(f"{run['success'][pool]:.0%} on {pool} games" for pool in pools))
    for pool in pools:
        print(f"{pool:>8} games: agent {summary[pool]:.0%}, random "
              f"{baselines[pool]['random']:.0%}, walkthrough {baselines[pool]['walkthrough']:.0%}")
    met = "met" if summary["training"] >= target else "not met"
    print(f"target >= {target:.0%} on the training games: {met}; written to {path}")


if __name__ == "__main__":
    main()
