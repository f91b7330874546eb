"""Sizes that come from the user or from data are checked before anything is allocated:
a setting beyond its declared bound, a prompt longer than the model's context, a pass
whose attention would not fit, an action name or legal-action list that is not what an
agent may give, an observation that is not writable text. Each is refused in one line
(exit code 2 on the command line) or handled, never a traceback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, EnvFailureError, LlamaGymError
from llamagym.models import pass_memory
from llamagym.models.pass_memory import PassTooLargeError
from llamagym.rollout.env_checks import checked_legal_actions
from llamagym.testing import BanditAgent, one_error_line, tiny_agent

FAST = [
    "--num-envs", "2", "--threads", "1", "--episodes", "4", "--eval-episodes", "2",
    "--set", "algorithm.episodes_per_update=4", "--set", "algorithm.minibatch_size=4",
    "--set", "algorithm.epochs=1", "--quiet",
]


# -- settings: bounds declared where the settings are ----------------------------------
@pytest.mark.parametrize(
    "flag, key, limit",
    [
        (["--threads", "1000000000"], "training.threads", "1024"),
        (["--set", "algorithm.clip_range=1e308"], "algorithm.clip_range", "1"),
        (["--set", "model.lora_rank=1000000000"], "model.lora_rank", "1024"),
        (["--set", "rollout.max_action_chars=1000000000"], "rollout.max_action_chars", "100000"),
    ],
)
def test_a_size_beyond_its_bound_is_refused_before_loading(flag, key, limit, tmp_path, cli):
    output = tmp_path / "run"
    code, _, err = cli("run", "blackjack", *FAST, *flag, "--output", output)
    assert code == 2, err
    line = one_error_line(err)
    assert key in line and f"less than or equal to {limit}" in line
    assert not output.exists()


def _upper_bounds() -> list[tuple[str, str, float]]:
    """(section, field, bound) of every RunConfig setting declared with an upper bound."""
    bounds = []
    for section, info in RunConfig.model_fields.items():
        model = info.annotation
        for name, field in getattr(model, "model_fields", {}).items():
            for rule in field.metadata:
                if getattr(rule, "le", None) is not None:
                    bounds.append((section, name, rule.le))
    return bounds


BOUNDED = [(s, n, b) for s, n, b in _upper_bounds() if s != "rollout" or n != "reply_prefix"]


def test_the_settings_named_here_carry_their_bounds() -> None:
    named = {(section, name) for section, name, _ in BOUNDED}
    assert {("training", "threads"), ("model", "lora_rank"),
            ("rollout", "max_action_chars"), ("rollout", "max_prompt_chars")} <= named


@settings(max_examples=40, deadline=None)
@given(which=st.sampled_from(BOUNDED), excess=st.integers(1, 10**30))
def test_every_bounded_setting_refuses_any_value_past_its_bound(which, excess) -> None:
    section, name, bound = which
    value = int(bound) + excess
    with pytest.raises(ConfigError) as raised:
        tiny_agent(BanditAgent, **{section: {name: value}})
    message = str(raised.value)
    assert f"{section}.{name}" in message and "less than or equal to" in message
    assert "\n" not in message


# -- the prompt within the model's context ---------------------------------------------
class LongAgent(BanditAgent):
    """The bandit, with an observation of ``chars`` characters and a whole history."""

    name = "long"
    chars = 120_000
    system = "Pull one lever: left or right."

    def get_system_prompt(self) -> str:
        return self.system

    def format_observation(self, observation) -> str:
        return "Which lever? " + "x" * self.chars


def _play(agent, episodes: int = 2):
    return agent.engine.collect([agent.make_env() for _ in range(2)], episodes)


def _context_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "model's context" in r.getMessage()]


@pytest.mark.parametrize("mode", ["score", "generate"])
def test_an_observation_past_the_context_is_cut_to_fit_with_one_warning(mode, caplog) -> None:
    # 120,000 characters under rollout.max_prompt_chars (131,072): ~120,000 tokens of
    # the tiny model against its 2,048-token context.
    agent = tiny_agent(LongAgent, rollout={"num_envs": 2, "mode": mode, "max_new_tokens": 4})
    episodes = _play(agent, 4)
    context = agent.policy.max_context
    assert len(episodes) == 4
    for turn in (t for e in episodes for t in e.turns):
        assert len(turn.prompt_tokens) <= context
        assert 1_000 < len(turn.user_text) < 120_000
    warned = _context_warnings(caplog)
    assert len(warned) == 1 and "observations are cut to fit" in warned[0]
    assert "'long'" in warned[0] and f"{context:,} tokens" in warned[0]


def test_old_turns_are_dropped_first_with_one_warning(monkeypatch, caplog) -> None:
    monkeypatch.setattr(LongAgent, "chars", 600)  # three turns fill the tiny context
    agent = tiny_agent(LongAgent, rollout={"num_envs": 2, "history_turns": None})
    slot = agent.engine.new_slot(None, {}, 0, 0)
    for _ in range(8):
        slot.history += [{"role": "user", "content": "x" * 600},
                         {"role": "assistant", "content": "left"}]
    _, [prompt], [conversation] = agent.engine.render_prompts([slot])
    assert len(prompt) <= agent.policy.max_context - 16
    kept = [m for m in conversation if m["role"] == "assistant"]
    assert 0 < len(kept) < 8  # the oldest went, the latest stayed
    assert conversation[-1]["content"].endswith("x" * 600)  # the observation is whole
    warned = _context_warnings(caplog)
    assert len(warned) == 1 and "oldest turns of its conversation are dropped" in warned[0]


def test_a_system_prompt_past_the_context_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setattr(LongAgent, "system", "y" * 100_000)
    agent = tiny_agent(LongAgent, rollout={"num_envs": 2})
    with pytest.raises(LlamaGymError) as raised:
        _play(agent)
    message = str(raised.value)
    assert "the system prompt" in message and "2,048 tokens" in message
    assert "'long'" in message and "\n" not in message


# -- a pass's attention memory ---------------------------------------------------------
def test_a_pass_past_the_memory_bound_is_split_and_gives_the_same_numbers(monkeypatch):
    agent = tiny_agent(BanditAgent)
    policy = agent.policy
    prompts = [[5 + (row * 7 + k) % 50 for k in range(60 + 10 * row)] for row in range(6)]
    candidates = [[[1, 2, 3], [4, 5]]] * 6
    with torch.no_grad():
        whole_scores, whole_values = policy.score(prompts, candidates)
        whole_replies = policy.generate(prompts, max_new_tokens=3, greedy=True)
    calls = []
    real = pass_memory.pass_groups

    def counted(*args, **kwargs):
        groups = real(*args, **kwargs)
        calls.append(len(groups))
        return groups

    # Room for about two rows per pass.
    budget = 2 * 120 * 120 * pass_memory.entry_bytes(policy.attention_heads)
    monkeypatch.setattr("llamagym.models.turn_passes.pass_budget", lambda: budget)
    monkeypatch.setattr("llamagym.models.turn_passes.pass_groups", counted)
    with torch.no_grad():
        scores, values = policy.score(prompts, candidates)
        replies = policy.generate(prompts, max_new_tokens=3, greedy=True)
    assert calls[0] >= 3  # the score pass was split
    torch.testing.assert_close(scores, whole_scores, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, whole_values, atol=1e-5, rtol=1e-5)
    assert replies.tokens == whole_replies.tokens


def test_one_prompt_past_the_memory_bound_is_refused_in_one_line(monkeypatch) -> None:
    agent = tiny_agent(BanditAgent)
    monkeypatch.setattr("llamagym.models.turn_passes.pass_budget", lambda: 2**20)
    with pytest.raises(PassTooLargeError) as raised, torch.no_grad():
        agent.policy.score([list(range(5, 1_000))], [[[1, 2], [3]]])
    message = str(raised.value)
    assert "a score pass" in message and "GiB of attention" in message
    assert "rollout.max_prompt_chars" in message and "\n" not in message


def test_the_bound_is_estimated_from_the_turn_cache() -> None:
    """256 envs whose prompts their turn caches hold run their few new tokens in one
    pass; the same prompts from scratch are split."""
    shapes_cached = [(20, 2_048)] * 256
    shapes_whole = [(2_032, 2_048)] * 256
    budget = 4 * 2**30
    assert len(pass_memory.pass_groups(shapes_cached, 4, budget, "x")) == 1
    groups = pass_memory.pass_groups(shapes_whole, 4, budget, "x")
    assert len(groups) > 1 and sorted(i for g in groups for i in g) == list(range(256))
    per_row = 2_032 * 2_048 * pass_memory.entry_bytes(4)
    assert all(len(g) * per_row <= budget for g in groups)


# -- legal actions and observations from an env or agent -------------------------------
class NamingAgent(BanditAgent):
    name = "naming"
    names: list = ["left", "right"]
    text = "Which lever?"

    def legal_actions(self, observation, info):
        return self.names

    def format_observation(self, observation) -> str:
        return self.text


@pytest.mark.parametrize(
    "names, problem",
    [
        ([1, None], "int 1, not a string"),
        (["left", None], "NoneType None, not a string"),
        (["left" + "x" * 200_000, "right"], "200,004 characters long"),
        (["left\ud800", "right"], "not writable text"),
        ([], "gave no legal actions"),
        ("left", "as one string"),
    ],
)
@pytest.mark.parametrize("mode", ["score", "generate"])
def test_legal_actions_an_agent_may_not_give_stop_the_run_in_one_line(
    names, problem, mode, monkeypatch
) -> None:
    monkeypatch.setattr(NamingAgent, "names", names)
    agent = tiny_agent(NamingAgent, rollout={"num_envs": 2, "mode": mode})
    with pytest.raises(EnvFailureError) as raised:
        _play(agent)
    message = str(raised.value)
    assert "agent 'naming'" in message and problem in message and "\n" not in message
    assert len(message) < 400
    if "characters long" in problem:
        assert "rollout.max_action_chars = 1,000" in message


@settings(max_examples=200, deadline=None)
@given(
    names=st.lists(
        st.one_of(st.text(max_size=30), st.integers(), st.none(), st.floats(),
                  st.binary(max_size=5), st.text(min_size=31, max_size=60)),
        max_size=6,
    )
)
def test_any_legal_action_list_is_accepted_or_refused_in_one_line(names) -> None:
    good = bool(names) and all(isinstance(n, str) and len(n) <= 30 for n in names)
    try:
        legal = checked_legal_actions(NamingAgent, "the env of agent 'naming'", [names],
                                      "score", 30)
    except EnvFailureError as error:
        assert not good and "\n" not in str(error) and len(str(error)) < 400
    else:
        assert good and legal == [list(names)]


def test_a_lone_surrogate_in_an_observation_is_escaped(monkeypatch) -> None:
    monkeypatch.setattr(NamingAgent, "text", "Which lever? \ud800 \udfff")
    for mode in ("score", "generate"):
        agent = tiny_agent(NamingAgent, rollout={"num_envs": 2, "mode": mode,
                                                 "max_new_tokens": 4})
        episodes = _play(agent)
        assert len(episodes) == 2
        shown = episodes[0].turns[0].user_text
        assert shown == "Which lever? \\ud800 \\udfff"
        shown.encode("utf-8")  # writable


def test_config_show_gives_each_bound_where_the_setting_is_described(cli) -> None:
    code, out, err = cli("config", "show", "blackjack")
    assert code == 0, err
    lines = out.splitlines()
    for key, bound in [("threads", "[1 to 1,024]"), ("lora_rank", "[1 to 1,024]"),
                       ("clip_range", "[> 0 to 1]"), ("max_action_chars", "[1 to 100,000]")]:
        at = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{key}:"))
        assert lines[at - 1].strip().startswith("#") and lines[at - 1].endswith(bound)
