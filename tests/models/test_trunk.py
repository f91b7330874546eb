"""A model trained through LoRA on its top layers keeps its frozen trunk's output: passes
from the kept states give the numbers and gradients of whole passes, in both action
modes, for the policy and the KL reference, and a decoder they do not fit is caught."""

from __future__ import annotations

import logging

import pytest
import torch

from llamagym.models.loading import add_lora_adapter, load_model_and_tokenizer
from llamagym.models.passes import MIN_SHARED_TOKENS
from llamagym.models.policy import Policy
from llamagym.models.trunk import TrunkStates, decoder_layers, first_trained_layer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def top_layer_policy(lora_layers: int | None = 1) -> Policy:
    """The tiny model (2 decoder layers) with LoRA on its top ``lora_layers``."""
    model, tokenizer = load_model_and_tokenizer(
        "tiny", device="cpu", lora=True, lora_layers=lora_layers
    )
    policy = Policy(model, tokenizer)
    with torch.no_grad():  # an adapter that does something: B starts at zero
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    return policy


def prompts_and_continuations(tokenizer) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Prompts that share a long prefix (so passes run it once, as a cache), one asked
    twice, and continuations of several tokens (so they have tail columns)."""
    system = encode(tokenizer, "You play a game of cards and answer with one word. " * 8)
    assert len(system) >= MIN_SHARED_TOKENS
    hands = ["Your sum: 15. Dealer shows: 10.", "Your sum: 9.", "Your sum: 15. Dealer shows: 10."]
    prompts = [system + encode(tokenizer, hand) for hand in hands]
    names = [encode(tokenizer, name) for name in ("stick", "hit me now", "go north")]
    return prompts, [names, names[:2], names]


def layer_runs(policy: Policy, index: int) -> list[int]:
    """A counter of the calls of decoder layer ``index`` (a list that grows)."""
    decoder = policy.model.get_base_model().get_decoder()
    calls: list[int] = []
    layer = decoder_layers(decoder)[index]
    layer.register_forward_hook(lambda *_: calls.append(1))
    return calls


def whole_and_kept(policy: Policy, evaluate) -> tuple[tuple, tuple]:
    """``evaluate()`` (returning tensors, with a backward pass inside) once with every
    layer running and once from the trunk kept by passes of another layout."""
    trunk = policy.trunk
    policy.trunk = None
    whole = evaluate()
    policy.trunk = trunk
    return whole, evaluate()


def gradients(policy: Policy, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    policy.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}


def assert_same(whole: tuple, kept: tuple) -> None:
    for a, b in zip(whole[:-1], kept[:-1], strict=True):
        assert torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    grads_whole, grads_kept = whole[-1], kept[-1]
    assert grads_whole.keys() == grads_kept.keys() and grads_whole
    for name, grad in grads_whole.items():
        assert torch.allclose(grad, grads_kept[name], rtol=1e-4, atol=1e-6), name


def test_lora_on_the_top_layers_makes_the_layers_below_a_trunk() -> None:
    assert top_layer_policy(1).trunk.start == 1
    assert top_layer_policy(None).trunk is None  # LoRA on every layer: nothing frozen
    model, tokenizer = load_model_and_tokenizer("tiny", device="cpu")  # trained whole
    assert Policy(model, tokenizer).trunk is None
    assert first_trained_layer(torch.nn.Linear(2, 2)) == 0  # no decoder layers found


def test_score_mode_from_the_kept_trunk_equals_whole_passes() -> None:
    policy = top_layer_policy()
    prompts, candidates = prompts_and_continuations(policy.tokenizer)
    chosen = [1, 0, 2]
    # Kept one prompt at a time: another layout than the pass below.
    for prompt, options in zip(prompts, candidates, strict=True):
        policy.keep_trunk([prompt], candidates=[options])
    assert policy.trunk.verified and not policy.trunk.disabled
    bottom = layer_runs(policy, 0)

    def evaluate():
        new = policy.evaluate_choices(prompts, candidates, chosen)
        reference = policy.evaluate_choices(prompts, candidates, chosen, reference=True)
        loss = new.logprobs.sum() + new.values.sum() + new.entropy.sum()
        return new.logprobs, new.values, reference.logprobs, gradients(policy, loss)

    whole, kept = whole_and_kept(policy, evaluate)
    assert len(bottom) == 2 * 2  # the whole passes (policy, reference; prefix + rows each)
    assert_same(whole, kept)
    assert not torch.allclose(whole[0], whole[2])  # the adapter matters: a real test


def test_generate_mode_from_the_kept_trunk_equals_whole_passes() -> None:
    policy = top_layer_policy()
    prompts, candidates = prompts_and_continuations(policy.tokenizer)
    replies = [candidates[0][1] + [policy.eos_id], candidates[1][0], candidates[2][2]]
    actions = [candidates[0][:2]] * 3
    policy.keep_trunk(prompts[:2], replies=replies[:2], actions=actions[:2])
    policy.keep_trunk(prompts[2:], replies=replies[2:], actions=actions[2:])
    bottom = layer_runs(policy, 0)

    def evaluate():
        new = policy.evaluate_replies(prompts, replies, actions=actions)
        reference = policy.evaluate_replies(prompts, replies, reference=True)
        loss = (new.logprobs * new.mask).sum() + new.values.sum() + new.entropy.sum()
        return new.logprobs, new.entropy, new.values, reference.logprobs, gradients(policy, loss)

    whole, kept = whole_and_kept(policy, evaluate)
    assert len(bottom) == 2 * 2
    assert_same(whole, kept)


def test_a_pass_with_a_context_not_kept_runs_whole() -> None:
    policy = top_layer_policy()
    prompts, candidates = prompts_and_continuations(policy.tokenizer)
    policy.keep_trunk(prompts[:1], candidates=candidates[:1])
    bottom = layer_runs(policy, 0)
    with torch.no_grad():
        policy.score(prompts[:1], candidates[:1])
    assert not bottom  # all kept: the top layer only
    with torch.no_grad():
        policy.score(prompts[1:2], candidates[1:2])
    assert bottom  # a new prompt: the whole model (and now it is kept too)
    assert tuple(prompts[1]) in policy.trunk.prompts


def test_the_kept_states_are_bounded() -> None:
    policy = top_layer_policy()
    prompts, candidates = prompts_and_continuations(policy.tokenizer)
    policy.trunk = TrunkStates(policy.trunk.start, limit_bytes=4096)
    with torch.no_grad():
        expected, _ = policy.score(prompts, candidates)
    assert policy.trunk.full and policy.trunk.bytes <= 4096
    with torch.no_grad():
        again, _ = policy.score(prompts, candidates)  # not all kept: whole, same numbers
    assert torch.equal(expected, again)
    policy.trunk.clear()
    assert policy.trunk.bytes == 0 and not policy.trunk.full and not policy.trunk.prompts


def test_a_decoder_that_changes_its_input_is_caught(caplog: pytest.LogCaptureFixture) -> None:
    """OPT's decoder adds its learned position embeddings to ``inputs_embeds`` inside its
    forward, so its layers' input is not what the trunk hands them: the check at the
    first kept pass turns the trunk off, and the numbers stay those of whole passes."""
    from transformers import OPTConfig, OPTForCausalLM

    _, tokenizer = load_model_and_tokenizer("tiny", device="cpu")
    config = OPTConfig(
        vocab_size=len(tokenizer), hidden_size=64, ffn_dim=128, num_hidden_layers=2,
        num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = add_lora_adapter(OPTForCausalLM(config).eval(), "opt-test", rank=4, layers=1)
    policy = Policy(model, tokenizer)
    assert policy.trunk is not None and policy.trunk.start == 1
    prompts, candidates = prompts_and_continuations(tokenizer)
    with caplog.at_level(logging.WARNING), torch.no_grad():
        first, _ = policy.score(prompts, candidates)
        second, _ = policy.score(prompts, candidates)
    assert policy.trunk.disabled and "does not run from its layers' inputs" in caplog.text
    assert torch.equal(first, second)


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_an_update_from_the_kept_trunk_takes_the_steps_of_whole_passes(mode: str) -> None:
    """PPO's epochs (KL to the reference on) on one batch, by two identical agents, one
    with its trunk kept and one running every layer: the same weights after."""
    from llamagym.testing import tiny_agent

    settings = {
        "model": {"lora": True, "lora_layers": 1},
        "rollout": {"mode": mode, "max_new_tokens": 4},
        "algorithm": {"name": "ppo", "kl_coef": 0.1, "epochs": 2, "minibatch_size": 8},
    }
    kept, whole = tiny_agent(**settings), tiny_agent(**settings)
    whole.policy.trunk = None
    assert kept.policy.trunk is not None
    batch = kept.engine.collect([kept.make_env() for _ in range(8)], 16)
    turns = sum(len(episode.turns) for episode in batch)
    before = {n: p.detach().clone() for n, p in kept.policy.named_parameters()}
    bottom = layer_runs(kept.policy, 0)
    kept.algorithm.update(batch)
    whole.algorithm.update(batch)
    # Score mode's rollout kept every context; generate mode's replies need one pass
    # (a shared prefix and the rows: two calls per minibatch at most).
    assert len(bottom) <= (0 if mode == "score" else 2 * -(-turns // 8))
    after_kept = dict(kept.policy.named_parameters())
    changed = 0
    for name, parameter in whole.policy.named_parameters():
        if parameter.requires_grad:
            assert torch.allclose(parameter, after_kept[name], atol=1e-5), name
            changed += "lora_" in name and not torch.equal(before[name], after_kept[name])
    assert changed
