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
from typing import Any

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from llamagym.rollout.env_checks import checked_reset, checked_step, error_text, max_turns
from llamagym.rollout.slots import Lockstep, Slot
from llamagym.rollout.trajectory import Episode

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


def snapshot(lockstep: Lockstep) -> dict[str, Any]:
    """``lockstep``'s episodes, in progress and finished, as plain data. An episode
    whose actions cannot be written down (an unnamed action that is not a number or a
    string) is left out: a resumed run starts a fresh one in its env."""
    slots: list[dict[str, Any] | None] = []
    for slot in lockstep.slots:
        replayable = slot is not None and slot.episode.seed is not None and all(
            index is not None or isinstance(action, _SCALARS) for index, action in slot.steps
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
        "finished": [dataclasses.asdict(episode) for episode in lockstep.finished],
        "next_episode": lockstep.next_episode,
    }


def replay(saved: Any, envs: list[Any], agent: Any, default_turns: int) -> Lockstep:
    """An open lockstep over ``envs`` holding ``saved``'s episodes (:func:`snapshot`),
    each env reset and stepped as its episode was; a slot left empty (None) is one
    whose episode could not be replayed, for the caller to start afresh. Raises
    ``ValueError`` if ``saved`` is not what :func:`snapshot` writes."""
    try:
        state = SavedLockstep.model_validate(saved)
        finished = [_EPISODE.validate_python(episode) for episode in state.finished]
        episodes = [None if s is None else _EPISODE.validate_python(s.episode)
                    for s in state.slots]
    except ValidationError as error:
        raise ValueError(f"its episodes in progress do not read: {error}") from None
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
        try:
            lockstep.slots[position] = _replayed(saved_slot, episode, envs[position], agent)
        except Exception as error:  # the env is untrusted: whatever it did, not this one
            logger.warning(
                "env %d: its episode in progress at the checkpoint could not be played "
                "again (%s: %s); a fresh one starts in its place",
                position, type(error).__name__, error_text(error),
            )
    return lockstep


def _replayed(saved: SavedSlot, episode: Episode, env: Any, agent: Any) -> Slot:
    """The slot of ``saved``'s episode, ``env`` reset and stepped through it again."""
    if len(saved.rewards) != len(saved.steps):
        raise ValueError("its steps and rewards differ in number")
    observation, info = checked_reset(env, saved.seed)
    for (index, action), reward in zip(saved.steps, saved.rewards, strict=True):
        if index is not None:
            legal = list(agent.legal_actions(observation, info) or [])
            if not 0 <= index < len(legal) or legal[index] != action:
                raise ValueError(f"the legal actions now differ at action {action!r}")
            action = agent.env_action(index, legal)
        observation, got, terminated, truncated, info = checked_step(env, action)
        if got != reward or terminated or truncated:
            raise ValueError("the env answers otherwise than it did")
    slot = Slot(observation, info, episode, history=list(saved.history))
    slot.steps = [(index, action) for index, action in saved.steps]
    slot.rewards = list(saved.rewards)
    return slot
