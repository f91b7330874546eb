"""Transcripts: whole episodes as they happened, readable by people.

A run keeps a bounded sample in ``<run>/transcripts.jsonl``: the first
:data:`PER_UPDATE` episodes of every update and of the final evaluation, the newest
:data:`MAX_TRANSCRIPTS` of them in all (the file is rewritten whole, so its size stays
flat over a long run). Each line holds the system prompt and, per turn, the observation
text, the model's reply (generate mode) or the chosen action's probability (score mode),
the action taken, which parser found it, and the reward. ``report.md`` shows two of them
and ``llamagym play`` prints new ones the same way. The file is read back through
:func:`llamagym.training.records.run_files.read_transcripts`, which checks every record, and
:func:`render` shows what a model or an env wrote with its control characters escaped.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym.display import printable
from llamagym.paths import write_atomically
from llamagym.training.records.run_files import read_transcripts

if TYPE_CHECKING:
    from llamagym.rollout.trajectory import Episode
    from llamagym.task import Task

TRANSCRIPTS = "transcripts.jsonl"
MAX_TRANSCRIPTS = 100
PER_UPDATE = 2


def _plain(value: Any) -> Any:
    """A JSON-able form of an env action (numpy scalars and arrays included)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def transcript(agent: Task, episode: Episode, kind: str, update: int) -> dict[str, Any]:
    """One episode as a transcript record (``kind``: ``training`` or ``evaluation``)."""
    turns = []
    for turn in episode.turns:
        if turn.action_index is not None:
            action = turn.legal_actions[turn.action_index]
        else:
            action = _plain(turn.env_action)
        row: dict[str, Any] = {"observation": turn.user_text, "action": action}
        if turn.candidates:  # score mode: the chosen action's probability
            row["probability"] = math.exp(turn.logprobs[0]) if turn.logprobs else None
        else:
            row["reply"] = turn.reply
            row["parser"] = turn.parser or ("" if turn.valid else "none: invalid reply")
        row["reward"] = turn.reward
        turns.append(row)
    return {
        "kind": kind,
        "update": update,
        "seed": episode.seed,
        "return": episode.env_return,
        "system": episode.system_prompt or agent.plugins.system_prompt(agent),
        "turns": turns,
    }


class TranscriptLog:
    """The newest ``limit`` transcripts of a run, kept in ``path`` (read back on resume;
    ``None``: in memory only). A damaged file is a ``RunFileError`` naming the line."""

    def __init__(self, path: Path | None, limit: int | None = None):
        self.path = Path(path) if path is not None else None
        limit = limit or MAX_TRANSCRIPTS
        existing = read_transcripts(self.path, keep_last=limit) if self.path is not None else []
        self.records: deque[dict[str, Any]] = deque(existing, maxlen=limit)

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        self.records.extend(dict(record) for record in records)
        if self.path is None:
            return
        write_atomically(self.path, "".join(json.dumps(record) + "\n" for record in self.records))


def render(record: Mapping[str, Any]) -> str:
    """A transcript as plain text: the system prompt, then each turn's observation, the
    model's answer, the action and the reward, then the return. Everything a model, an
    env or the file wrote is shown with its control characters escaped (the reply as
    its ``repr``), so printing it cannot drive a terminal."""
    kind, update = printable(record.get("kind", "episode"), keep=""), record.get("update", "?")
    lines = [f"[{kind} episode, update {update}, seed {record.get('seed')}]",
             f"system: {printable(record.get('system', ''))}"]
    for number, turn in enumerate(record.get("turns", []), start=1):
        lines.append(f"{number:>3}. user: {printable(turn.get('observation', ''))}")
        action = printable(turn.get("action"), keep="")
        if "reply" in turn:
            parser = printable(turn.get("parser") or "", keep="")
            found = f" (found by {parser})" if parser else ""
            lines.append(f"     model: {turn['reply']!r}{found}")
            lines.append(f"     action: {action}  reward: {turn.get('reward', 0):+g}")
        else:
            probability = turn.get("probability")
            chance = f" (p={probability:.2f})" if isinstance(probability, float) else ""
            lines.append(f"     action: {action}{chance}  reward: {turn.get('reward', 0):+g}")
    lines.append(f"     return: {float(record.get('return', 0.0)):+g}")
    return "\n".join(lines)
