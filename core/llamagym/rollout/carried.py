"""Episodes carried from one collection into the next, saved with the run and played
back: a checkpoint keeps each env's episode in progress as the seed it was reset with,
the actions it took and what the learner recorded (:func:`snapshot`); a resumed run
resets fresh envs with those seeds and steps them with those actions (:func:`replay`),
so it goes on from the same states as the unbroken run. The saved part is data from a
file: every field is validated before use, and an episode whose env answers otherwise
than it did (another reward, an end) is dropped, never trained on."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from llamagym.rollout.env_checks import checked_reset, checked_step, error_text, max_turns
from llamagym.rollout.exploration import Tried, place_of
from llamagym.rollout.slots import Lockstep, Slot
from llamagym.rollout.trajectory import Episode, Turn

logger = logging.getLogger(__name__)

#: What ``env.step`` may be given for an agent that names no actions, if it is saved.
_SCALARS = (str, int, float, bool)
_EPISODE = TypeAdapter(Episode)


class SavedSlot(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int
    steps: list[tuple[int | None, str | int | float | bool]]
    rewards: list[float]
    history: list[dict[str, str]]
    episode: dict[str, Any]


class SavedLockstep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    slots: list[SavedSlot | None]
    finished: list[dict[str, Any]]
    next_episode: int


def _writable(episode: Episode) -> bool:
    """Whether every action of ``episode`` can be written down: a named action, or an
    unnamed one that is a number or a string."""
    return all(
        turn.env_action is None or isinstance(turn.env_action, _SCALARS)
        for turn in episode.turns
    )


def snapshot(lockstep: Lockstep) -> dict[str, Any]:
    """``lockstep``'s episodes, in progress and finished, as plain data. An episode
    whose actions cannot be written down (:func:`_writable`) is left out: a resumed run
    starts a fresh one in its env, or trains without it."""
    slots: list[dict[str, Any] | None] = []
    for slot in lockstep.slots:
        replayable = slot is not None and slot.episode.seed is not None and _writable(
            slot.episode
        )
        slots.append(None if slot is None or not replayable else {
            "seed": slot.episode.seed,
            "steps": [list(step) for step in slot.steps],
            "rewards": list(slot.rewards),
            "history": [dict(message) for message in slot.history],
            "episode": dataclasses.asdict(slot.episode),
        })
    return {
        "slots": slots,
        "finished": [dataclasses.asdict(e) for e in lockstep.finished if _writable(e)],
        "next_episode": lockstep.next_episode,
    }


def turn_problem(turn: Turn, mode: str) -> str | None:
    """What in ``turn`` is not what the engine records for a turn of ``mode``, in the
    field's terms (None: nothing). Score mode: one candidate per legal action, the chosen
    one's index among them and its one log-probability. Generate mode: one
    log-probability per reply token, no candidates, an index (if any) among the legal
    actions."""
    legal, index = turn.legal_actions, turn.action_index
    if index is not None and not 0 <= index < len(legal):
        return f"action_index {index} is not one of its {len(legal)} legal actions"
    if mode == "score":
        if index is None:
            return "action_index is null, where score mode always chooses"
        if len(turn.candidates) != len(legal) or not all(turn.candidates):
            return (f"candidates holds {len(turn.candidates)} token lists for its "
                    f"{len(legal)} legal actions")
        if len(turn.logprobs) != 1:
            return f"logprobs holds {len(turn.logprobs)} numbers, where score mode keeps 1"
    else:
        if turn.candidates:
            return "candidates is not empty, where generate mode ranks none"
        if len(turn.logprobs) != len(turn.action_tokens):
            return (f"logprobs holds {len(turn.logprobs)} numbers for its "
                    f"{len(turn.action_tokens)} reply tokens")
    if not all(math.isfinite(x) for x in (*turn.logprobs, turn.value, turn.reward)):
        return "a number it trains on is not finite"
    return None


def _checked(episode: Episode, vocabulary: int, mode: str) -> Episode:
    """``episode`` if each of its turns is one the engine records in ``mode``
    (:func:`turn_problem`), every token id one of the model's; else ``ValueError``
    naming the turn and the field."""
    turns = [t for top in episode.turns for t in (top, *top.retries)]
    for number, turn in enumerate(turns, 1):
        ids = [*turn.prompt_tokens, *turn.action_tokens, *(i for c in turn.candidates for i in c)]
        if any(not 0 <= i < vocabulary for i in ids):
            raise ValueError(f"a turn holds a token id outside the model's {vocabulary:,}")
        problem = turn_problem(turn, mode)
        if problem is not None:
            raise ValueError(f"turn {number} of an episode: {problem}")
    return episode


def _validated(
    saved: Any, vocabulary: int, mode: str
) -> tuple[SavedLockstep, list[Episode], list[Episode | None]]:
    """``saved`` read: its lockstep, its finished episodes and each slot's episode in
    progress (None for an empty slot), every turn checked (:func:`_checked`); else one
    ``ValueError`` line."""
    try:
        state = SavedLockstep.model_validate(saved)
        finished = [_checked(_EPISODE.validate_python(e), vocabulary, mode)
                    for e in state.finished]
        episodes = [None if s is None else _checked(_EPISODE.validate_python(s.episode),
                                                    vocabulary, mode) for s in state.slots]
    except (ValidationError, ValueError) as error:
        said = " ".join(str(error).split())[:300]
        raise ValueError(f"its episodes in progress do not read: {said}") from None
    return state, finished, episodes


def check_saved(saved: Any, mode: str) -> None:
    """Refuse (``ValueError``) episodes in progress that are not what :func:`snapshot`
    writes for a run in ``mode``: read before anything of a resumed run is written
    (:func:`replay` reads them again, with the model's vocabulary)."""
    _validated(saved, 2**63, mode)


def replay(
    saved: Any, envs: list[Any], agent: Any, default_turns: int, vocabulary: int
) -> Lockstep:
    """An open lockstep over ``envs`` holding ``saved``'s episodes (:func:`snapshot`),
    each env reset and stepped as its episode was; a slot left empty (None) is one
    whose episode could not be replayed, for the caller to start afresh. Raises
    ``ValueError`` if ``saved`` is not what :func:`snapshot` writes for a model of
    ``vocabulary`` tokens."""
    state, finished, episodes = _validated(saved, vocabulary, agent.config.rollout.mode)
    if len(state.slots) != len(envs):
        raise ValueError(f"it holds {len(state.slots)} envs' episodes, this run has {len(envs)}")
    lockstep = Lockstep(
        envs, None, None, 1, None,
        slots=[None] * len(envs),
        turn_caps=[max_turns(env, default_turns) for env in envs],
        finished=finished,
        next_episode=state.next_episode,
    )
    for position, (saved_slot, episode) in enumerate(zip(state.slots, episodes, strict=True)):
        if saved_slot is None or episode is None:
            continue
        if len(saved_slot.steps) >= lockstep.turn_caps[position]:
            raise ValueError(
                f"its episode in progress in env {position} took {len(saved_slot.steps):,} "
                f"steps, where one ends at {lockstep.turn_caps[position]:,}"
            )
        try:
            lockstep.slots[position] = _replayed(saved_slot, episode, envs[position], agent)
        except NotItsReplay as error:  # the file's fault, not the env's
            raise ValueError(f"its episode in progress in env {position}: {error}") from None
        except Exception as error:  # the env is untrusted: whatever it did, not this one
            logger.warning(
                "env %d: its episode in progress at the checkpoint could not be played "
                "again (%s: %s); a fresh one starts in its place",
                position, type(error).__name__, error_text(error),
            )
    return lockstep


class NotItsReplay(ValueError):
    """A saved episode's turns are not the turns its own steps played."""


def _check_turns(episode: Episode, saved: SavedSlot, legal_at: list[list[str]]) -> None:
    """Each turn of ``episode`` (one per step, with no retries trained on) chose the
    step's action among legal actions the env gave at that step on replay."""
    if len(episode.turns) != len(saved.steps):
        raise NotItsReplay(
            f"it holds {len(episode.turns)} turns for its {len(saved.steps)} steps"
        )
    for number, (turn, legal, (index, action)) in enumerate(
        zip(episode.turns, legal_at, saved.steps, strict=True), 1
    ):
        if index is None:
            continue  # an action the agent does not name: nothing to compare
        if not set(turn.legal_actions) <= set(legal):
            raise NotItsReplay(
                f"turn {number}'s legal_actions are not among those the env gives there"
            )
        if turn.action_index is None or turn.legal_actions[turn.action_index] != action:
            raise NotItsReplay(f"turn {number}'s action_index is not the action its step took")


def _replayed(saved: SavedSlot, episode: Episode, env: Any, agent: Any) -> Slot:
    """The slot of ``saved``'s episode, ``env`` reset and stepped through it again."""
    if len(saved.rewards) != len(saved.steps):
        raise ValueError("its steps and rewards differ in number")
    observation, info = checked_reset(env, saved.seed)
    tried = Tried()  # rollout.explore's counts, taken again
    legal_at: list[list[str]] = []
    for (index, action), reward in zip(saved.steps, saved.rewards, strict=True):
        legal_at.append(list(agent.legal_actions(observation, info) or []))
        if index is not None:
            legal = legal_at[-1]
            if not 0 <= index < len(legal) or legal[index] != action:
                raise ValueError(f"the legal actions now differ at action {action!r}")
            if agent.config.rollout.explore == "least-tried":
                tried.place = place_of(agent, observation, info, legal)
                tried.count(str(action))
            action = agent.env_action(index, legal)
        observation, got, terminated, truncated, info = checked_step(env, action)
        if got != reward or terminated or truncated:
            raise ValueError("the env answers otherwise than it did")
    rollout = agent.config.rollout
    retried = rollout.invalid_action.policy == "reprompt" and rollout.mode == "generate"
    if not (retried and rollout.invalid_action.train_on_reprompts):  # one turn per step
        _check_turns(episode, saved, legal_at)
    slot = Slot(observation, info, episode, history=list(saved.history), tried=tried)
    slot.steps = [(index, action) for index, action in saved.steps]
    slot.rewards = list(saved.rewards)
    return slot
