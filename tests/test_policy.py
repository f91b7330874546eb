"""The batched forward passes give the same numbers as one sequence at a time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from llamagym.errors import ModelLoadError
from llamagym.models import load_model_and_tokenizer
from llamagym.policy import MIN_SHARED_TOKENS, Policy, sampling_processors, shared_prefix_length
from llamagym.tiny_model import build_tiny_model


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
    replies = policy.generate([[5, 6, 7], [8, 9]], max_new_tokens=6)
    assert len(replies) == 2
    for reply in replies:
        assert 1 <= len(reply) <= 6
        assert tokenizer.eos_token_id not in reply[:-1]


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
        return policy.generate(prompts, 6, generator=torch.Generator().manual_seed(seed))

    first = replies(1)
    assert replies(1) == first
    assert replies(2) != first
    assert len({tuple(reply) for reply in first}) > 1  # rows sample independently
    # A chat model's own sampling settings do not leak into the rollout's.
    model.generation_config.update(do_sample=True, temperature=0.6, top_k=5)
    assert replies(1) == first
