"""Many actions, several turns: which settings move the tiny model on the number-guessing
game that ``llamagym new-plugin NAME --env-class`` writes.

    python benchmarks/many_actions.py                         # every row x seeds 0, 1
    python benchmarks/many_actions.py --only ppo grpo         # some rows (the others are kept)
    python benchmarks/many_actions.py --quick                 # one row, one seed, seconds

The game is the scaffold's own, rendered into a temporary directory by
:func:`llamagym.devtools.scaffold.write_plugin` (``env_class=True``) and registered in the
worker process through its ``plugin.py`` module (``llamagym_register_agents`` and
``llamagym_register_envs``): a secret number from 1 to 16, sixteen actions (guess 1 to
16), a hint after each guess (higher or lower), reward 1 for the correct guess, cut off
after 8 guesses. Guessing at random finds the secret 40.3% of the time
(1 - (15/16)^8); the agent's ``binary-search`` baseline always finds it, in 3.4 guesses
on average. A greedy policy that keeps one guess finds it 1/16 of the time.

The ``ppo`` row trains with the agent's defaults (PPO, score mode, 16 episodes per
update, lr 1e-3, 4 epochs, gamma 0.9, no history). Every other row changes one thing:
see :data:`SETUPS`. Runs are budgeted in episodes (``--episodes``), not minutes, so a
busy machine slows a row down without changing its numbers. One run at a time, each in
a fresh process with one torch thread, then ``--eval-episodes`` seeded episodes played
greedily beside the ``random`` and ``binary-search`` baselines on the same seeds. Per
run: the share of secrets found (which is the mean return: the game pays 1 once, for
the correct guess), the mean number of guesses, the policy's entropy over the sixteen
names at the first and the last update, and the training batches' share found update
by update. The summary per row, with its command, goes to
``benchmarks/results/many-actions.json`` (``many-actions-quick.json`` for ``--quick``);
stdout gets the summary as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import rows  # noqa: E402
from benchmarks.rows import (  # noqa: E402
    RowBenchmark,
    Setup,
    update_records,
    with_demonstrations,
    worker_output,
)

RESULT_NAME = "many-actions"
#: The plugin's name: the package is ``llamagym_guessing``, the env ``Guessing-v0``.
NAME = "guessing"
ACTIONS = 16
MAX_GUESSES = 8
BASELINES = ("random", "binary-search")


@dataclass(frozen=True)
class GameSetup(Setup):
    """A row of this benchmark: a :class:`~benchmarks.rows.Setup` that may also show the
    model less of each observation (``observation="hints"``: the last guess and its hint,
    not the range that is left, which the earlier turns then have to give)."""

    observation: str = "full"


#: The agent's own algorithm settings (its ``defaults``), for the rows that keep them.
AGENT_NUMBERS = {
    "lr": 1e-3,
    "episodes_per_update": 16,
    "minibatch_size": 64,
    "epochs": 4,
    "gamma": 0.9,
}
SETUPS = (
    GameSetup("ppo", "PPO, score mode, the agent's defaults"),
    GameSetup(
        "batch-64",
        "64 episodes per update instead of 16",
        {"algorithm": {"episodes_per_update": 64}},
    ),
    GameSetup("lr-3e-3", "learning rate 3e-3 instead of 1e-3", {"algorithm": {"lr": 3e-3}}),
    GameSetup(
        "entropy-0.05",
        "entropy bonus 0.05 instead of 0.01",
        {"algorithm": {"entropy_coef": 0.05}},
    ),
    GameSetup("gamma-1", "gamma 1.0 instead of 0.9", {"algorithm": {"gamma": 1.0}}),
    # Naming another algorithm drops the agent's PPO settings (GRPO's own defaults are
    # 64 episodes per update, 2 epochs, gamma 1): give GRPO the same numbers.
    GameSetup(
        "grpo",
        "GRPO (groups of 8) instead of PPO, with the agent's numbers",
        {"algorithm": {"name": "grpo", **AGENT_NUMBERS}},
    ),
    GameSetup("history-1", "the prompt keeps the last turn", {"rollout": {"history_turns": 1}}),
    GameSetup(
        "hints-history",
        "the observation says the last guess and its hint only (no range); "
        "the prompt keeps every earlier turn",
        {"rollout": {"history_turns": MAX_GUESSES}},
        observation="hints",
    ),
    GameSetup(
        "demonstrations",
        "+ SFT on 200 episodes of the binary-search baseline before RL (10 epochs)",
        {"algorithm": {"warm_start": {"lr": 1e-3, "demonstration_epochs": 10}}},
        demonstrations="binary-search",
    ),
)
QUICK_SETUP = "ppo"


# -- the game -----------------------------------------------------------------------------
def render_game(directory: Path) -> Path:
    """Write the ``--env-class`` plugin package into ``directory``; its ``src`` folder."""
    from llamagym.devtools.scaffold import write_plugin

    _, root = write_plugin(NAME, "env", directory, env_class=True)
    return root / "src"


@contextlib.contextmanager
def game() -> Iterator[Any]:
    """The rendered game, importable and registered for the ``with`` block: yields its
    ``agent`` module."""
    from llamagym.testing import temporary_plugin

    with tempfile.TemporaryDirectory(prefix="llamagym-guessing-") as directory:
        source = str(render_game(Path(directory)))
        sys.path.insert(0, source)
        try:
            plugin = importlib.import_module(f"llamagym_{NAME}.plugin")
            with temporary_plugin(plugin, NAME):
                yield importlib.import_module(f"llamagym_{NAME}.agent")
        finally:
            sys.path.remove(source)


def hints_only(agent_class: type) -> type:
    """``agent_class`` with an observation that leaves out the range still possible."""
    env = importlib.import_module(f"llamagym_{NAME}.env")
    hints, none_yet = env.HINTS, env.NONE_YET

    class HintsOnly(agent_class):  # type: ignore[misc, valid-type]
        def format_observation(self, observation: Any) -> str:
            guess, hint = int(observation["guess"]), int(observation["hint"])
            if hint == none_yet:
                return "No guess yet."
            return f"Your last guess, {guess}: {hints[hint]}."

    HintsOnly.__name__ = HintsOnly.__qualname__ = f"HintsOnly{agent_class.__name__}"
    return HintsOnly


def exact_baselines() -> dict[str, dict[str, float]]:
    """Share found and mean guesses of the two baselines, exactly: random play guesses
    uniformly with replacement; binary search is played on every secret."""
    miss = (ACTIONS - 1) / ACTIONS
    with game() as module:
        legal = list(module.ACTION_NAMES)
        env = importlib.import_module(f"llamagym_{NAME}.env").GuessingEnv()
        lengths = []
        for secret in range(1, ACTIONS + 1):
            observation, info = env.reset(seed=0)
            env.secret = secret
            done, guesses = False, 0
            while not done:
                action = legal.index(module.binary_search(observation, info, legal, None))
                observation, _, terminated, truncated, info = env.step(action)
                guesses += 1
                done = terminated or truncated
            lengths.append(guesses)
    return {
        "random": {
            "found": 1 - miss**MAX_GUESSES,
            "guesses": sum(miss**k for k in range(MAX_GUESSES)),
        },
        "binary-search": {"found": 1.0, "guesses": statistics.fmean(lengths)},
        # A greedy policy stuck on one number: right at once, or wrong every time.
        "one-fixed-guess": {
            "found": 1 / ACTIONS,
            "guesses": (1 + (ACTIONS - 1) * MAX_GUESSES) / ACTIONS,
        },
    }


# -- one run (a worker process) -----------------------------------------------------------
def play_baselines(agent: Any, seeds: Sequence[int], seed: int) -> dict[str, dict[str, float]]:
    """Each baseline on the evaluation's seeds: share found and mean guesses."""
    from llamagym.rollout.evaluation import play_baseline

    played = {}
    for name in BASELINES:
        returns = [0.0] * len(seeds)
        guesses = [0] * len(seeds)
        for step in play_baseline(agent, name, seeds, rng_seed=seed):
            returns[step.episode] += step.reward
            guesses[step.episode] += 1
        played[name] = {
            "found": statistics.fmean(float(r > 0) for r in returns),
            "mean_return": statistics.fmean(returns),
            "guesses": statistics.fmean(guesses),
        }
    return played


def train(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Train one row with one seed in this process; what the main process records."""
    import torch

    from llamagym.config import deep_merge
    from llamagym.resolver.layers import resolve_agent_config
    from llamagym.rollout.evaluation import evaluate_agent, evaluation_seeds
    from llamagym.training.loop.trainer import Trainer

    setup = next(s for s in SETUPS if s.name == spec["setup"])
    threads = int(spec.get("threads") or 1)
    torch.set_num_threads(threads)
    run_dir = Path(spec["run_dir"])
    seed, eval_episodes = int(spec["seed"]), int(spec["eval_episodes"])
    budget = {
        # The evaluation is played below, with each episode's length kept.
        "training": {
            "seed": seed,
            "episodes": spec["episodes"],
            "eval_episodes": 0,
            "threads": threads,
        },
        "output": worker_output(run_dir),
    }
    started = time.perf_counter()
    with game() as module:
        agent_class = module.GuessingAgent
        if setup.observation == "hints":
            agent_class = hints_only(agent_class)
        layers, recording = with_demonstrations(
            agent_class,
            setup,
            deep_merge(dict(setup.settings), budget),
            int(spec["demonstration_episodes"]),
            run_dir,
            seed,
        )
        agent = agent_class(config=resolve_agent_config(agent_class, [("row", layers)]))
        summary = Trainer(agent, agent.session).run()
        evaluated = time.perf_counter()
        played: list[Any] = []
        evaluation = evaluate_agent(
            agent.evaluation_engine(), eval_episodes, seed=seed, examples=played
        )
        baselines = play_baselines(agent, evaluation_seeds(seed, eval_episodes), seed)
    wall = time.perf_counter() - started
    updates = update_records(run_dir)
    entropies = [float(r["entropy"]) for r in updates if "entropy" in r]
    return {
        "setup": setup.name,
        "seed": seed,
        "mean_return": evaluation.mean,
        "found": evaluation.outcomes.get("found", 0.0),
        "ci95": evaluation.ci95,
        "guesses": statistics.fmean(e.length for e in played),
        "eval_episodes": evaluation.episodes,
        "distinct_episodes": evaluation.distinct_episodes,
        # The greedy policy's first guess, the same in every episode.
        "first_guess": played[0].turns[0].legal_actions[played[0].turns[0].action_index],
        "invalid_rate": evaluation.invalid_rate,
        "baselines": baselines,
        "episodes": summary.episodes,
        "updates": summary.updates,
        "env_steps": summary.env_steps,
        "train_seconds": summary.seconds,
        "eval_seconds": time.perf_counter() - evaluated,
        "wall_seconds": wall,
        "demonstrations": None if recording is None else recording.demonstrations,
        "entropy_start": entropies[0] if entropies else None,
        "entropy_end": entropies[-1] if entropies else None,
        # Share of the training batches' episodes that found the secret, update by update.
        "training_found": [round(float(r["return_mean"]), 4) for r in updates],
        "training_guesses": [round(float(r["episode_length"]), 3) for r in updates],
    }


# -- the whole benchmark ------------------------------------------------------------------
def add_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--episodes", type=int, default=None, help="training episodes per run (default 2000)"
    )


def budget(args: argparse.Namespace) -> dict[str, Any]:
    return {"episodes": args.episodes or (64 if args.quick else 2000)}


def line(run: Mapping[str, Any]) -> str:
    entropy = run["entropy_end"]
    return (
        f"found {run['found']:.3f}  guesses {run['guesses']:.2f}  "
        f"entropy {'-' if entropy is None else f'{entropy:.2f}'}  "
        f"{run['episodes']} episodes  {run['wall_seconds']:.0f}s"
    )


def findings(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The most entropy sixteen names can have, the baselines' exact values and their
    values as played on the runs' evaluation seeds."""
    return {
        "max_entropy": math.log(ACTIONS),
        "exact": exact_baselines(),
        "baselines": {
            name: {
                key: statistics.fmean(run["baselines"][name][key] for run in runs)
                for key in ("found", "guesses")
            }
            for name in BASELINES
        },
    }


BENCHMARK = RowBenchmark(
    script=Path(__file__).resolve(),
    result_name=RESULT_NAME,
    setups=SETUPS,
    quick_setup=QUICK_SETUP,
    description=__doc__.splitlines()[0],
    eval_episodes=200,
    add_budget=add_budget,
    budget=budget,
    train=train,
    line=line,
    head={
        "env": f"the --env-class scaffold's game: a secret number 1..{ACTIONS}, "
        f"Discrete({ACTIONS}) guesses, higher/lower hints, reward 1 for the correct guess, "
        f"truncated after {MAX_GUESSES} guesses",
        "model": "tiny",
    },
    findings=findings,
    measure="mean_return",
    also_per_seed=("found", "guesses", "entropy_start", "entropy_end"),
)


def main(argv: Sequence[str] | None = None) -> int:
    return rows.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
