"""The four invalid-action policies, driven by a scripted model through the real engine."""

from __future__ import annotations

import pytest
import torch

from llamagym.errors import LlamaGymError
from llamagym.models.policy import Policy, Replies
from llamagym.testing import BanditAgent, tiny_agent


class ScriptedPolicy(Policy):
    """The tiny model, except that replies come from a script."""

    def __init__(self, model, tokenizer, script: list[str]):
        super().__init__(model, tokenizer)
        self.script = list(script)
        self.prompts_seen: list[list[int]] = []

    def generate(self, prompts, **settings):
        self.prompts_seen += [list(p) for p in prompts]
        replies = []
        for _ in prompts:
            text = self.script.pop(0) if len(self.script) > 1 else self.script[0]
            replies.append(
                self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eos_id]
            )
        return Replies.unscored(replies)


class CountingBandit(BanditAgent):
    steps = 0

    def make_env(self):
        env = super().make_env()
        original = env.step

        def step(action):
            CountingBandit.steps += 1
            return original(action)

        env.step = step
        return env


def scripted_agent(script: list[str], **invalid_action) -> BanditAgent:
    agent = tiny_agent(
        CountingBandit,
        rollout={"mode": "generate", "num_envs": 1, "invalid_action": invalid_action},
    )
    real = agent.policy
    agent.use_policy(ScriptedPolicy(real.model, real.tokenizer, script))
    return agent


def run_episodes(agent, count: int):
    return agent.engine.collect([agent.make_env()], count)


def test_fallback_action_with_penalty() -> None:
    agent = scripted_agent(["no idea"], policy="fallback", penalty=-0.5, fallback_action="right")
    [episode] = run_episodes(agent, 1)
    [turn] = episode.turns
    assert not turn.valid and turn.legal_actions[turn.action_index] == "right"
    assert turn.reward == pytest.approx(episode.env_return - 0.5)


def test_random_legal_action() -> None:
    agent = scripted_agent(["???"], policy="random", penalty=-1.0)
    chosen = {e.turns[0].action_index for e in run_episodes(agent, 30)}
    assert chosen == {0, 1}


def test_end_episode_does_not_step_the_env() -> None:
    CountingBandit.steps = 0
    agent = scripted_agent(["gibberish"], policy="end_episode", penalty=-2.0)
    episodes = run_episodes(agent, 3)
    assert CountingBandit.steps == 0
    assert all(e.env_return == 0.0 and e.total_reward == -2.0 for e in episodes)
    assert all(e.info["ended_by_invalid_reply"] for e in episodes)


@pytest.mark.parametrize("train_on_reprompts", [True, False])
def test_reprompt_keeps_the_exchange_in_context(train_on_reprompts: bool) -> None:
    agent = scripted_agent(
        ["hmm", "still thinking", '{"action": "left"}'],
        policy="reprompt",
        max_reprompts=3,
        penalty=-0.25,
        train_on_reprompts=train_on_reprompts,
    )
    [episode] = run_episodes(agent, 1)
    final = episode.turns[-1]
    assert final.valid and final.legal_actions[final.action_index] == "left"
    assert [r.reply for r in final.retries] == ["hmm", "still thinking"]
    assert len(episode.turns) == (3 if train_on_reprompts else 1)
    # The third prompt holds both failed replies and the feedback after each.
    tokenizer = agent.policy.tokenizer
    third_prompt = tokenizer.decode(agent.policy.prompts_seen[2])
    assert "hmm" in third_prompt and "still thinking" in third_prompt
    assert third_prompt.count("Reply with one of: left, right.") == 2
    messages = final.context_messages()
    assert [m["role"] for m in messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    penalties = [t.reward for t in final.retries]
    assert penalties == [-0.25, -0.25]


def test_reprompt_falls_back_after_k_attempts() -> None:
    agent = scripted_agent(
        ["nope"], policy="reprompt", max_reprompts=2, penalty=-1.0, fallback_action="left"
    )
    [episode] = run_episodes(agent, 1)
    final = episode.turns[-1]
    assert not final.valid and final.legal_actions[final.action_index] == "left"
    assert len(final.retries) == 2
    assert sum(t.reward for t in episode.turns) == pytest.approx(episode.env_return - 3.0)


def test_reply_prefix_is_context_and_the_parsers_read_it_with_the_reply() -> None:
    prefix = '{"action": "'
    agent = tiny_agent(
        CountingBandit, rollout={"mode": "generate", "num_envs": 1, "reply_prefix": prefix}
    )
    real = agent.policy
    agent.use_policy(ScriptedPolicy(real.model, real.tokenizer, ['right"}']))
    [episode] = run_episodes(agent, 1)
    [turn] = episode.turns
    prefix_tokens = real.tokenizer(prefix, add_special_tokens=False)["input_ids"]
    assert turn.prompt_tokens[-len(prefix_tokens) :] == prefix_tokens  # context, not trained
    assert turn.reply == '{"action": "right"}' and turn.valid
    assert turn.legal_actions[turn.action_index] == "right"
    assert real.tokenizer.decode(turn.action_tokens, skip_special_tokens=True) == 'right"}'


def test_a_reply_ends_where_its_json_object_closes() -> None:
    from llamagym.models.generation import closes_json, json_closed_at

    agent = tiny_agent(rollout={"mode": "generate"})
    tokenizer = agent.policy.tokenizer
    reply = tokenizer('hit"} and then some more text', add_special_tokens=False)["input_ids"]
    cut = json_closed_at(tokenizer, reply, '{"action": "')
    assert tokenizer.decode(cut).endswith('"}') and len(cut) < len(reply)
    assert json_closed_at(tokenizer, reply, "") == reply  # no object was opened
    assert closes_json('{"action": "hit"}') and not closes_json('{"action": "hi')
    assert not closes_json("} {")


class LeverBandit(CountingBandit):
    """Names the lever count in its reply prefix, as Blackjack names the player's sum."""

    def reply_fields(self, observation):
        return {"levers": len(self.action_names), "seen": int(observation)}


def test_a_reply_prefix_names_fields_the_agent_fills_from_each_observation() -> None:
    prefix = '{"levers": $levers, "seen": $seen, "cost": "$$1", "action": "'
    agent = tiny_agent(
        LeverBandit,
        rollout={
            "mode": "generate",
            "num_envs": 1,
            "reply_prefix": prefix,
            "invalid_action": {"policy": "reprompt", "max_reprompts": 1},
        },
    )
    real = agent.policy
    agent.use_policy(ScriptedPolicy(real.model, real.tokenizer, ["maybe", 'right"}']))
    observation, _ = agent.make_env().reset(seed=0)
    filled = f'{{"levers": 2, "seen": {int(observation)}, "cost": "$1", "action": "'
    [episode] = run_episodes(agent, 1)
    asked, turn = episode.turns  # the reply asked again for, then the one that counted
    filled_tokens = real.tokenizer(filled, add_special_tokens=False)["input_ids"]
    # The first reply and the one asked again both continue the filled prefix.
    assert len(agent.policy.prompts_seen) == 2
    for prompt in agent.policy.prompts_seen:
        assert prompt[-len(filled_tokens) :] == filled_tokens
    assert asked.reply == filled + "maybe" and not asked.valid
    assert turn.reply == filled + 'right"}' and turn.valid
    assert turn.legal_actions[turn.action_index] == "right"


def test_a_reply_prefix_naming_a_field_the_agent_does_not_give_says_which() -> None:
    agent = tiny_agent(
        LeverBandit, rollout={"mode": "generate", "num_envs": 1, "reply_prefix": '{"sum": $sum'}
    )
    with pytest.raises(LlamaGymError, match=r"names \$sum.*gives \['levers', 'seen'\]"):
        run_episodes(agent, 1)
    agent = tiny_agent(
        LeverBandit, rollout={"mode": "generate", "num_envs": 1, "reply_prefix": "costs $5"}
    )
    with pytest.raises(LlamaGymError, match=r"write \$\$ for a dollar sign"):
        run_episodes(agent, 1)


def test_generation_stops_each_row_where_its_own_prefix_and_reply_close_the_json() -> None:
    from llamagym.models.generation import JsonClosed

    tokenizer = tiny_agent(rollout={"mode": "generate"}).policy.tokenizer
    reply = tokenizer('hit"}', add_special_tokens=False)["input_ids"]
    rows = torch.tensor([reply, reply])
    # The same reply closes the object its row's prefix opened; without one it opens none.
    stop = JsonClosed(tokenizer, 0, ['{"action": "', ""])
    assert stop(rows, torch.zeros(2, 1)).tolist() == [True, False]
