"""A sparse reward: which of LlamaGym's tools move the tiny model on the slippery 4x4 lake.

    python benchmarks/sparse_rewards.py                     # 7 rows x seeds 0, 1, 1.5 min each
    python benchmarks/sparse_rewards.py --only ppo shaping  # some rows (the others are kept)
    python benchmarks/sparse_rewards.py --quick             # one row, one seed, seconds

FrozenLake-v1 on Gymnasium's 4x4 map with slippery ice (a move goes where it says one
time in three, else to either side) pays 1 for reaching the goal and nothing else: a
random policy gets there 1.4% of the time, the best policy 74% (exact values within the
env's 100-step limit, computed here from its transition table). The agent
(:class:`SparseLakeAgent`) is defined in this file and registered in the worker process
as a throwaway plugin, then trained in-process (``resolve_agent_config`` + ``Trainer``).
The ``ppo`` row is PPO in score mode with the agent's defaults; every other row changes
one thing: the reward-shaping hook (a term for each square closer to the goal), SFT
replay of the successful episodes after each update, SFT on recorded episodes of the
best policy before RL, a larger entropy bonus, generate mode with the default fallback
for an unreadable reply (the first action, ``left``), and generate mode with a random
legal action instead.

Every run trains for the same wall-clock budget (``--minutes``, or ``--episodes``), one
run at a time, each in a fresh process with one torch thread, then plays
``--eval-episodes`` seeded episodes greedily, beside the ``random`` and ``optimal``
baselines on the same seeds. Greedy success rate per run, per row over seeds, the
training batches' success rate update by update, and the command of each row go to
``benchmarks/results/sparse-rewards.json`` (``sparse-rewards-quick.json`` for
``--quick``); stdout gets the summary as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gymnasium  # noqa: E402

from benchmarks import rows  # noqa: E402
from benchmarks.rows import (  # noqa: E402
    RowBenchmark,
    Setup,
    update_records,
    with_demonstrations,
    worker_output,
)
from llamagym import hookimpl  # noqa: E402
from llamagym.agent import Agent  # noqa: E402
from llamagym.plugin_runtime.registry import AgentSpec  # noqa: E402

NAME = "sparse-lake"
RESULT_NAME = "sparse-rewards"
# Gymnasium's default 4x4 map: S start, F frozen, H hole, G goal; state = row * 4 + column.
LAKE = ("SFFF", "FHFH", "FFFH", "HFFG")
SIZE = len(LAKE)
GOAL = (SIZE - 1, SIZE - 1)
MAX_STEPS = 100  # the env's own time limit for the 4x4 map
ACTION_NAMES = ("left", "down", "right", "up")
# The distance term of the shaping row: this much for each step that ends one square
# closer to the goal (Manhattan distance), minus as much for a step that ends further.
SHAPING_SCALE = 0.05

AGENT = AgentSpec(
    name=NAME,
    entry_point="benchmarks.sparse_rewards:SparseLakeAgent",
    description="FrozenLake-v1, 4x4, slippery: reach the goal (reward 1) or fall in a hole",
    env_id="FrozenLake-v1",
)


# -- the exact values ---------------------------------------------------------------------
def transitions() -> dict[int, dict[int, list[tuple[float, int, float, bool]]]]:
    """The slippery lake's transition table, ``P[state][action]``."""
    env = gymnasium.make("FrozenLake-v1", is_slippery=True)
    table = env.unwrapped.P  # type: ignore[attr-defined]
    env.close()
    return table


def optimal_moves(table: Mapping[int, Any]) -> dict[int, int]:
    """The greedy policy of value iteration on the probability of reaching the goal."""
    value = [0.0] * len(table)

    def worth(state: int, action: int) -> float:
        return sum(
            p * (r + (0.0 if done else value[nxt])) for p, nxt, r, done in table[state][action]
        )

    for _ in range(2000):
        value = [max(worth(s, a) for a in range(4)) for s in range(len(table))]
    return {s: max(range(4), key=lambda a, s=s: worth(s, a)) for s in range(len(table))}


def success_probability(table: Mapping[int, Any], policy: Mapping[int, Sequence[float]]) -> float:
    """Exact chance of reaching the goal within :data:`MAX_STEPS` moves when, in each
    state, action ``a`` is taken with probability ``policy[state][a]``."""
    here = {0: 1.0}
    reached = 0.0
    for _ in range(MAX_STEPS):
        after: dict[int, float] = {}
        for state, mass in here.items():
            for action, chance in enumerate(policy[state]):
                if chance == 0:
                    continue
                for p, nxt, reward, done in table[state][action]:
                    if done:
                        reached += mass * chance * p * reward
                    else:
                        after[nxt] = after.get(nxt, 0.0) + mass * chance * p
        here = after
    return reached


TABLE = transitions()
OPTIMAL = optimal_moves(TABLE)


# -- the agent ----------------------------------------------------------------------------
def random_move(observation: Any, info: Any, legal: Sequence[str], rng: Any) -> str:
    return legal[int(rng.integers(len(legal)))]


def optimal_move(observation: Any, info: Any, legal: Sequence[str], rng: Any) -> str:
    return ACTION_NAMES[OPTIMAL[int(observation)]]


def distance_to_goal(state: int) -> int:
    row, column = divmod(int(state), SIZE)
    return abs(GOAL[0] - row) + abs(GOAL[1] - column)


class PositionInInfo(gymnasium.Wrapper):
    """Puts the square a step ended on into its ``info`` (``position``): the shaping hook
    sees the observation the move was chosen for, and the step's info."""

    def step(self, action: Any) -> Any:
        observation, reward, terminated, truncated, info = self.env.step(action)
        return observation, reward, terminated, truncated, {**info, "position": int(observation)}


@AGENT.bind
class SparseLakeAgent(Agent):
    action_names = ACTION_NAMES
    baselines = {"random": random_move, "optimal": optimal_move}
    outcome_names = ("goal", "no goal")
    defaults = {
        "rollout": {
            "mode": "score",
            "num_envs": 32,
            "history_turns": 0,
            "reply_prefix": '{"action": "',
            "max_new_tokens": 6,
        },
        "algorithm": {
            "name": "ppo",
            "lr": 1e-3,
            "episodes_per_update": 64,
            "minibatch_size": 128,
            "epochs": 4,
            "gamma": 0.99,
        },
        "training": {"minutes": 1.0, "eval_episodes": 300},
    }

    def make_env(self) -> Any:
        return PositionInInfo(gymnasium.make(AGENT.env_id, is_slippery=True))

    def get_system_prompt(self) -> str:
        if self.config.rollout.mode == "generate":
            return (
                "Cross the slippery frozen lake to the goal without falling in a hole. "
                'Reply with JSON only: {"action": "left"}, "down", "right" or "up".'
            )
        return "Cross the slippery frozen lake to the goal: left, down, right or up."

    def format_observation(self, observation: Any) -> str:
        row, column = divmod(int(observation), SIZE)
        return f"Row {row + 1}, column {column + 1}."

    def outcome(self, episode_return: float) -> str:
        return "goal" if episode_return > 0 else "no goal"


class LakePlugin:
    """Registers the agent, as a plugin's ``plugin.py`` would."""

    @hookimpl
    def llamagym_register_agents(self, register: Any) -> None:
        register(AGENT)


class DistanceShaping:
    """The shaping row's plugin: :data:`SHAPING_SCALE` per square closer to the goal."""

    @hookimpl
    def llamagym_shape_reward(
        self, agent: Any, observation: Any, action: str, reward: float, info: Any
    ) -> float | None:
        if agent.name != NAME or "position" not in info:
            return None
        return SHAPING_SCALE * (distance_to_goal(observation) - distance_to_goal(info["position"]))


# -- the rows -----------------------------------------------------------------------------
@dataclass(frozen=True)
class LakeSetup(Setup):
    """A row of this benchmark: a :class:`~benchmarks.rows.Setup` that may also turn the
    distance shaping on."""

    shaping: bool = False


GENERATE = {"rollout": {"mode": "generate"}}
SETUPS = (
    LakeSetup("ppo", "PPO, score mode, the agent's defaults"),
    LakeSetup(
        "shaping",
        f"+ reward shaping: {SHAPING_SCALE:+g} per square closer to the goal",
        {"rollout": {"reward_shaping": True}},
        shaping=True,
    ),
    LakeSetup(
        "replay",
        "+ SFT replay of the successful episodes after each update",
        {"algorithm": {"warm_start": {"replay": True, "min_return": 0.0, "steps": 2, "lr": 1e-3}}},
    ),
    LakeSetup(
        "demonstrations",
        "+ SFT on 200 episodes of the optimal baseline before RL",
        {"algorithm": {"warm_start": {"lr": 1e-3, "demonstration_epochs": 2}}},
        demonstrations="optimal",
    ),
    LakeSetup(
        "entropy-0.1", "entropy bonus 0.1 instead of 0.01", {"algorithm": {"entropy_coef": 0.1}}
    ),
    LakeSetup(
        "generate", "generate mode, unreadable reply: fallback to the first action, -1", GENERATE
    ),
    LakeSetup(
        "generate-random",
        "generate mode, unreadable reply: a random legal action, -1",
        {"rollout": {"mode": "generate", "invalid_action": {"policy": "random"}}},
    ),
)
QUICK_SETUP = "ppo"


# -- one run (a worker process) -----------------------------------------------------------
def train(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Train one row with one seed in this process; what the main process records."""
    import torch

    from llamagym.config import deep_merge
    from llamagym.resolver.layers import resolve_agent_config
    from llamagym.testing import temporary_plugin
    from llamagym.training.loop.trainer import Trainer

    setup = next(s for s in SETUPS if s.name == spec["setup"])
    threads = int(spec.get("threads") or 1)
    torch.set_num_threads(threads)
    run_dir = Path(spec["run_dir"])
    budget = {
        "training": {
            "seed": spec["seed"],
            "episodes": spec["episodes"],
            "minutes": spec["minutes"],
            "eval_episodes": spec["eval_episodes"],
            "threads": threads,
        },
        "output": worker_output(run_dir),
    }
    layers = deep_merge(dict(setup.settings), budget)
    started = time.perf_counter()
    with temporary_plugin(LakePlugin(), "sparse-lake"):
        shaping = temporary_plugin(DistanceShaping(), "distance-shaping") if setup.shaping else None
        with shaping or contextlib.nullcontext():
            layers, recording = with_demonstrations(
                SparseLakeAgent,
                setup,
                layers,
                int(spec["demonstration_episodes"]),
                run_dir,
                spec["seed"],
            )
            resolved = resolve_agent_config(SparseLakeAgent, [("row", layers)])
            agent = SparseLakeAgent(config=resolved)
            summary = Trainer(agent, agent.session).run()
    wall = time.perf_counter() - started
    updates = update_records(run_dir)
    evaluation = summary.evaluation
    assert evaluation is not None
    baselines = {b.name: {"success": b.mean, "ci95": b.ci95} for b in summary.baselines}
    return {
        "setup": setup.name,
        "seed": spec["seed"],
        "success": evaluation.mean,
        "ci95": evaluation.ci95,
        "eval_episodes": evaluation.episodes,
        "distinct_episodes": evaluation.distinct_episodes,
        "invalid_rate": evaluation.invalid_rate,
        "baselines": baselines,
        "episodes": summary.episodes,
        "updates": summary.updates,
        "env_steps": summary.env_steps,
        "train_seconds": summary.seconds,
        "wall_seconds": wall,
        "demonstrations": None if recording is None else recording.demonstrations,
        # Share of the training batches' episodes that reached the goal, update by update.
        "training_success": [round(float(r["return_mean"]), 4) for r in updates],
        "training_invalid_rate": [round(float(r.get("invalid_rate", 0.0)), 4) for r in updates],
    }


def train_in_package(spec: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`train` of the importable module: the class the registration names must be
    that module's, whatever ran the file."""
    from benchmarks import sparse_rewards

    return sparse_rewards.train(spec)


# -- the whole benchmark ------------------------------------------------------------------
def add_budget(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--minutes", type=float, default=None, help="training wall time per run (default 1.5)"
    )
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="train for this many episodes per run instead of --minutes",
    )


def budget(args: argparse.Namespace) -> dict[str, Any]:
    episodes = args.episodes or (64 if args.quick else None)
    return {"minutes": None if episodes else (args.minutes or 1.5), "episodes": episodes}


def line(run: Mapping[str, Any]) -> str:
    return (
        f"success {run['success']:.3f} ± {run['ci95']:.3f}  "
        f"invalid {run['invalid_rate']:.1%}  {run['episodes']} episodes  "
        f"{run['wall_seconds']:.0f}s"
    )


def findings(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The exact success rates of random and optimal play, and the baselines' rates as
    played on the runs' evaluation seeds."""
    return {
        "exact": {
            "random": success_probability(TABLE, {s: [0.25] * 4 for s in TABLE}),
            "optimal": success_probability(
                TABLE, {s: [float(a == OPTIMAL[s]) for a in range(4)] for s in TABLE}
            ),
        },
        "baselines": {
            name: statistics.fmean(run["baselines"][name]["success"] for run in runs)
            for name in ("random", "optimal")
        },
    }


BENCHMARK = RowBenchmark(
    script=Path(__file__).resolve(),
    result_name=RESULT_NAME,
    setups=SETUPS,
    quick_setup=QUICK_SETUP,
    description=__doc__.splitlines()[0],
    eval_episodes=300,
    add_budget=add_budget,
    budget=budget,
    train=train_in_package,
    line=line,
    head={"env": "FrozenLake-v1, 4x4, is_slippery=True, 100-step limit", "model": "tiny"},
    findings=findings,
)


def main(argv: Sequence[str] | None = None) -> int:
    return rows.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
