"""The classic loop's machinery: what an :class:`~llamagym.Agent` acts with.

The Agent is a task (:class:`~llamagym.task.Task`: env, prompts, actions, parsing,
options) that acts. Its session holds what
``act`` / ``assign_reward`` / ``terminate_episode`` need on top: the policy (loaded on
first use), the run built over it (:func:`llamagym.run.build_run`: engine, algorithm,
schedule), the episode being played and the episodes waiting for an update.

    agent = BlackjackAgent(model, tokenizer, device)
    action = agent.act(observation)      # agent.session.act: one engine step

Top level: the classic loop is a floor of its own, between the agent that owns
a session and the run it builds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym import moved_name as _moved_name
from llamagym.errors import LlamaGymError
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.slots import Slot
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.run import build_run, load_policy
from llamagym.schedule import Control, Schedule
from llamagym.training.loop.run_state import Run, make_engine

if TYPE_CHECKING:
    from llamagym.task import Task

__all__ = ["Session"]


class Session:
    """One task's policy, run and open episode, each built on first use. It is the
    :class:`~llamagym.training.loop.run_state.RunParts` a trainer builds its run with."""

    def __init__(self, task: Task, model: Any = None, tokenizer: Any = None):
        self.task = task
        #: What the classic API's constructor was given: objects, a name, or None.
        self._model, self._tokenizer = model, tokenizer
        self._policy: Any = None
        self._run: Run | None = None
        self._slot: Slot | None = None
        self._pending_turn: Turn | None = None
        self._finished: list[Episode] = []

    @property
    def policy(self) -> Any:
        if self._policy is None:
            config, device = self.task.config, self.task.device
            self._policy = load_policy(config, self._model, self._tokenizer, device)
        return self._policy

    def use_policy(self, policy: Any) -> None:
        self._policy, self._run = policy, None

    @property
    def run(self) -> Run:
        if self._run is None:
            return self.start_run()
        return self._run

    def start_run(
        self, control: Control | None = None, demonstrations: Path | None = None
    ) -> Run:
        self._run = build_run(self.task, self.policy, control, demonstrations)
        return self._run

    def evaluation_engine(self, num_envs: int | None = None) -> RolloutEngine:
        config = self.task.config
        schedule = self._run.schedule if self._run is not None else Schedule(config.rollout)
        return make_engine(
            self.task, self.policy, config, schedule, num_envs=num_envs, observe=False
        )

    # -- the classic loop ---------------------------------------------------------------
    def act(self, observation: Any, info: dict | None = None) -> Any:
        engine = self.run.engine
        slot = self._slot
        if slot is None:
            slot = self._slot = engine.new_slot(observation, dict(info or {}), None, None)
        elif self._pending_turn is not None:
            self._commit_turn(slot, self._pending_turn)
        slot.observation, slot.info = observation, dict(info or {})
        turn = engine.decide([slot])[0]
        self._pending_turn = turn
        if turn.action_index is None:  # actions not named: extract_action's value as it is
            return turn.env_action
        # The env takes the action's place among all the legal actions (rollout.explore
        # may have offered fewer).
        index = slot.tried.full_index(turn.action_index)
        return self.task.env_action(index, slot.tried.all_legal(turn.legal_actions))

    def assign_reward(self, reward: float) -> None:
        slot = self._slot
        # A pending turn always belongs to the open episode (act() opens it first).
        if slot is None or (self._pending_turn is None and not slot.episode.turns):
            raise LlamaGymError("assign_reward() was called before act(): nothing to reward")
        turn = self._pending_turn or slot.episode.turns[-1]
        turn.reward += float(reward)
        slot.episode.env_return += float(reward)

    def terminate_episode(self) -> dict[str, float]:
        slot = self._slot
        if slot is None:
            return {}
        if self._pending_turn is not None:
            self._commit_turn(slot, self._pending_turn)
        episode = slot.episode
        self._slot = None
        self.run.engine.end_slot(slot)
        if not episode.turns:
            return {}
        self._finished.append(episode)
        self.task.plugins.episode_end(self.task, episode)
        algorithm = self.run.algorithm
        if len(self._finished) < algorithm.episodes_per_update:
            return {}
        batch, self._finished = self._finished, []
        return algorithm.update(batch)

    def _commit_turn(self, slot: Slot, turn: Turn) -> None:
        """Add the pending ``turn`` to ``slot``'s episode and conversation."""
        self._pending_turn = None
        include_retries = self.task.config.rollout.invalid_action.train_on_reprompts
        if turn.action_index is not None:
            slot.tried.count(turn.legal_actions[turn.action_index])
        slot.episode.turns += turn.training_turns(include_retries)
        slot.episode.length += 1
        slot.history += turn.context_messages()


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
