"""Demonstrations recorded from an agent's baseline policies, for the SFT warm-start.

``llamagym record AGENT --baseline NAME`` plays the baseline and writes one JSONL line per
decision: ``{"messages": [...]}``, the conversation exactly as the agent's model sees it
in the run's mode (system prompt, the history the agent keeps, the observation), ending
with the baseline's action as the assistant's reply, written as the model says it. In
generate mode that is after the agent's ``rollout.reply_prefix`` and closed
(``{"action": "hit"}``), or the move alone where it is written in the reply's format
already (TextArena's ``[A C]`` after the prefix ``[``), so a model fine-tuned on the file,
here or with another tool, learns the format the prompt asks for. In score mode it is
the action's name, and the line also lists the ``legal_actions`` it was chosen from: the
warm start then trains score mode's own choice, the action against the others.
``algorithm.warm_start.demonstrations`` reads the file back
(``llamagym_builtins.demonstrations_file.load_demonstrations``).

What a demonstration teaches depends on the baseline. The ``random`` baseline carries no
strategy at all, only the reply format: a model warm-started on it answers with a legal
action, each about equally often, and RL is left to learn which one is better. A strong
baseline (basic strategy, a walkthrough) teaches its play as well.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym.errors import ConfigError
from llamagym.paths import write_atomically
from llamagym.rollout.evaluation import outcome_reader, play_baseline
from llamagym.rollout.prompts import fill_reply_prefix, reply_closing

if TYPE_CHECKING:
    from llamagym.rollout.engine import RolloutEngine
    from llamagym.rollout.slots import Slot
    from llamagym.task import Task

RECORD_SEED_OFFSET = 2_000_003  # recorded episodes never reuse training or evaluation seeds
#: The most episodes a baseline warm start plays (``algorithm.warm_start.baseline_episodes``;
#: its demonstrations are held until written).
MAX_BASELINE_EPISODES = 100_000


def recording_seeds(seed: int, episodes: int) -> list[int]:
    """The seeds of ``episodes`` recorded episodes: a stream of their own, a million
    past the evaluation's (:func:`~llamagym.rollout.evaluation.evaluation_seeds` of the
    same ``seed``), so a run that records and then evaluates up to a million episodes
    evaluates on none of the recorded ones."""
    return [RECORD_SEED_OFFSET + seed * 100_003 + k for k in range(episodes)]


@dataclass(frozen=True)
class SuccessRule:
    """Which recorded episodes count as successful: those that end in one of
    ``outcomes``, or, with ``min_return``, those that return more than it."""

    outcomes: tuple[str, ...] = ()
    min_return: float | None = None

    @classmethod
    def of(cls, agent: Task) -> SuccessRule:
        """The agent's best outcome, the first it names (Blackjack's ``win``,
        TextWorld's ``won``); for an agent that names none, a return above 0."""
        names = tuple(agent.outcome_names)
        return cls(outcomes=names[:1]) if names else cls(min_return=0.0)

    def __str__(self) -> str:
        """What a successful episode did: "ended 'win'", "returned more than 0"."""
        if self.outcomes:
            return f"ended {' or '.join(map(repr, self.outcomes))}"
        return f"returned more than {self.min_return:g}"


@dataclass
class Recording:
    path: Path
    episodes: int
    demonstrations: int
    mean_return: float
    #: Episodes written (all of them, unless only some outcomes were asked for).
    kept_episodes: int


def check_recording(agent: Task, baseline: str, outcomes: Sequence[str] = ()) -> None:
    """Refuse a ``baseline`` or an outcome ``agent`` does not name, before any model
    loads (:func:`record_demonstrations` checks again)."""
    if baseline not in agent.baselines:
        known = ", ".join(sorted(agent.baselines)) or "none"
        raise ConfigError(
            f"agent {agent.name!r} has no baseline {baseline!r}; its baselines: {known}"
        )
    unknown = sorted(set(outcomes) - set(agent.outcome_names))
    if unknown:
        named = ", ".join(agent.outcome_names) or "none (it names no outcomes)"
        raise ConfigError(
            f"agent {agent.name!r} has no outcome {', '.join(map(repr, unknown))}; "
            f"its outcomes: {named}"
        )


def written_reply(
    engine: RolloutEngine, prefix: str, action: str, observation: Any, info: Mapping[str, Any]
) -> str:
    """The generate-mode reply that names ``action`` after the reply ``prefix``, as the
    agent's parsers read it back: the action closed after the prefix (``{"action": "hit"}``),
    or the action alone where it is written in the reply's own format already (a
    TextArena move ``[1 2 3 4]`` after the prefix ``[``). The first of these that parses
    back to the action is the one; an agent that lists no legal actions here (its env's
    parser judges the text) gets the first."""
    if not prefix:
        return action
    candidates = [prefix + action + reply_closing(prefix), prefix + action]
    if action.startswith(prefix):
        candidates.insert(0, action)
    legal = engine.agent.legal_actions(observation, info)
    if legal and action in legal:
        wanted = list(legal).index(action)
        for text in candidates:
            if engine.agent.read_reply(text, list(legal))[0] == wanted:
                return text
    return candidates[0]


def record_demonstrations(
    engine: RolloutEngine,
    baseline: str,
    episodes: int,
    output: Path,
    seed: int = 0,
    outcomes: Sequence[str] = (),
    min_return: float | None = None,
) -> Recording:
    """Play the ``baseline`` of ``engine``'s task for ``episodes`` episodes and write its
    decisions to ``output``, each prompt rendered by ``engine`` (one that needs no run:
    an agent's ``evaluation_engine(1)``); with ``outcomes`` (``["won"]``), only the
    decisions of episodes that ended so (the task's :meth:`~llamagym.task.Task.outcome`):
    random play filtered to its wins teaches what winning looks like, at no model pass;
    with ``min_return``, only those of episodes that returned more than it."""
    agent = engine.agent
    check_recording(agent, baseline, outcomes)
    outcome_of = outcome_reader(agent)
    seeds = recording_seeds(seed, episodes)
    records: list[dict[str, Any]] = []
    episode_records: list[dict[str, Any]] = []
    returns = [0.0] * episodes
    kept = 0
    slot: Slot | None = None
    current = -1
    for step in play_baseline(agent, baseline, seeds, rng_seed=seed):
        if slot is None or step.episode != current:  # a new episode: a fresh conversation
            current = step.episode
            slot = engine.new_slot(step.observation, step.info, seeds[current], None)
            episode_records = []
        slot.observation, slot.info = step.observation, step.info
        [user_text], _, [messages] = engine.render_prompts([slot])
        record: dict[str, Any]
        if engine.settings.mode == "score":  # the action's name, among the others
            reply = {"role": "assistant", "content": step.action}
            legal = list(agent.named_actions(step.observation, step.info))
            record = {"messages": [*messages, reply], "legal_actions": legal}
        else:
            prefix = fill_reply_prefix(engine.settings.reply_prefix, agent, step.observation)
            text = written_reply(engine, prefix, step.action, step.observation, step.info)
            reply = {"role": "assistant", "content": text}
            record = {"messages": [*messages, reply]}
        episode_records.append(record)
        slot.history += [{"role": "user", "content": user_text}, reply]
        returns[step.episode] += step.reward
        if step.done and (
            not outcomes or outcome_of(returns[step.episode], step.next_info) in outcomes
        ) and (min_return is None or returns[step.episode] > min_return):
            records += episode_records
            kept += 1
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # One rename: the file is complete or absent.
    write_atomically(output, "".join(json.dumps(record) + "\n" for record in records))
    return Recording(output, episodes, len(records), sum(returns) / max(1, episodes), kept)
