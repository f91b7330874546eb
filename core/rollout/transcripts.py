"""Transcripts: whole episodes as they happened, readable by people.

A run keeps a bounded sample in ``<run>/transcripts.jsonl``: the first
:data:`PER_UPDATE` episodes of every update and of the final evaluation, the newest
:data:`MAX_TRANSCRIPTS` of them in all (the file is rewritten whole, so its size stays
flat over a long run). Each line holds the system prompt and, per turn, the observation
text, the model's reply (generate mode) or the chosen action's probability (score mode),
the action taken, which parser found it, and the reward. ``report.md`` shows two of them
and ``llamagym play`` prints new ones the same way.
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym.paths import write_atomically

if TYPE_CHECKING:
    from llamagym.agent import Agent
    from llamagym.rollout.trajectory import Episode

TRANSCRIPTS = "transcripts.jsonl"
MAX_TRANSCRIPTS = 100
PER_UPDATE = 2


def _plain(value: Any) -> Any:
    """A JSON-able form of an env action (numpy scalars and arrays included)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def transcript(agent: Agent, episode: Episode, kind: str, update: int) -> dict[str, Any]:
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
        "system": agent.plugins.system_prompt(agent),
        "turns": turns,
    }


class TranscriptLog:
    """The newest ``limit`` transcripts of a run, kept in ``path`` (read back on resume;
    ``None``: in memory only)."""

    def __init__(self, path: Path | None, limit: int | None = None):
        self.path = Path(path) if path is not None else None
        existing = read_transcripts(self.path) if self.path is not None else []
        self.records: deque[dict[str, Any]] = deque(existing, maxlen=limit or MAX_TRANSCRIPTS)

    def add(self, records: Iterable[Mapping[str, Any]]) -> None:
        self.records.extend(dict(record) for record in records)
        if self.path is None:
            return
        write_atomically(self.path, "".join(json.dumps(record) + "\n" for record in self.records))


def read_transcripts(path: Path) -> list[dict[str, Any]]:
    """The transcripts in ``path`` (a damaged line is skipped), or [] without the file."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("turns"), list):
            records.append(record)
    return records


def render(record: Mapping[str, Any]) -> str:
    """A transcript as plain text: the system prompt, then each turn's observation, the
    model's answer, the action and the reward, then the return."""
    where = f"{record.get('kind', 'episode')} episode, update {record.get('update', '?')}"
    lines = [f"[{where}, seed {record.get('seed')}]", f"system: {record.get('system', '')}"]
    for number, turn in enumerate(record.get("turns", []), start=1):
        lines.append(f"{number:>3}. user: {turn.get('observation', '')}")
        if "reply" in turn:
            found = f" (found by {turn['parser']})" if turn.get("parser") else ""
            lines.append(f"     model: {turn['reply']!r}{found}")
            lines.append(f"     action: {turn.get('action')}  reward: {turn.get('reward', 0):+g}")
        else:
            probability = turn.get("probability")
            chance = f" (p={probability:.2f})" if isinstance(probability, float) else ""
            lines.append(
                f"     action: {turn.get('action')}{chance}  reward: {turn.get('reward', 0):+g}"
            )
    lines.append(f"     return: {float(record.get('return', 0.0)):+g}")
    return "\n".join(lines)
