"""The batched forward passes give the same numbers as one sequence at a time."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from llamagym.errors import ModelLoadError
from llamagym.models.generation import sampling_processors
from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.passes import MIN_SHARED_TOKENS, shared_prefix_length
from llamagym.models.policy import Policy
from llamagym.models.tiny import build_tiny_model


def naive_logprob(model, prompt: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([prompt + continuation])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].log_softmax(-1)
    return sum(float(logits[len(prompt) - 1 + k, token]) for k, token in enumerate(continuation))


def test_scores_match_unbatched_forward() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode("Your sum: 15. Dealer shows: 10."), encode("Which lever?")]
    candidates = [
        [encode("stick"), encode("hit"), encode("go north now")],
        [encode("left"), encode("right")],
    ]
    with torch.no_grad():
        scores, values = policy.score(prompts, candidates)
    assert scores.shape == (2, 3) and values.shape == (2,)
    assert scores[1, 2] == float("-inf")  # the second prompt has two candidates
    for i, options in enumerate(candidates):
        for j, option in enumerate(options):
            expected = naive_logprob(model, prompts[i], option) / len(option)
            assert abs(float(scores[i, j]) - expected) < 1e-4


def test_action_log_probs_take_one_temperature_or_one_per_row() -> None:
    scores = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, -3.0, -1.0]])
    shared = Policy.action_log_probs(scores, 0.5)
    assert torch.allclose(shared.exp().sum(-1), torch.ones(2))
    assert shared[0, 2] == float("-inf")  # a padding column stays impossible
    per_row = Policy.action_log_probs(scores, torch.tensor([[0.5], [2.0]]))
    assert torch.equal(per_row[0], shared[0])
    assert torch.allclose(per_row[1], (scores[1] / 2.0).log_softmax(-1))


def test_reply_logprobs_match_unbatched_forward() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    replies = [[20, 21, 22], [30]]
    with torch.no_grad():
        evaluation = policy.evaluate_replies(prompts, replies)
    assert evaluation.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    for row in range(2):
        total = float(evaluation.logprobs[row].detach().sum())
        assert abs(total - naive_logprob(model, prompts[row], replies[row])) < 1e-4
    assert torch.all(evaluation.entropy[0] > 0) and float(evaluation.entropy[1, 1:].sum()) == 0


def test_reply_entropy_is_over_the_named_actions_where_there_are_names() -> None:
    """A generate-mode turn with legal actions gets the entropy of score mode's policy
    over them at every reply token; one without names keeps the next-token entropy. The
    reply's log-probabilities do not depend on the names."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = [encode("Sum 15, dealer 10."), encode("Which lever?"), encode("Sum 4, dealer 2.")]
    replies = [encode("stick now"), encode("left"), encode("hit")]
    actions = [[encode("stick"), encode("hit")], [], [encode("stick"), encode("hit me")]]
    with torch.no_grad():
        plain = policy.evaluate_replies(prompts, replies)
        named = policy.evaluate_replies(prompts, replies, actions=actions)
        choices = policy.evaluate_choices(
            [prompts[0], prompts[2]], [actions[0], actions[2]], chosen=[0, 1]
        )
    assert torch.equal(named.mask, plain.mask)
    assert torch.allclose(named.logprobs, plain.logprobs, atol=1e-5)
    for row, choice in ((0, 0), (2, 1)):
        width = int(named.mask[row].sum())
        expected = float(choices.entropy[choice, 0])
        assert 0 < expected < math.log(2) + 1e-6
        assert torch.allclose(named.entropy[row, :width], torch.full((width,), expected))
        assert float(named.entropy[row, width:].abs().sum()) == 0
    assert torch.equal(named.entropy[1], plain.entropy[1])  # no names: next-token entropy
    assert float(plain.entropy[0, 0]) > math.log(2)  # the vocabulary's spread, not the actions'


def test_shared_prefix_runs_once_only_where_it_pays() -> None:
    system = list(range(100, 140))
    assert shared_prefix_length([system + [1, 2], system + [1, 3], system + [4]]) == 40
    assert shared_prefix_length([system + [1]] * 3) == 40  # each keeps its last token
    assert shared_prefix_length([system[:5] + [1], system[:5] + [2]]) == 0  # saves 5 < 64
    assert shared_prefix_length([system + [1]]) == 0  # a single prompt has nobody to share with
    assert shared_prefix_length([[1, 2], [3, 4]]) == 0


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prefix_and_side_by_side_continuations_match_one_sequence_at_a_time(
    attention: str,
) -> None:
    """Prompts sharing a long system prompt, a prompt met twice with replies of different
    lengths, an empty reply: log-probs, values and gradients equal the naive ones."""
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(), attn_implementation=attention)
    _, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    torch.nn.init.normal_(policy.value_head.weight, generator=torch.Generator().manual_seed(0))
    system = list(range(200, 200 + MIN_SHARED_TOKENS))
    prompts = [system + [5, 6, 7], system + [8], system + [5, 6, 7], system + [9, 10]]
    replies = [[20, 21, 22], [30, 31], [40, 41], []]
    assert shared_prefix_length(prompts) == MIN_SHARED_TOKENS
    evaluation = policy.evaluate_replies(prompts, replies)
    batched_total = evaluation.logprobs.sum() + evaluation.values.sum()
    batched_total.backward()
    batched_grad = model.get_input_embeddings().weight.grad.clone()
    model.zero_grad()
    policy.value_head.zero_grad()

    naive_total = torch.zeros(())
    for row, (prompt, reply) in enumerate(zip(prompts, replies, strict=True)):
        output = model(input_ids=torch.tensor([prompt + reply]), output_hidden_states=True)
        logits = output.logits[0].log_softmax(-1)
        logprob = sum(logits[len(prompt) - 1 + k, token] for k, token in enumerate(reply))
        value = policy.value_head(output.hidden_states[-1][0, len(prompt) - 1]).squeeze()
        assert abs(float(evaluation.logprobs[row].detach().sum()) - float(logprob)) < 1e-4
        assert abs(float(evaluation.values[row]) - float(value)) < 1e-4
        naive_total = naive_total + logprob + value
    assert evaluation.mask.tolist() == [[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]]
    naive_total.backward()
    naive_grad = model.get_input_embeddings().weight.grad
    assert torch.allclose(batched_grad, naive_grad, atol=1e-4)
    assert float(batched_grad[system].abs().sum()) > 0  # the shared prefix is trained too


def test_an_attention_kernel_without_custom_masks_is_refused_up_front() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ModelLoadError, match="attn_implementation='sdpa'"):
        Policy(model, tokenizer)


def test_generate_returns_replies_that_stop_at_end_of_turn() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    torch.manual_seed(0)
    replies = policy.generate([[5, 6, 7], [8, 9]], max_new_tokens=6).tokens
    assert len(replies) == 2
    for reply in replies:
        assert 1 <= len(reply) <= 6
        assert tokenizer.eos_token_id not in reply[:-1]


def test_generate_with_a_shared_prefix_continues_each_prompt_as_alone() -> None:
    """The shared prefix runs once as a cache and each row's padding sits after it:
    every row's greedy reply is the one its prompt gets alone, unpadded."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    prefix = list(range(20, 60))
    prompts = [prefix + [5, 6, 7], prefix + [8], prefix + [9, 10, 11, 12, 13]]
    assert shared_prefix_length(prompts) == len(prefix)
    replies = policy.generate(prompts, max_new_tokens=6, greedy=True).tokens
    for prompt, reply in zip(prompts, replies, strict=True):
        with torch.no_grad():
            alone = model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=len(reply), do_sample=False,
                pad_token_id=policy.pad_id, eos_token_id=policy.eos_id,
            )[0, len(prompt) :].tolist()
        assert reply == alone[: len(reply)]


@pytest.mark.parametrize(("shared", "top_k"), [(True, 2), (False, 0)])
def test_generate_scores_its_replies_as_an_evaluation_pass_would(shared: bool, top_k: int) -> None:
    """The log-probabilities and values the rollout keeps come from generation's own
    passes; they are the plain policy's (no top-k), as evaluate_replies computes them."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    torch.nn.init.normal_(policy.value_head.weight)  # a trained critic: values differ
    prefix = list(range(20, 60))
    prompts = [prefix + [5, 6, 7], prefix + [8], prefix + [9, 10, 11, 12, 13]] * 3
    prompts += [] if shared else [[3, 4]]
    assert (shared_prefix_length(prompts) == len(prefix)) == shared
    generated = policy.generate(
        prompts, max_new_tokens=6, top_k=top_k, generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        evaluation = policy.evaluate_replies(prompts, generated.tokens)
    assert len({tuple(reply) for reply in generated.tokens}) > 2  # sampled, varied
    for row, reply in enumerate(generated.tokens):
        assert len(generated.logprobs[row]) == len(reply)
        expected = evaluation.logprobs[row, : len(reply)]
        assert torch.allclose(torch.tensor(generated.logprobs[row]), expected, atol=1e-4)
    assert torch.allclose(torch.tensor(generated.values), evaluation.values, atol=1e-4)


def test_sampling_draws_from_the_warped_distribution() -> None:
    probabilities = torch.tensor([0.0, 0.1, 0.6, 0.3])
    scores = probabilities.log().repeat(20_000, 1)
    generator = torch.Generator().manual_seed(0)
    drawn = sampling_processors(1.0, 1.0, 0, generator)[-1](None, scores.clone()).argmax(-1)
    frequencies = torch.bincount(drawn, minlength=4) / len(drawn)
    assert frequencies[0] == 0  # probability 0 is never drawn
    assert torch.allclose(frequencies, probabilities, atol=0.015)
    # top-k=2 keeps the two likeliest; temperature 0.5 squares their odds (0.6:0.3 -> 4:1).
    warped = scores.clone()
    for processor in sampling_processors(0.5, 1.0, 2, generator):
        warped = processor(None, warped)
    frequencies = torch.bincount(warped.argmax(-1), minlength=4) / len(warped)
    assert frequencies[0] == 0 and frequencies[1] == 0
    assert abs(float(frequencies[2]) - 0.8) < 0.015


def test_generate_repeats_with_the_callers_generator() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    prompts = [[5, 6, 7]] * 16

    def replies(seed: int) -> list[list[int]]:
        return policy.generate(prompts, 6, generator=torch.Generator().manual_seed(seed)).tokens

    first = replies(1)
    assert replies(1) == first
    assert replies(2) != first
    assert len({tuple(reply) for reply in first}) > 1  # rows sample independently
    # A chat model's own sampling settings do not leak into the rollout's.
    model.generation_config.update(do_sample=True, temperature=0.6, top_k=5)
    assert replies(1) == first


def _gradients(policy: Policy, prompts, replies) -> tuple[list[torch.Tensor], float]:
    policy.zero_grad()
    evaluation = policy.evaluate_replies(prompts, replies)
    loss = evaluation.logprobs.sum() + evaluation.values.sum() + evaluation.entropy.sum()
    loss.backward()
    grads = [p.grad.clone() for p in policy.trainable_parameters() if p.grad is not None]
    return grads, float(loss)


def test_gradient_checkpointing_gives_the_same_gradients_through_the_shared_prefix() -> None:
    """Checkpointed layers run twice (forward, then again in backward); the read-only
    prefix cache must give the same keys both times, so the gradients match exactly."""
    model, tokenizer = load_model_and_tokenizer("tiny", lora=True)
    system = list(range(100, 100 + MIN_SHARED_TOKENS))  # long enough to be shared
    prompts = [system + [5, 6, 7], system + [8], system + [9, 10]]
    replies = [[20, 21, 22], [30], [31, 32]]
    plain = Policy(model, tokenizer)
    expected, expected_loss = _gradients(plain, prompts, replies)
    checkpointed = Policy(model, tokenizer, gradient_checkpointing=True)
    assert len(checkpointed.checkpointed_layers) == model.config.num_hidden_layers
    checkpointed.value_head.load_state_dict(plain.value_head.state_dict())
    recomputed: list[str] = []
    inner = checkpointed.checkpointed_layers[0].mlp  # runs inside the layer's forward
    hook = inner.register_forward_pre_hook(lambda module, args: recomputed.append("run"))
    try:
        grads, loss = _gradients(checkpointed, prompts, replies)
    finally:
        hook.remove()
    # The first layer ran for the prefix, the batch, and once more in backward.
    assert len(recomputed) == 3
    assert abs(loss - expected_loss) < 1e-5
    assert len(grads) == len(expected) > 0
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    # Without gradients (rollouts), nothing is recomputed and the layers stay in eval.
    with torch.no_grad():
        checkpointed.evaluate_replies(prompts, replies)
    assert not any(layer.training for layer in checkpointed.checkpointed_layers)


def test_policy_train_mode_leaves_the_language_model_in_eval_mode() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer).train()
    assert policy.training and policy.value_head.training
    assert not any(module.training for module in policy.model.modules())


def test_the_lm_head_runs_only_at_the_scored_positions() -> None:
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    prompts = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with torch.no_grad():
        policy.score(prompts, [[[20], [21, 22, 23]], [[20], [21, 22, 23]], [[24]]])
    assert policy.head_positions == 1 + 3 + 1 + 3 + 1
    with torch.no_grad():
        policy.evaluate_replies(prompts, [[30, 31], [32], [33, 34, 35, 36]])
    assert policy.head_positions == 9 + 2 + 1 + 4


def test_a_reply_repeated_after_the_same_prompt_is_computed_once() -> None:
    """A seed group's turns repeat (prompt, reply) pairs: each distinct pair goes through
    the LM head once, and every repeat still gets its numbers, in the order asked, and
    its share of the gradient (the sum of the pairs evaluated one at a time)."""
    model, tokenizer = load_model_and_tokenizer("tiny", lora=True)
    policy = Policy(model, tokenizer)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [5, 6, 7], [8, 9]]
    replies = [[20, 21], [20, 21], [22], [20, 21], [20, 21]]
    with torch.no_grad():
        one_by_one = [
            policy.evaluate_replies([p], [r]) for p, r in zip(prompts, replies, strict=True)
        ]
    before = policy.head_positions
    with torch.no_grad():
        together = policy.evaluate_replies(prompts, replies)
    assert policy.head_positions - before == 2 + 2 + 1  # (567, 20 21), (89, 20 21), (567, 22)
    for row, alone in enumerate(one_by_one):
        width = alone.logprobs.shape[1]
        assert torch.allclose(together.logprobs[row, :width], alone.logprobs[0], atol=1e-5)
        assert torch.allclose(together.values[row], alone.values[0], atol=1e-5)
    alone_grads = [_gradients(policy, [p], [r])[0] for p, r in zip(prompts, replies, strict=True)]
    expected = [sum(parts) for parts in zip(*alone_grads, strict=True)]
    grads, _ = _gradients(policy, prompts, replies)
    assert len(grads) == len(expected) > 0
    for got, want in zip(grads, expected, strict=True):
        assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_a_4bit_model_evaluates_trains_and_scores_again(mode: str) -> None:
    """Evaluation switches the policy to eval mode and back; the quantized model (and
    gradient checkpointing, on for LoRA in generate mode) must keep working after."""
    pytest.importorskip("bitsandbytes")
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.rollout.evaluation import evaluate_agent

    agent = BlackjackAgent(
        config={
            "model": {"quantize": "4bit"},
            "rollout": {"mode": mode, "num_envs": 8},
            "algorithm": {"episodes_per_update": 16, "minibatch_size": 16, "epochs": 1},
        }
    )
    assert agent.policy.uses_adapter
    assert bool(agent.policy.checkpointed_layers) == (mode == "generate")
    evaluate_agent(agent.evaluation_engine(), 16)
    envs = [agent.make_env() for _ in range(8)]
    batch = agent.engine.collect(envs, 16)
    trainable = dict(agent.policy.named_parameters())
    before = {n: p.detach().clone() for n, p in trainable.items() if p.requires_grad}
    agent.algorithm.update(batch)
    changed = {n for n, value in before.items() if not torch.equal(trainable[n], value)}
    assert changed and all("lora_" in n or "value_head" in n for n in changed)
    evaluate_agent(agent.evaluation_engine(), 16)
    assert len(agent.engine.collect(envs, 16)) == 16


def test_a_model_object_given_to_the_classic_api_follows_the_lora_rule() -> None:
    """Above 50M parameters a given model gets an adapter (and the pretrained-model
    defaults), as one loaded by name would; model.lora=false trains it whole."""
    from llamagym_blackjack.agent import BlackjackAgent

    from llamagym.models import lora_choice as models

    model, tokenizer = load_model_and_tokenizer("tiny")
    agent = BlackjackAgent(model, tokenizer)
    assert not agent.policy.uses_adapter  # 0.23M parameters: trained whole
    assert agent.config.algorithm.lr == BlackjackAgent.defaults["algorithm"]["lr"]

    original = models.LORA_AUTO_THRESHOLD
    models.LORA_AUTO_THRESHOLD = 1000  # the tiny model now counts as a large one
    try:
        model, tokenizer = load_model_and_tokenizer("tiny", lora=False)
        agent = BlackjackAgent(model, tokenizer)
        assert agent.policy.uses_adapter
        trainable = {n for n, p in agent.policy.named_parameters() if p.requires_grad}
        assert trainable and all("lora_" in n or "value_head" in n for n in trainable)
        # The pretrained-model defaults, with Blackjack's own for score mode over them.
        assert agent.config.algorithm.lr == BlackjackAgent.pretrained_defaults["score"][
            "algorithm"
        ]["lr"]
        whole = BlackjackAgent(model, tokenizer, config={"model": {"lora": False}})
        assert not whole.policy.uses_adapter
    finally:
        models.LORA_AUTO_THRESHOLD = original
