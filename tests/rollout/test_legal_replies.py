"""``rollout.legal_replies``: in generate mode a reply writes one of the turn's legal
actions, token by token, and ends; the log-probabilities kept are the model's own."""

from __future__ import annotations

from typing import Any

import gymnasium
import pytest
import torch

from llamagym.agent import Agent
from llamagym.models.legal_replies import LegalReplies, ReplyTree, legal_reply_text
from llamagym.models.loading import load_model_and_tokenizer
from llamagym.models.policy import Policy
from llamagym.testing import tiny_agent

CODES = tuple(f"[{a} {b} {c}]" for a in range(1, 5) for b in range(1, 5) for c in range(1, 5)
              if len({a, b, c}) == 3)  # 24 codes of 3 different digits


class Codes(gymnasium.Env):
    """Guess a code of 3 digits; each step's legal moves are the codes not yet tried."""

    observation_space = gymnasium.spaces.Text(200)
    action_space = gymnasium.spaces.Text(20)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.secret, self.tried = CODES[int(self.np_random.integers(len(CODES)))], []
        return "Guess the code.", {"moves": self.legal()}

    def legal(self) -> list[str]:
        return [code for code in CODES if code not in self.tried]

    def step(self, action: str):
        assert action in self.legal(), action  # the engine steps legal moves only
        self.tried.append(action)
        won = action == self.secret
        return f"{action} is {'right' if won else 'wrong'}.", float(won), won, \
            len(self.tried) >= 6, {"moves": self.legal()}


class CodesAgent(Agent):
    name = "codes"
    defaults = {"rollout": {"mode": "generate", "reply_prefix": "[", "max_new_tokens": 12,
                            "invalid_action": {"policy": "fallback"}}}

    def get_system_prompt(self) -> str:
        return "Reply with a code such as [1 2 3]."

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def legal_actions(self, observation: Any, info: dict) -> list[str]:
        return list(info["moves"])

    def make_env(self) -> Codes:
        return Codes()


def _turns(held: bool, greedy: bool) -> list[Any]:
    agent = tiny_agent(CodesAgent, rollout={"mode": "generate", "num_envs": 4,
                                            "legal_replies": held, "explore": "all"})
    engine = agent.evaluation_engine(4) if greedy else agent.engine
    try:
        return [turn for episode in engine.play(8, greedy=greedy) for turn in episode.turns]
    finally:
        engine.close()


@pytest.mark.parametrize("greedy", [False, True])
def test_every_held_reply_writes_a_legal_action_and_a_free_one_need_not(greedy: bool) -> None:
    held = _turns(held=True, greedy=greedy)
    assert len(held) >= 8
    for turn in held:
        assert turn.valid and turn.action_index is not None
        chosen = turn.legal_actions[turn.action_index]
        assert turn.reply == chosen  # the prefix "[" and the rest of the code, nothing else
        assert len(turn.logprobs) == len(turn.action_tokens)
    if not greedy:
        assert len({turn.reply for turn in held}) > 3  # sampled among the codes, varied
    free = _turns(held=False, greedy=greedy)
    assert any(not turn.valid for turn in free)  # the tiny model alone writes other things


def test_the_kept_log_probabilities_are_the_models_own() -> None:
    """The tree shapes what is drawn; the log-probabilities kept (and trained on) are
    the plain softmax's, as an evaluation pass over the same tokens computes them."""
    model, tokenizer = load_model_and_tokenizer("tiny")
    policy = Policy(model, tokenizer)
    allowed = [tokenizer(text, add_special_tokens=False)["input_ids"] + [policy.eos_id]
               for text in ("1 2 3]", "1 3 2]", "4 1 2]")]
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    trees = [ReplyTree(allowed), None, ReplyTree(allowed[2:])]
    replies = policy.generate(prompts, max_new_tokens=8, generator=torch.Generator()
                              .manual_seed(1), reply_trees=trees)
    assert replies.tokens[0] in allowed and replies.tokens[2] == allowed[2]
    with torch.no_grad():
        evaluation = policy.evaluate_replies(prompts, replies.tokens)
    for row, reply in enumerate(replies.tokens):
        expected = evaluation.logprobs[row, : len(reply)]
        assert torch.allclose(torch.tensor(replies.logprobs[row]), expected, atol=1e-4)


def test_the_mask_leaves_free_rows_and_its_input_alone() -> None:
    tree = ReplyTree([[4, 5, 9], [4, 6, 9]])
    processor = LegalReplies([tree, None])
    scores = torch.zeros(2, 10)
    first = processor(torch.tensor([[1, 2], [1, 2]]), scores)
    assert torch.isfinite(first[0]).tolist() == [i == 4 for i in range(10)]
    assert torch.isfinite(first[1]).all() and torch.isfinite(scores).all()
    second = processor(torch.tensor([[1, 2, 4], [1, 2, 7]]), scores)
    assert torch.isfinite(second[0]).nonzero().flatten().tolist() == [5, 6]
    third = processor(torch.tensor([[1, 2, 4, 6], [1, 2, 7, 7]]), scores)
    assert torch.isfinite(third[0]).nonzero().flatten().tolist() == [9]
    done = processor(torch.tensor([[1, 2, 4, 6, 9], [1, 2, 7, 7, 7]]), scores)
    assert torch.isfinite(done).all()  # a finished row is generate's to pad


@pytest.mark.parametrize(
    ("prefix", "action", "reply"),
    [
        ("[", "[1 2 3]", "1 2 3]"),
        ('{"action": "', "stick", 'stick"}'),
        ('{"sum": 12, "action": "', 'say "hi"', 'say \\"hi\\""}'),
        ('{"action": ', "hit", '"hit"}'),
        ("", "go north", "go north"),
        ("> ", "go north", "go north"),
    ],
)
def test_the_reply_that_writes_an_action(prefix: str, action: str, reply: str) -> None:
    assert legal_reply_text(prefix, action) == reply
