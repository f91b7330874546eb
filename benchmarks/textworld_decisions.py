"""What a TextWorld decision costs in the rollout, SmolLM2-135M in score mode, before and
after the two changes that cut it, in one process on the same machine:

* the frozen trunk (the 26 layers below LoRA's 4) in bfloat16 (``model.trunk_dtype``);
* the game's goal said once, in the episode's system prompt (``Agent.episode_context``),
  where each env's turn cache keeps it, instead of at the head of every user turn.

    python benchmarks/textworld_decisions.py            # 16 sampled episodes per variant
    python benchmarks/textworld_decisions.py --quick    # 4 episodes, 4 steps: a smoke run

Each variant plays the same seeds (sampled, the rollout's way, from the same untrained
weights) over 8 envs and reports decisions per second, decoder positions per decision
and the model's share of the time. Before them, the bare trunk: a forward of 8 x 128
tokens through SmolLM2's decoder with its trunk in float32 and in bfloat16 (tokens/s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    _here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _here]
    sys.path.insert(0, str(_here.parent))

from benchmarks.common import add_allow_dirty, refuse_dirty_tree, write_script_result  # noqa: E402

VARIANTS = {  # name: (trunk dtype, goal once)
    "before (float32 trunk, goal in every turn)": ("float32", False),
    "bfloat16 trunk": ("bfloat16", False),
    "goal once": ("float32", True),
    "both (as shipped)": ("auto", True),
}


def agent_for(model: str, trunk_dtype: str, goal_once: bool, envs: int, steps: int) -> Any:
    from llamagym_textworld.agent import TextWorldAgent

    class GoalInEveryTurn(TextWorldAgent):
        """The prompt as it was: the goal at the head of every user turn."""

        def episode_context(self, observation: Any, info: Any) -> str | None:
            return None

        def format_observation(self, observation: Any, info: dict) -> str:
            text = super().format_observation(observation, info)
            objective = str(info.get("objective") or "").strip()
            return f"Goal: {objective}\n\n{text}" if objective else text

    agent_class = TextWorldAgent if goal_once else GoalInEveryTurn
    return agent_class(config={
        "model": {"name": model, "trunk_dtype": trunk_dtype},
        "output": {"dir": None},
        "rollout": {"num_envs": envs},
        "agent": {"games": 20, "max_episode_steps": steps},
        "training": {"threads": 2},
    })


def bare_trunk(agent: Any, repeats: int) -> float:
    """Tokens per second of the decoder's forward over 8 rows of 128 tokens."""
    import torch

    from llamagym.models.decoder import decoder_and_head

    decoder = decoder_and_head(agent.policy.model)[0]
    ids = torch.randint(100, 40_000, (8, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        decoder(input_ids=ids[:2])  # warm-up
        started = time.perf_counter()
        for _ in range(repeats):
            decoder(input_ids=ids)
    return repeats * ids.numel() / (time.perf_counter() - started)


def measure(agent: Any, episodes: int, seeds: list[int]) -> dict[str, Any]:
    policy, engine = agent.policy, agent.engine
    engine.play(len(engine.envs), seeds=seeds[: len(engine.envs)],  # warm-up: one turn
                should_stop=lambda: True)
    positions, model_seconds = policy.positions_run, engine.stats.seconds_model
    started = time.perf_counter()
    batch = engine.play(episodes, seeds=seeds)
    seconds = time.perf_counter() - started
    turns = [turn for episode in batch for turn in episode.turns]
    return {
        "episodes": len(batch),
        "decisions": len(turns),
        "seconds": seconds,
        "decisions_per_second": len(turns) / seconds,
        "decoder_positions_per_decision": (policy.positions_run - positions) / len(turns),
        "prompt_tokens_per_decision": sum(len(t.prompt_tokens) for t in turns) / len(turns),
        "model_share": (engine.stats.seconds_model - model_seconds) / seconds,
        "won": sum(bool(e.info.get("won")) for e in batch) / len(batch),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="4 episodes of 4 steps.")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--episodes", type=int, help="Episodes per variant (default 16).")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree("textworld-decisions", args.quick, args.allow_dirty)
    episodes = args.episodes or (4 if args.quick else 16)
    steps, envs = (4, 4) if args.quick else (30, 8)
    seeds = list(range(episodes))
    result: dict[str, Any] = {"model": args.model, "envs": envs, "max_episode_steps": steps,
                              "episodes": episodes, "variants": {}}
    bare: dict[str, float] = {}
    for name, (trunk_dtype, goal_once) in VARIANTS.items():
        agent = agent_for(args.model, trunk_dtype, goal_once, envs, steps)
        if not goal_once:  # the bare trunk, once per dtype
            bare[trunk_dtype] = bare_trunk(agent, 2 if args.quick else 10)
        result["variants"][name] = measured = measure(agent, episodes, seeds)
        print(f"{name}: {measured['decisions_per_second']:.2f} decisions/s, "
              f"{measured['decoder_positions_per_decision']:.0f} positions per decision",
              flush=True)
        agent.engine.close()
    result["bare_trunk_tokens_per_second"] = bare
    result["bare_trunk_speedup"] = bare["bfloat16"] / bare["float32"]
    rates = {name: v["decisions_per_second"] for name, v in result["variants"].items()}
    before = rates["before (float32 trunk, goal in every turn)"]
    result["speedup"] = {name: rate / before for name, rate in rates.items()}
    from llamagym.models.trunk_precision import cpu_bf16_flags

    result["cpu_bf16_flags"] = list(cpu_bf16_flags())
    path = write_script_result("textworld-decisions", args.quick, args.output, result)
    print(f"bare trunk: bfloat16 {result['bare_trunk_speedup']:.2f}x float32; "
          f"rollout: {result['speedup']['both (as shipped)']:.2f}x decisions/s -> {path}")


if __name__ == "__main__":
    main()
