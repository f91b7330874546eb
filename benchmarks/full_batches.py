"""How full the rollout's forwards are, and what that buys, with and without carried
episodes (``rollout.carry_episodes``), and with and without rows grouped by length (a
score pass runs rows of unlike lengths apart, :func:`llamagym.models.passes.length_groups`),
SmolLM2-135M in score mode with each agent's pretrained defaults (8 envs), in one process
on the same machine.

    python benchmarks/full_batches.py                  # CartPole and TextWorld
    python benchmarks/full_batches.py --quick          # CartPole, 2 short collections

Each variant runs the collections of ``--updates`` updates (``episodes_per_update``
episodes each, the weights fixed, sampled as in training) and reports the rows a batched
decision holds on average (of 8), decisions per second, the episodes' mean length, the
decoder positions run per decision and the share of them that is padding. In lockstep
(carry off) the envs that finish wait for a collection's longest episode; carrying, every
env plays every step. The variant "padded" carries with every row of a decision in one
pass, padded to the longest (the grouping replaced by one group: the code before it).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from benchmarks.common import add_allow_dirty, refuse_dirty_tree, write_script_result  # noqa: E402


def agent_for(name: str, model: str, threads: int) -> Any:
    from llamagym.plugin_runtime.manager import get_plugins
    from llamagym.resolver.layers import resolve_agent_config

    agent_class = get_plugins().registry.get("agent", name).load()
    config = resolve_agent_config(agent_class, [("benchmark", {
        "model": {"name": model},
        "rollout": {"mode": "score"},
        "output": {"dir": None},
        "training": {"threads": threads},
    })])
    return agent_class(config=config)


@contextlib.contextmanager
def counting_padding(columns: dict[str, int], grouped: bool) -> Iterator[None]:
    """Count the real and the padding columns of every score pass laid out (from the
    masks :func:`block_causal_mask` is given); with ``grouped`` off, every rollout score
    pass runs all its rows together (one length group)."""
    from llamagym.models import passes, turn_passes

    real_mask, real_groups = passes.block_causal_mask, turn_passes.length_groups

    def counted(prompt_mask: Any, segment: Any, *rest: Any) -> Any:
        columns["real"] += int(prompt_mask.sum()) + int((segment >= 0).sum())
        columns["all"] += prompt_mask.numel() + segment.numel()
        return real_mask(prompt_mask, segment, *rest)

    passes.block_causal_mask = counted
    if not grouped:
        turn_passes.length_groups = lambda lengths: [list(range(len(lengths)))]
    try:
        yield
    finally:
        passes.block_causal_mask, turn_passes.length_groups = real_mask, real_groups


def measure(agent: Any, carry: bool, updates: int, grouped: bool = True) -> dict[str, Any]:
    engine, policy = agent.engine, agent.policy
    wanted = agent.config.algorithm.episodes_per_update
    decisions, passes = engine.stats.decisions, engine.stats.batched_decisions
    positions, columns = policy.positions_run, {"real": 0, "all": 0}
    started = time.perf_counter()
    episodes = []
    with counting_padding(columns, grouped):
        for update in range(updates):
            episodes += engine.play(wanted, carry=carry, policy_version=update)
    seconds = time.perf_counter() - started
    made = engine.stats.decisions - decisions
    engine.drop_carried()
    return {
        "positions_per_decision": (policy.positions_run - positions) / made,
        "padding_share": 1 - columns["real"] / max(columns["all"], 1),
        "episodes": len(episodes),
        "decisions": made,
        "seconds": seconds,
        "rows_per_forward": made / (engine.stats.batched_decisions - passes),
        "decisions_per_second": made / seconds,
        "episode_length": sum(e.length for e in episodes) / len(episodes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CartPole, 2 collections.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--agents", nargs="+", default=["cartpole", "textworld"])
    parser.add_argument("--updates", type=int, help="Collections per variant (default 4).")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree("full-batches", args.quick, args.allow_dirty)
    agents = ["cartpole"] if args.quick else args.agents
    updates = args.updates or (2 if args.quick else 4)
    result: dict[str, Any] = {"model": args.model, "updates": updates, "agents": {}}
    for name in agents:
        agent = agent_for(name, args.model, args.threads)
        agent.engine.play(agent.config.rollout.num_envs)  # warm-up, and the model loaded
        measured = result["agents"][name] = {
            "num_envs": agent.config.rollout.num_envs,
            "episodes_per_update": agent.config.algorithm.episodes_per_update,
            "lockstep": measure(agent, False, updates),
            "carried": measure(agent, True, updates),
            "padded": measure(agent, True, updates, grouped=False),
        }
        measured["speedup"] = (measured["carried"]["decisions_per_second"]
                               / measured["lockstep"]["decisions_per_second"])
        measured["grouping_speedup"] = (measured["carried"]["decisions_per_second"]
                                        / measured["padded"]["decisions_per_second"])
        for variant in ("lockstep", "carried", "padded"):
            row = measured[variant]
            print(f"{name} {variant}: {row['rows_per_forward']:.2f} rows per forward, "
                  f"{row['decisions_per_second']:.1f} decisions/s, "
                  f"{row['positions_per_decision']:.0f} positions per decision "
                  f"({row['padding_share']:.0%} padding)", flush=True)
        agent.engine.close()
    path = write_script_result("full-batches", args.quick, args.output, result)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
