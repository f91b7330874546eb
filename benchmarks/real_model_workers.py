"""The measurements of ``real_model.py``'s experiments, each in a fresh process.

    python -m benchmarks.real_model_workers --worker '{"work": "speed", ...}'

``real_model.py`` starts them (``run_worker`` in ``common.py``) with a JSON spec whose
``work`` names one of :data:`WORKERS`; each loads SmolLM2 (or the spec's ``model``),
measures, and prints its answer as one marked JSON line. What each measures is in
``real_model.py``'s docstring, under the experiment that runs it.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the `benchmarks` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import peak_rss_mb, worker_main  # noqa: E402
from benchmarks.learning import exact_greedy_value  # noqa: E402


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


if __name__ == "__main__":
    raise SystemExit(worker_main(None, lambda spec: WORKERS[spec["work"]](spec)))
