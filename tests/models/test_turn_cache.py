"""Each rollout env keeps its key/value cache from its last turn, and the next turn runs
only its new tokens: the same greedy actions, log-probabilities and values as passes that
re-encode every prompt (the policy without a turn cache), in both action modes, with the
whole history and with a window of one turn; an ended episode's cache is dropped; the
memory bound holds; changed weights empty the cache; and the update still finds the
frozen trunk's states for every prompt the rollout ran."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from llamagym.models.policy import _choice_pairs
from llamagym.rollout.trajectory import Turn
from llamagym.testing import tiny_agent

TOLERANCE = 1e-4  # float32, absolute


def play(
    agent: Any, envs: int, episodes: int, cached: bool = True, memo: bool = False
) -> list[Turn]:
    """Greedy episodes with fixed seeds, with the policy's turn cache or without it (then
    every prompt runs whole, its shared prefix once: the rollout before turn caches).
    The frozen trunk, if any, starts empty, so no pass runs from another's states."""
    policy, engine = agent.policy, agent.engine
    kept = policy.turn_cache
    if policy.trunk is not None:
        policy.trunk.clear()
    if not cached:
        policy.turn_cache = None
    try:
        with engine.greedy_memo() if memo else contextlib.nullcontext():
            batch = engine.collect(
                [agent.make_env() for _ in range(envs)],
                episodes,
                greedy=True,
                seeds=list(range(episodes)),
            )
    finally:
        policy.turn_cache = kept
    return [turn for episode in batch for turn in episode.turns]


def assert_same_turns(cached: list[Turn], whole: list[Turn]) -> None:
    assert [t.prompt_tokens for t in cached] == [t.prompt_tokens for t in whole]
    assert [t.action_index for t in cached] == [t.action_index for t in whole]
    assert [t.action_tokens for t in cached] == [t.action_tokens for t in whole]
    for mine, theirs in zip(cached, whole, strict=True):
        assert len(mine.logprobs) == len(theirs.logprobs)
        for a, b in zip([*mine.logprobs, mine.value], [*theirs.logprobs, theirs.value],
                        strict=True):
            assert abs(a - b) <= TOLERANCE


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.real_model)])
def model(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The model section: the tiny model, or the real SmolLM2-135M (LoRA on its last 4
    layers, as its registry entry says: a frozen trunk below them)."""
    if request.param == "tiny":
        return {}
    # Named by its directory, the registry's lora_layers does not apply: say it here.
    return {"name": str(request.getfixturevalue("smollm2_dir")), "lora_layers": 4,
            "trunk_dtype": "float32"}


def cartpole(mode: str, history: int | None, **model: Any) -> Any:
    from llamagym_cartpole.agent import CartPoleAgent

    return tiny_agent(
        CartPoleAgent,
        model=model,
        rollout={"mode": mode, "history_turns": history, "max_new_tokens": 6,
                 "max_episode_turns": 12},
    )


@pytest.mark.parametrize("history", [None, 1])
@pytest.mark.parametrize("mode", ["score", "generate"])
def test_a_greedy_rollout_from_turn_caches_equals_reencoding(
    mode: str, history: int | None
) -> None:
    agent = cartpole(mode, history)
    policy = agent.policy
    start = policy.positions_run
    cached = play(agent, envs=3, episodes=4)
    ran_cached = policy.positions_run - start
    assert policy.turn_cache is not None and policy.turn_cache.runs
    assert not policy.turn_cache.entries  # every episode ended: nothing kept
    start = policy.positions_run
    whole = play(agent, envs=3, episodes=4, cached=False)
    ran_whole = policy.positions_run - start
    assert len(cached) > 12  # several turns per episode: caches were read
    assert_same_turns(cached, whole)
    if history is None:  # the whole history: each turn runs its new tokens
        assert ran_cached < ran_whole / 2
    else:  # a window shifts old turns out: the common part is the system prompt
        assert ran_cached <= ran_whole


def test_greedy_evaluation_with_its_memo_equals_reencoding() -> None:
    from llamagym_blackjack.agent import BlackjackAgent

    agent = tiny_agent(BlackjackAgent, rollout={"history_turns": None})
    cached = play(agent, envs=4, episodes=24, memo=True)
    assert_same_turns(cached, play(agent, envs=4, episodes=24, cached=False, memo=True))


def test_each_turn_runs_the_tokens_after_what_its_env_ran_before(model: dict[str, Any]) -> None:
    """One env, the whole history, score mode: turn t's prompt extends turn t-1's, and
    the decoder runs the new tokens (and the candidates) only, where it ran the whole
    prompt before."""
    agent = cartpole("score", None, **model)
    policy = agent.policy
    start = policy.positions_run
    turns = play(agent, envs=1, episodes=1)
    ran_cached = policy.positions_run - start
    start = policy.positions_run
    play(agent, envs=1, episodes=1, cached=False)
    ran_whole = policy.positions_run - start
    runs = policy.turn_cache.runs[-len(turns) :]
    prompts = [t.prompt_tokens for t in turns]
    assert len(turns) >= 8
    new = [len(prompts[0])]
    for before, now in zip(prompts, prompts[1:], strict=False):
        assert now[: len(before)] == before  # the chosen action rendered after it
        new.append(len(now) - len(before))
    assert runs == [[n] for n in new]
    tails = [sum(len(c) - 1 for c in t.candidates) for t in turns]
    assert ran_cached == sum(new) + sum(tails)
    assert ran_whole == sum(len(p) for p in prompts) + sum(tails)
    assert max(new[1:]) < len(prompts[-1]) / 5  # a few dozen tokens, not the episode


def test_an_ended_episode_drops_its_cache(model: dict[str, Any]) -> None:
    agent = cartpole("score", None, **model)
    policy, cache = agent.policy, agent.policy.turn_cache
    env = agent.make_env()
    observation, info = env.reset(seed=0)
    for _ in range(3):
        agent.act(observation, info)
        observation, _, _, _, info = env.step(0)
    assert len(cache.entries) == 1 and cache.runs[-1][0] < len(agent.session._slot.episode.turns[0]
                                                                 .prompt_tokens)
    agent.terminate_episode()
    assert not cache.entries
    observation, info = env.reset(seed=1)
    agent.act(observation, info)
    assert cache.runs[-1][0] == len(agent.session._pending_turn.prompt_tokens)  # new episode: whole
    # A collection stopped early abandons its episodes, and their caches.
    agent.engine.collect([agent.make_env() for _ in range(2)], 4, should_stop=lambda: True)
    assert list(cache.entries) == [agent.session._slot.key]
    assert policy.turn_cache is cache


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_the_memory_bound_holds_and_a_cut_cache_stays_exact(mode: str) -> None:
    # The bound is bookkeeping over bytes, the same for every model: the tiny one
    # (SmolLM2's exactness is checked by the tests above and below).
    agent = cartpole(mode, None)
    policy, cache = agent.policy, agent.policy.turn_cache
    play(agent, envs=1, episodes=1)
    per_token = cache.bytes  # nothing kept now: measure one entry's size below
    assert per_token == 0
    if policy.trunk is not None:  # else the probe's prompt, kept by the play, runs from it
        policy.trunk.clear()
    with torch.no_grad():
        prompt = agent.engine.render_prompts(
            [agent.engine.new_slot(*agent.make_env().reset(seed=0), None, None)]
        )[1][0]
        policy.score([prompt], [[[5]]], keys=["probe"])
    per_token = cache.bytes / len(cache.entries["probe"].tokens)
    cache.drop("probe")
    cache.limit_bytes = int(3 * 60 * per_token)  # 60 tokens for each of 3 envs
    seen: list[int] = []
    original = cache.keep

    def keep(new: dict) -> None:
        original(new)
        seen.append(cache.bytes)

    cache.keep = keep  # type: ignore[method-assign]
    cached = play(agent, envs=3, episodes=4)
    assert seen and max(seen) <= cache.limit_bytes
    assert any(length > 60 for run in cache.runs[-5:] for length in run)  # cut: re-encoded
    assert_same_turns(cached, play(agent, envs=3, episodes=4, cached=False))
    cache.limit_bytes = 0  # nothing fits: every turn re-encodes, never an error
    before = len(cache.runs)
    nothing = play(agent, envs=3, episodes=4)
    assert not cache.entries and len(cache.runs) > before
    assert_same_turns(nothing, cached)


def test_changed_weights_empty_the_cache(model: dict[str, Any]) -> None:
    agent = cartpole("score", None, **model)
    policy, engine = agent.policy, agent.engine
    slot = engine.new_slot(*agent.make_env().reset(seed=0), None, None)
    prompt = engine.render_prompts([slot])[1][0]
    candidates = [[engine.candidate_tokens(name) for name in ("left", "right")]]
    with torch.no_grad():
        policy.score([prompt], candidates, keys=[slot.key])
        assert slot.key in policy.turn_cache.entries
        for parameter in policy.trainable_parameters():
            parameter.mul_(1.01)  # an optimizer step, in place
        scores, values = policy.score([prompt], candidates, keys=[slot.key])
        assert policy.turn_cache.runs[-1] == [len(prompt)]  # nothing reused
        again, again_values = policy.score([prompt], candidates)
    assert torch.allclose(scores, again, atol=TOLERANCE)
    assert torch.allclose(values, again_values, atol=TOLERANCE)


@pytest.mark.parametrize(
    ("env", "real"),
    [("blackjack", False), ("cartpole", False),
     pytest.param("blackjack", True, marks=pytest.mark.real_model)],
)
def test_the_update_finds_the_trunk_states_of_the_prompts_a_cached_rollout_ran(
    env: str, real: bool, request: pytest.FixtureRequest
) -> None:
    """LoRA on the top layer: the rollout from turn caches records the trunk's output for
    every whole prompt and candidate, as whole passes did, and the update's pass from
    those states gives the numbers of a whole pass. Blackjack as shipped (no history:
    its prompts share the system prompt only), CartPole with the whole history; the
    tiny model with LoRA on its top layer, SmolLM2 on its last 4."""
    model = {"lora": True, "lora_layers": 1}
    if real:
        model = {"name": str(request.getfixturevalue("smollm2_dir")), "lora_layers": 4,
                 "trunk_dtype": "float32"}
    if env == "blackjack":
        from llamagym_blackjack.agent import BlackjackAgent

        agent = tiny_agent(BlackjackAgent, model=model)
        assert agent.config.rollout.history_turns == 0
    else:
        agent = cartpole("score", None, **model)
    policy = agent.policy
    with torch.no_grad():  # an adapter that does something: B starts at zero
        for name, parameter in policy.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0.0, 0.05)
    assert policy.trunk is not None
    turns = play(agent, envs=4, episodes=8)
    assert policy.trunk.verified and not policy.trunk.disabled
    prompts = [t.prompt_tokens for t in turns]
    candidates = [t.candidates for t in turns]
    chosen = [t.action_index for t in turns]
    assert policy.trunk.holds(policy.passes.lay_out(prompts, _choice_pairs(candidates)).layout)
    with torch.no_grad():
        kept = policy.evaluate_choices(prompts, candidates, chosen)
        trunk, policy.trunk = policy.trunk, None
        whole = policy.evaluate_choices(prompts, candidates, chosen)
        policy.trunk = trunk
    assert torch.allclose(kept.logprobs, whole.logprobs, atol=TOLERANCE)
    assert torch.allclose(kept.values, whole.values, atol=TOLERANCE)
    rollout = torch.tensor([t.logprobs[0] for t in turns])
    assert torch.allclose(rollout, whole.logprobs[:, 0], atol=TOLERANCE)


# -- the real SmolLM2-135M ----------------------------------------------------------------
TINY_GAMES = {"games": 2, "world_size": 2, "nb_objects": 3, "quest_min_length": 2,
              "quest_max_length": 3, "max_episode_steps": 6}


@pytest.mark.real_model
@pytest.mark.parametrize(
    ("mode", "history"), [("score", None), ("score", 1), ("generate", None), ("generate", 1)]
)
def test_smollm2_textworld_from_turn_caches_equals_reencoding(
    smollm2_dir: Path, mode: str, history: int | None
) -> None:
    """TextWorld on SmolLM2 (its LoRA on the last 4 layers, so the trunk records too):
    prompts of hundreds of tokens that grow each turn with the whole history."""
    pytest.importorskip("textworld")
    from llamagym_textworld.agent import TextWorldAgent

    agent = TextWorldAgent(
        config={
            "model": {"name": str(smollm2_dir), "lora_layers": 4, "trunk_dtype": "float32"},
            "rollout": {"mode": mode, "num_envs": 2, "history_turns": history,
                        "max_new_tokens": 8},
            "agent": TINY_GAMES,
            "training": {"threads": 2},
        }
    )
    policy = agent.policy
    start = policy.positions_run
    cached = play(agent, envs=2, episodes=2)
    ran_cached = policy.positions_run - start
    start = policy.positions_run
    whole = play(agent, envs=2, episodes=2, cached=False)
    ran_whole = policy.positions_run - start
    assert len(cached) >= 6
    assert_same_turns(cached, whole)
    assert not policy.turn_cache.entries
    if history is None:
        assert ran_cached < ran_whole / 2
    else:
        assert ran_cached <= ran_whole



def test_a_rollout_score_pass_runs_rows_of_unlike_lengths_apart() -> None:
    """Two short prompts and two long ones from their envs' turn caches: the short rows
    run in a pass of their own instead of padded to the long ones, the numbers are those
    of the prompts scored without caches, and they come back in the prompts' order."""
    from llamagym.testing import BanditAgent

    policy = tiny_agent(BanditAgent).policy
    prompts = [[5 + (row * 7 + k) % 50 for k in range(length)]
               for row, length in enumerate([200, 12, 190, 10])]
    candidates = [[[1, 2, 3], [4, 5]], [[6]], [[7, 8], [9]], [[1], [2], [3]]]
    with torch.no_grad():
        plain, plain_values = policy.score(prompts, candidates)
        start = policy.positions_run
        keyed, keyed_values = policy.score(prompts, candidates, keys=["a", "b", "c", "d"])
    ran = policy.positions_run - start
    tails = [sum(len(c) - 1 for c in row) for row in candidates]
    assert ran < 4 * max(len(p) + t for p, t in zip(prompts, tails, strict=True)) * 0.6
    torch.testing.assert_close(keyed, plain, atol=TOLERANCE, rtol=0)
    torch.testing.assert_close(keyed_values, plain_values, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("seed", range(20))
def test_length_groups_are_the_cheapest_split(seed: int) -> None:
    """Against every split of the rows sorted by length into neighbouring groups."""
    import itertools
    import random

    from llamagym.models.passes import length_groups

    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 7))]
    overhead = rng.choice([0, 16, 64, 500])

    def cost(groups: list[list[int]]) -> int:
        return sum(len(g) * max(lengths[i] for i in g) + overhead for g in groups)

    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    cheapest = min(
        cost([order[a:b] for a, b in itertools.pairwise((0, *cuts, len(order)))])
        for n in range(len(order))
        for cuts in itertools.combinations(range(1, len(order)), n)
    )
    groups = length_groups(lengths, overhead)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert cost(groups) == cheapest


def test_a_model_without_a_plain_cache_runs_every_prompt_whole() -> None:
    """A sliding-window model (Mistral's cache keeps the last window of keys only): no
    turn cache, the numbers of passes without keys."""
    from transformers import MistralConfig, MistralForCausalLM

    from llamagym.models.loading import load_model_and_tokenizer
    from llamagym.models.policy import Policy

    _, tokenizer = load_model_and_tokenizer("tiny", device="cpu")
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        sliding_window=16, pad_token_id=tokenizer.pad_token_id, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    policy = Policy(MistralForCausalLM(config).eval(), tokenizer)
    prompts = [tokenizer("a b c d e f g h i j", add_special_tokens=False)["input_ids"]] * 2
    candidates = [[[5], [6, 7]]] * 2
    with torch.no_grad():
        keyed, keyed_values = policy.score(prompts, candidates, keys=["a", "b"])
        plain, plain_values = policy.score(prompts, candidates)
    assert policy.turn_cache is None
    assert torch.equal(keyed, plain) and torch.equal(keyed_values, plain_values)
