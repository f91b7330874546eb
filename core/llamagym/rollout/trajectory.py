"""What a rollout records: turns, episodes and the batch an algorithm trains on."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One model decision and what the environment said about it.

    In score mode ``action_tokens`` is empty and ``logprobs`` holds one number, the
    log-probability of the chosen candidate among ``candidates`` (a softmax over their
    scores divided by ``temperature``); in generate mode ``action_tokens`` are the
    sampled reply tokens and ``logprobs`` one per token, the model's own (temperature
    1, whatever the sampling temperature). ``temperature`` is the sampling temperature
    the engine decided at, so a learner recomputes the very policy that acted.
    """

    prompt_tokens: list[int]
    legal_actions: list[str]
    action_index: int | None
    reply: str
    logprobs: list[float]
    value: float
    action_tokens: list[int] = field(default_factory=list)
    candidates: list[list[int]] = field(default_factory=list)
    reward: float = 0.0
    valid: bool = True
    user_text: str = ""
    ends_episode: bool = False
    #: Failed attempts before this reply under the ``reprompt`` policy, each followed
    #: in the conversation by ``feedback``.
    retries: list[Turn] = field(default_factory=list)
    feedback: str = ""
    temperature: float = 1.0
    #: What ``extract_action`` returned, given to ``env.step`` as it is, for an agent
    #: that names no actions (``legal_actions`` empty, ``action_index`` None).
    env_action: Any = None
    #: What found the action in the reply: one of the task's ``reply_parsers`` ("json",
    #: "extract_action", "regex") or a plugin's name; empty in score mode and for an
    #: unreadable reply.
    parser: str = ""
    #: The number of updates the weights that played this turn had seen. An episode
    #: carried from one collection into the next holds turns of two versions; each
    #: turn's ``logprobs`` are its own version's, the ratio's denominator.
    policy_version: int = 0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Turn:
        """A turn from ``dataclasses.asdict`` output (e.g. JSON): retries become turns
        again, and a field the data lacks takes its default."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {key: value for key, value in data.items() if key in known}
        fields["retries"] = [cls.from_dict(retry) for retry in fields.get("retries", [])]
        return cls(**fields)

    def context_messages(self) -> list[dict[str, str]]:
        """The messages this turn adds to the conversation, retries included."""
        return [
            {"role": "user", "content": self.user_text},
            *retry_messages(self.retries),
            {"role": "assistant", "content": self.reply},
        ]

    def training_turns(self, include_retries: bool) -> list[Turn]:
        """This turn, preceded by its failed attempts when they are trained on."""
        return [*self.retries, self] if include_retries else [self]


def retry_messages(retries: Sequence[Turn]) -> list[dict[str, str]]:
    """What failed attempts add to a conversation: each reply, then the feedback it got."""
    return [
        message
        for retry in retries
        for message in (
            {"role": "assistant", "content": retry.reply},
            {"role": "user", "content": retry.feedback},
        )
    ]


@dataclass
class Episode:
    turns: list[Turn] = field(default_factory=list)
    env_return: float = 0.0
    seed: int | None = None
    group: int | None = None
    length: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    #: The system prompt the episode was played with (with the agent's episode context,
    #: such as a game's goal); "" where it was not recorded.
    system_prompt: str = ""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Episode:
        """An episode from ``dataclasses.asdict`` output, its turns included."""
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {key: value for key, value in data.items() if key in known}
        fields["turns"] = [Turn.from_dict(turn) for turn in fields.get("turns", [])]
        return cls(**fields)

    @property
    def invalid_replies(self) -> int:
        return sum(not turn.valid for turn in self.turns)

    @property
    def truncated(self) -> bool:
        """Cut off by the env's time limit rather than ended: the last state still had a
        future. An episode ended by an invalid reply, or built by the act/
        terminate_episode loop (no summary), counts as ended."""
        return self.info.get("terminated") is False and not self.info.get(
            "ended_by_invalid_reply", False
        )

    @property
    def total_reward(self) -> float:
        """The reward the learner saw: the env's plus penalties and shaping."""
        return sum(turn.reward for turn in self.turns)


def info_summary(info: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON-friendly scalars of an episode's last ``info`` (won/lost/score and the
    like): what :attr:`Episode.info` keeps and what an agent's outcome is read from."""
    return {
        key: value
        for key, value in info.items()
        if isinstance(value, (bool, int, float, str)) and not key.startswith("_")
    }
