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
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

from llamagym.rollout.env_checks import (
    checked_reset,
    checked_step,
    error_text,
    max_turns,
    step_reward,
)
from llamagym.rollout.prompts import feedback_message
from llamagym.rollout.slots import Lockstep, Slot
from llamagym.rollout.trajectory import Episode, Turn


class Replayer(Protocol):
    """What a replay needs of the engine that plays the episodes on (``RolloutEngine``)."""

    agent: Any
    settings: Any
    policy: Any

    @property
    def envs(self) -> list[Any]: ...
    def new_slot(
        self, observation: Any, info: dict, seed: int | None, group: int | None
    ) -> Slot: ...
    def candidate_tokens(self, name: str) -> list[int]: ...
    def reply_text(self, slot: Slot, tokens: list[int]) -> str: ...
    def decision_prompt(
        self, slot: Slot, retries: Sequence[Turn] = ()
    ) -> tuple[str, list[int]]: ...

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
        if turn.action_tokens:
            return "action_tokens is not empty, where score mode samples no reply"
    else:
        if turn.candidates:
            return "candidates is not empty, where generate mode ranks none"
        if len(turn.logprobs) != len(turn.action_tokens):
            return (f"logprobs holds {len(turn.logprobs)} numbers for its "
                    f"{len(turn.action_tokens)} reply tokens")
    if not all(math.isfinite(x) for x in (*turn.logprobs, turn.value, turn.reward)):
        return "a number it trains on is not finite"
    return None


#: A candidate action name's token ids, as the engine ranks it (``Engine.candidate_tokens``).
CandidateTokens = Callable[[str], list[int]]


def _checked(
    episode: Episode, vocabulary: int, mode: str, candidate_tokens: CandidateTokens
) -> Episode:
    """``episode`` if each of its turns is one the engine records in ``mode``
    (:func:`turn_problem`), every token id one of the model's and each score-mode
    candidate the tokens of its legal action (``candidate_tokens``); else
    ``ValueError`` naming the turn and the field."""
    turns = [t for top in episode.turns for t in (top, *top.retries)]
    for number, turn in enumerate(turns, 1):
        ids = [*turn.prompt_tokens, *turn.action_tokens, *(i for c in turn.candidates for i in c)]
        if any(not 0 <= i < vocabulary for i in ids):
            raise ValueError(f"a turn holds a token id outside the model's {vocabulary:,}")
        problem = turn_problem(turn, mode)
        if problem is None and mode == "score" and any(
            tokens != candidate_tokens(name)
            for tokens, name in zip(turn.candidates, turn.legal_actions, strict=True)
        ):
            problem = "candidates are not the tokens of its legal actions"
        if problem is not None:
            raise ValueError(f"turn {number} of an episode: {problem}")
    return episode


def _validated(
    saved: Any, vocabulary: int, mode: str, candidate_tokens: CandidateTokens
) -> tuple[SavedLockstep, list[Episode], list[Episode | None]]:
    """``saved`` read: its lockstep, its finished episodes and each slot's episode in
    progress (None for an empty slot), every turn checked (:func:`_checked`); else one
    ``ValueError`` line."""
    def checked(episode: Any) -> Episode:
        return _checked(_EPISODE.validate_python(episode), vocabulary, mode, candidate_tokens)

    try:
        state = SavedLockstep.model_validate(saved)
        finished = [checked(e) for e in state.finished]
        episodes = [None if s is None else checked(s.episode) for s in state.slots]
    except (ValidationError, ValueError) as error:
        said = " ".join(str(error).split())[:300]
        raise ValueError(f"its episodes in progress do not read: {said}") from None
    return state, finished, episodes


def check_saved(
    saved: Any, mode: str, vocabulary: int, candidate_tokens: CandidateTokens
) -> None:
    """Refuse (``ValueError``) episodes in progress that are not what :func:`snapshot`
    writes for a run in ``mode`` with a model of ``vocabulary`` tokens: read before
    anything of a resumed run is written (:func:`replay` reads them again, and plays
    them)."""
    _validated(saved, vocabulary, mode, candidate_tokens)


def replay(saved: Any, engine: Replayer) -> Lockstep:
    """An open lockstep over the engine's envs holding ``saved``'s episodes
    (:func:`snapshot`), each env reset and stepped as its episode was; a slot left empty
    (None) is one whose episode could not be replayed, for the caller to start afresh.
    Raises ``ValueError`` if ``saved`` is not what :func:`snapshot` writes for the
    engine's model, or an episode's turns are not the decisions its steps replay."""
    envs, policy = engine.envs, engine.policy
    state, finished, episodes = _validated(
        saved, len(policy.tokenizer), engine.settings.mode, engine.candidate_tokens
    )
    if len(state.slots) != len(envs):
        raise ValueError(f"it holds {len(state.slots)} envs' episodes, this run has {len(envs)}")
    lockstep = Lockstep(
        envs, None, None, 1, None,
        slots=[None] * len(envs),
        turn_caps=[max_turns(env, engine.settings.max_episode_turns) for env in envs],
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
            lockstep.slots[position] = _replayed(saved_slot, episode, envs[position], engine)
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


def _replayed(saved: SavedSlot, episode: Episode, env: Any, engine: Replayer) -> Slot:
    """The slot of ``saved``'s episode, ``env`` reset and stepped through it again; each
    step's turn checked against the decision the step replays (:func:`_check_turn`),
    and the conversation the turns make against the saved one."""
    if len(saved.rewards) != len(saved.steps):
        raise ValueError("its steps and rewards differ in number")
    if episode.seed != saved.seed:
        raise NotItsReplay("its episode's seed is not the one its env is reset with")
    agent, settings = engine.agent, engine.settings
    retried = settings.invalid_action
    retries_trained = (
        settings.mode == "generate" and retried.policy == "reprompt" and retried.train_on_reprompts
    )
    turns = _step_turns(
        episode.turns, len(saved.steps), retried.max_reprompts if retries_trained else 0
    )
    observation, info = checked_reset(env, saved.seed)
    slot = engine.new_slot(observation, info, episode.seed, episode.group)
    if slot.system_prompt != episode.system_prompt:
        raise NotItsReplay("its system_prompt is not the one the agent gives its first observation")
    for number, ((index, action), reward, turn) in enumerate(
        zip(saved.steps, saved.rewards, turns, strict=True), 1
    ):
        legal = list(agent.legal_actions(observation, info) or [])
        if index is not None and (not 0 <= index < len(legal) or legal[index] != action):
            raise ValueError(f"the legal actions now differ at action {action!r}")
        offered = slot.tried.offer(agent, observation, info, legal, settings.explore)
        _check_turn(number, turn, slot, offered, index, engine)
        slot.history += turn.context_messages()
        if index is not None:
            slot.tried.count(str(action))
            action = agent.env_action(index, legal)
        observation, got, terminated, truncated, info = checked_step(env, action)
        if got != reward or terminated or truncated:
            raise ValueError("the env answers otherwise than it did")
        # A reward other than the step earns now (its progress is the env's to say; a
        # shaping plugin's part is not known here) is not trained on: the episode goes.
        earned = _learner_reward(turn, got, info, settings)
        if not settings.reward_shaping and turn.reward != earned:
            raise ValueError(f"turn {number}'s reward is not what its step earns now")
        slot.observation, slot.info = observation, info
    if slot.history != saved.history:
        raise NotItsReplay("its history is not the conversation its turns make")
    if episode.length != len(saved.steps) or episode.env_return != sum(saved.rewards):
        raise NotItsReplay("its length or env_return is not what its steps make")
    slot.episode, slot.history = episode, list(saved.history)
    slot.steps = [(index, action) for index, action in saved.steps]
    slot.rewards = list(saved.rewards)
    return slot


def _step_turns(turns: list[Turn], steps: int, trained_retries: int) -> list[Turn]:
    """The turn that made each of ``steps`` steps. An episode holds one turn per step;
    where failed attempts are trained on (up to ``trained_retries`` a step, the
    ``rollout.invalid_action.max_reprompts``), each step's come first, and are the
    step's turn's ``retries``."""
    finals = turns
    if trained_retries:
        finals, start = [], 0
        while start < len(turns):
            # the step's turn: the furthest one whose retries are the turns before it
            last = min(len(turns) - 1, start + trained_retries)
            end = next((end for end in range(last, start - 1, -1)
                        if turns[end].retries == turns[start:end]), None)
            if end is None:
                raise NotItsReplay(f"turn {start + 1} is neither a step's turn nor a retry")
            finals.append(turns[end])
            start = end + 1
    if len(finals) != steps:
        raise NotItsReplay(f"it holds the turns of {len(finals)} steps for its {steps} steps")
    return finals


def _learner_reward(turn: Turn, got: float, info: dict, settings: Any) -> float:
    """The reward the engine gives a turn whose step earned ``got`` with ``info``: the
    invalid reply's penalty (``apply_fallback``), then the env's reward and its progress
    (``Episodes._record_step``), added in their order."""
    reward = 0.0
    if not turn.valid:
        reward += settings.invalid_action.penalty
    reward += step_reward(got, info, settings.progress_reward)
    return reward


def _check_turn(
    number: int, turn: Turn, slot: Slot, offered: list[str], index: int | None,
    engine: Replayer,
) -> None:
    """``turn`` is the decision the engine makes at ``slot``: the actions it offers
    there, the step's action chosen among them, the prompt and user text it renders
    (for a re-prompted turn, each attempt's after the ones that failed), and its
    retries: attempts that failed there."""
    if index is not None:  # an action the agent names
        if turn.legal_actions != offered:
            raise NotItsReplay(f"turn {number}'s legal_actions are not those offered there")
        if turn.action_index is None or slot.tried.full_index(turn.action_index) != index:
            raise NotItsReplay(f"turn {number}'s action_index is not the action its step took")
    attempts = [*turn.retries, turn]
    for tried, attempt in enumerate(attempts):
        user_text, prompt = engine.decision_prompt(slot, turn.retries[:tried])
        if turn.user_text != user_text or attempt.prompt_tokens != prompt:
            raise NotItsReplay(f"turn {number}'s prompt is not the one its observation renders")
        if engine.settings.mode == "generate" and attempt.reply != engine.reply_text(
            slot, attempt.action_tokens
        ):
            raise NotItsReplay(f"turn {number}'s reply is not the text of its action_tokens")
    for retry in turn.retries:  # failed attempts, charged and told the legal actions
        if (retry.valid or retry.retries or retry.action_index is not None
                or retry.legal_actions != offered
                or retry.feedback != feedback_message(offered)
                or retry.reward != 0.0 + engine.settings.invalid_action.penalty):
            raise NotItsReplay(f"turn {number}'s retries are not failed attempts at it")
