"""The frozen trunk in bfloat16 (``model.trunk_dtype``): the layers below the trained ones
compute in bfloat16, the trained layers, the value head and the loss stay in float32.

On SmolLM2-135M (LoRA on its last 4 layers, as shipped) the bfloat16 trunk must choose
as the float32 one does on real decisions of Blackjack, CartPole and TextWorld, and
``float32`` must change nothing at all. On the tiny model: the casts at the trunk's
edges, its states kept in bfloat16, and an update that trains the top layers through
them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llamagym.models.decoder import decoder_and_head
from llamagym.models.trunk import decoder_layers
from llamagym.models.trunk_precision import choose_trunk_dtype, cpu_bf16_flags
from llamagym.testing import tiny_agent


def test_auto_follows_the_hardware_and_an_explicit_setting_wins() -> None:
    dtype, why = choose_trunk_dtype("auto", torch.device("cpu"))
    assert dtype == (torch.bfloat16 if cpu_bf16_flags() else torch.float32)
    assert "CPU" in why
    assert choose_trunk_dtype("float32", torch.device("cpu"))[0] == torch.float32
    assert choose_trunk_dtype("bfloat16", torch.device("cpu"))[0] == torch.bfloat16


def _tiny(trunk_dtype: str) -> Any:
    from llamagym_blackjack.agent import BlackjackAgent

    return tiny_agent(
        BlackjackAgent,
        model={"lora": True, "lora_layers": 1, "trunk_dtype": trunk_dtype},
        rollout={"mode": "score", "num_envs": 4},
        algorithm={"episodes_per_update": 8, "minibatch_size": 8, "epochs": 1},
    )


def test_a_bfloat16_trunk_trains_the_float32_layers_above_it() -> None:
    agent = _tiny("bfloat16")
    policy = agent.policy
    layers = decoder_layers(decoder_and_head(policy.model)[0])
    assert layers is not None and policy.trunk is not None
    start = policy.trunk.start
    assert all(p.dtype == torch.bfloat16 for layer in layers[:start] for p in layer.parameters())
    assert all(p.dtype == torch.float32 for layer in layers[start:] for p in layer.parameters())
    assert policy.value_head.weight.dtype == torch.float32
    before = {n: p.detach().clone() for n, p in policy.named_parameters() if p.requires_grad}
    batch = agent.engine.play(8)
    # The rollout kept the trunk's output for the update, in float32 (the residual stream
    # stays float32 under autocast), and a pass from it equals a whole pass.
    assert policy.trunk.prompts
    assert all(s.dtype == torch.float32 for s in policy.trunk.prompts.values())
    metrics = agent.algorithm.update(batch)
    assert policy.trunk.verified and not policy.trunk.disabled
    assert torch.isfinite(torch.tensor(metrics["policy_loss"]))
    after = dict(policy.named_parameters())
    changed = [n for n, p in before.items() if not torch.equal(after[n], p)]
    assert any("lora_" in n for n in changed) and "value_head.weight" in changed


def test_a_float32_trunk_is_the_model_as_loaded() -> None:
    agent = _tiny("float32")
    decoder = decoder_and_head(agent.policy.model)[0]
    layers = decoder_layers(decoder)
    assert layers is not None
    assert all(p.dtype == torch.float32 for p in agent.policy.model.parameters())
    assert not any("forward" in vars(layer) for layer in layers)  # no autocast wrapper


# -- the real model --------------------------------------------------------------------
def _smollm2_agent(name: str, smollm2_dir: Path, trunk_dtype: str) -> Any:
    from llamagym_blackjack.agent import BlackjackAgent
    from llamagym_cartpole.agent import CartPoleAgent
    from llamagym_textworld.agent import TextWorldAgent

    agent_class = {"blackjack": BlackjackAgent, "cartpole": CartPoleAgent,
                   "textworld": TextWorldAgent}[name]
    config: dict[str, Any] = {
        "model": {"name": str(smollm2_dir), "lora_layers": 4, "trunk_dtype": trunk_dtype},
        "rollout": {"mode": "score", "num_envs": 4},
        "training": {"threads": 2, "seed": 0},
    }
    if name == "textworld":
        config["agent"] = {"games": 4, "max_episode_steps": 8}
    if name == "cartpole":
        config["rollout"]["max_episode_turns"] = 8
    return agent_class(config=config)


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["blackjack", "cartpole", "textworld"])
def test_smollm2_bfloat16_trunk_chooses_as_float32_does(smollm2_dir: Path, name: str) -> None:
    exact = _smollm2_agent(name, smollm2_dir, "float32")
    # Sampled, so decisions of every kind, not one greedy loop (Blackjack's episodes are
    # one or two turns, CartPole's and TextWorld's many).
    episodes = exact.engine.play(24 if name == "blackjack" else 4)
    turns = [turn for episode in episodes for turn in episode.turns][:32]
    assert len(turns) >= 24
    prompts = [turn.prompt_tokens for turn in turns]
    candidates = [turn.candidates for turn in turns]

    def policies(agent: Any) -> torch.Tensor:
        if agent.policy.trunk is not None:
            agent.policy.trunk.clear()  # whole passes, as for a new prompt
        with torch.no_grad():
            scores, _ = agent.policy.score(prompts, candidates)
        return agent.policy.action_log_probs(scores)

    float32 = policies(exact)
    fast = _smollm2_agent(name, smollm2_dir, "bfloat16")
    layers = decoder_layers(decoder_and_head(fast.policy.model)[0])
    assert layers is not None and next(layers[0].parameters()).dtype == torch.bfloat16
    bfloat16 = policies(fast)
    real = torch.isfinite(float32)
    assert torch.equal(real, torch.isfinite(bfloat16))
    gaps = (float32[real] - bfloat16[real]).abs()
    # Measured on this CPU: about 0.02 nats on average, at most 0.04-0.12 over the actions
    # of 32 decisions.
    assert gaps.mean().item() < 0.05, f"log-probabilities {gaps.mean():.4f} nats apart"
    assert gaps.max().item() < 0.15
    # A decision whose two best actions are closer than the precision moves them is a
    # coin toss in either dtype (Blackjack's untrained policy has many): the rest agree.
    top2 = float32.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * gaps.max()
    agree = (float32.argmax(-1) == bfloat16.argmax(-1))[clear].float().mean().item()
    assert clear.float().mean() >= 0.5 and agree >= 0.95, f"{agree:.0%} agree"
    if name != "textworld":
        return
    # float32 is the model exactly as loaded: the same numbers, bit for bit, as a
    # policy over weights that were never touched.
    from llamagym.models.loading import load_model_and_tokenizer
    from llamagym.models.policy import Policy

    model, tokenizer = load_model_and_tokenizer(str(smollm2_dir), lora_layers=4)
    untouched = Policy(model, tokenizer)
    with torch.no_grad():
        scores, _ = untouched.score(prompts, candidates)
    assert torch.equal(untouched.action_log_probs(scores), float32)
