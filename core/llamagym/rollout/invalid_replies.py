"""Replies that name no legal action: asked again (:func:`ask_again`,
:func:`take_retries`), the invalid-action policy's fallback (:func:`apply_fallback`),
and, for an agent that names no actions, what its own
``extract_action`` makes of a reply (:func:`unnamed_action`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from llamagym.config import InvalidActionSettings
from llamagym.errors import LlamaGymError
from llamagym.rollout.prompts import feedback_message
from llamagym.rollout.trajectory import Turn, retry_messages


def apply_fallback(turn: Turn, policy: InvalidActionSettings, rng: np.random.Generator) -> None:
    """Choose a legal action for ``turn``'s unparsable reply under ``policy`` (its
    penalty added to the turn's reward); ``None`` never reaches ``env.step``."""
    turn.reward += policy.penalty
    turn.feedback = ""
    if policy.policy == "random":
        turn.action_index = int(rng.integers(len(turn.legal_actions)))
    elif policy.fallback_action in turn.legal_actions:
        turn.action_index = turn.legal_actions.index(policy.fallback_action)
    else:
        turn.action_index = 0
    if policy.policy == "end_episode":
        turn.ends_episode = True


def unnamed_action(agent: Any, reply: str) -> Any:
    """The env action of an agent that names no actions: what its own
    ``extract_action`` makes of ``reply``. There is no legal action to fall back on, so
    a reply it cannot read stops the run with what to do."""
    value = agent.extract_action(reply)
    if value is None:
        raise LlamaGymError(
            f"{type(agent).__name__}.extract_action returned None for the reply "
            f"{reply[:120]!r}, and the agent names no actions to fall back on: return "
            "an action for every reply (a default one), or set action_names = [...] "
            "(in the env's action order) so the invalid-action policy can choose one"
        )
    return value


def ask_again(
    turns: list[Turn], conversations: list[list[dict[str, str]]], penalty: float
) -> list[int]:
    """The rows whose reply named no legal action: each such turn is charged ``penalty``
    and given the feedback, and its row's conversation goes on with the failed reply
    and that feedback (so the model sees both, and its turn cache keeps them)."""
    pending = [row for row, turn in enumerate(turns) if not turn.valid]
    for row in pending:
        failed = turns[row]
        failed.reward += penalty
        failed.feedback = feedback_message(failed.legal_actions)
        conversations[row] = conversations[row] + retry_messages([failed])
    return pending


def take_retries(turns: list[Turn], rows: list[int], retried: list[Turn]) -> None:
    """Each row's new turn replaces its failed one, which joins the new turn's
    ``retries``."""
    for row, turn in zip(rows, retried, strict=True):
        turn.retries = [*turns[row].retries, turns[row]]
        turns[row].retries = []
        turns[row] = turn
