"""With its history, an episode's turns are one sequence: turn t's prompt starts with
turn t-1's. A pass over several turns of an episode puts them in one row (the last
turn's prompt), each turn's continuations after it, seeing the row up to their own
prompt's end: the log-probabilities, entropies, values and gradients of a pass per turn,
in both action modes, with the whole history and with a window, with LoRA on every layer
and on the top layers only (from the kept trunk too), at the cost of the episode's
distinct tokens instead of the sum of its prompts. Minibatches keep an episode's turns
together so that the update's passes find them."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from llamagym.algorithms.batching import history_groups
from llamagym.models.passes import prefix_rows
from llamagym.models.policy import _choice_pairs
from llamagym.models.trunk import decoder_layers
from llamagym.rollout.trajectory import Turn
from llamagym.testing import tiny_agent

TOLERANCE = 1e-4  # float32, absolute


def test_a_prompt_that_starts_another_shares_its_row() -> None:
    prompts = [(1, 2, 3), (1, 2), (9,), (1, 2, 3, 4), (1, 5), (9, 8)]
    rows, tips = prefix_rows(prompts)
    assert tips == [(1, 2, 3, 4), (9, 8), (1, 5)]
    assert rows == [0, 0, 1, 0, 2, 1]
    # (1, 2) starts both (1, 2, 3, ...) and (1, 5): it goes into one row of the two.


def agent_for(mode: str, history: int | None, model: dict[str, Any], turns: int) -> Any:
    """CartPole (short prompts, at most ``turns`` per episode) with an adapter that does
    something."""
    from llamagym_cartpole.agent import CartPoleAgent

    agent = tiny_agent(
        CartPoleAgent,
        model=model,
        rollout={"mode": mode, "history_turns": history, "max_new_tokens": 6,
                 "max_episode_turns": turns},
    )
    with torch.no_grad():
        for name, parameter in agent.policy.named_parameters():
            if "lora_B" in name:  # B starts at zero
                parameter.normal_(0.0, 0.05)
    return agent


def sampled_turns(agent: Any, episodes: int) -> list[Turn]:
    batch = agent.engine.collect(
        [agent.make_env() for _ in range(episodes)], episodes, seeds=list(range(episodes))
    )
    return [turn for episode in batch for turn in episode.turns]


def evaluated(agent: Any, turns: list[Turn]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Log-probs, entropy and values of ``turns`` in one call (so one pass), and the
    gradients of their sum."""
    policy = agent.policy
    policy.zero_grad(set_to_none=True)
    new = agent.algorithm.scoring.evaluate(turns)
    units = new.mask.bool()
    loss = new.logprobs[units].sum() + new.entropy[units].sum() + new.values.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return [new.logprobs[units], new.entropy[units], new.values], grads


def per_turn(agent: Any, turns: list[Turn]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The same, a pass per turn (every layer): the sums of the turns' gradients."""
    trunk, agent.policy.trunk = agent.policy.trunk, None
    numbers: list[list[torch.Tensor]] = [[], [], []]
    total: dict[str, torch.Tensor] = {}
    try:
        for turn in turns:
            values, grads = evaluated(agent, [turn])
            for kept, value in zip(numbers, values, strict=True):
                kept.append(value)
            for name, grad in grads.items():
                total[name] = total[name] + grad if name in total else grad
    finally:
        agent.policy.trunk = trunk
    return [torch.cat(kept) for kept in numbers], total


def assert_same(one: tuple, many: tuple) -> None:
    for a, b in zip(one[0], many[0], strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a, b, atol=TOLERANCE), (a - b).abs().max()
    assert one[1].keys() == many[1].keys() and one[1]
    for name, grad in many[1].items():
        # float32 sums in another order: within 1e-3 of the tensor's largest entry
        error = (one[1][name] - grad).abs().max()
        assert error <= 1e-3 * grad.abs().max() + 1e-7, (name, float(error))


MODELS = {  # exactness in float32: the trunk stays as loaded
    "tiny": {},
    "tiny-lora-all": {"lora": True},
    "tiny-lora-top": {"lora": True, "lora_layers": 1, "trunk_dtype": "float32"},
}


def model_section(name: str, request: pytest.FixtureRequest) -> dict[str, Any]:
    if name in MODELS:
        return MODELS[name]
    path = str(request.getfixturevalue("smollm2_dir"))
    # Named by its directory, the registry's lora_layers does not apply: say it here.
    return {"name": path, "lora_layers": 4 if name == "smollm2-top4" else None,
            "trunk_dtype": "float32"}


# Every combination on the tiny model; SmolLM2 (LoRA on its last 4 layers as shipped,
# and on all 30) in two of them that cover both modes and both kinds of history.
CASES = [
    *[(m, mode, h) for m in MODELS for mode in ("score", "generate") for h in (None, 2)],
    pytest.param("smollm2-top4", "score", None, marks=pytest.mark.real_model),
    pytest.param("smollm2-all", "generate", 2, marks=pytest.mark.real_model),
]


@pytest.mark.parametrize(("model", "mode", "history"), CASES)
def test_one_pass_over_an_episode_equals_a_pass_per_turn(
    model: str, mode: str, history: int | None, request: pytest.FixtureRequest
) -> None:
    agent = agent_for(mode, history, model_section(model, request), 10 if model in MODELS else 6)
    policy = agent.policy
    turns = sampled_turns(agent, episodes=2)
    assert len(turns) >= 8
    many = per_turn(agent, turns)
    if policy.trunk is not None:
        policy.trunk.clear()
    positions = policy.positions_run
    whole = evaluated(agent, turns)
    whole_positions = policy.positions_run - positions
    assert_same(whole, many)
    if policy.trunk is not None:  # again from the trunk, as the update keeps it
        agent.algorithm.scoring.keep_trunk(turns, len(turns))
        assert policy.trunk.verified and not policy.trunk.disabled
        calls: list[int] = []
        decoder = policy.model.get_base_model().get_decoder()
        hook = decoder_layers(decoder)[0].register_forward_hook(lambda *_: calls.append(1))
        try:
            assert_same(evaluated(agent, turns), many)
        finally:
            hook.remove()
        assert not calls  # the layers above the trunk alone ran
    # The layout: with the whole history, a row per episode; with a window, the turns
    # whose prompts still start one another share a row.
    prompts = [turn.prompt_tokens for turn in turns]
    rows = policy.passes.lay_out(prompts, _choice_pairs([[[1]]] * len(turns))).layout.prompts
    if history is None:
        assert len(rows) == 2
        assert whole_positions < 0.6 * sum(len(p) for p in prompts)
    else:
        assert len(rows) < len(turns) and len(rows) > 2


def make_turn(prompt: list[int]) -> Turn:
    return Turn(prompt_tokens=list(prompt), legal_actions=[], action_index=None, reply="",
                logprobs=[0.0], value=0.0)


def episode_turns(episode: int, turns: int) -> list[Turn]:
    """Turns whose prompts grow by the episode's history (turn t's starts with t-1's)."""
    prompt = [100 + episode]
    made = []
    for step in range(turns):
        prompt = [*prompt, step, 7]
        made.append(make_turn(prompt))
    return made


def test_minibatches_keep_an_episodes_turns_together() -> None:
    turns = [t for pair in zip(episode_turns(0, 4), episode_turns(1, 4), strict=True)
             for t in pair]  # interleaved, as an engine's lockstep envs give them
    assert history_groups(turns) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # Without history every turn is its own group, in order: shuffling the groups is
    # shuffling the turns (the same order for the same seed as before groups existed).
    alone = [make_turn([5, i % 3]) for i in range(9)]
    groups = history_groups(alone)
    assert groups == [[i] for i in range(9)]
    order = list(range(9))
    random.Random(3).shuffle(order)
    random.Random(3).shuffle(groups)
    assert [i for group in groups for i in group] == order
