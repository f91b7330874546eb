"""Episodes in progress: a :class:`Slot` for one environment's episode, a
:class:`Lockstep`, a collection's environments and the slot each of them plays, and
:class:`Episodes`, the rollout engine's part that starts, steps and finishes them."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from llamagym.config import RolloutSettings
from llamagym.rollout.env_checks import checked_reset, checked_step, max_turns, step_reward
from llamagym.rollout.env_failures import EnvFailures
from llamagym.rollout.exploration import Tried
from llamagym.rollout.rollout_policy import RolloutPolicy
from llamagym.rollout.trajectory import Episode, Turn, info_summary

if TYPE_CHECKING:
    from llamagym.task import Task

#: Each slot's key, naming its episode to the policy's turn cache.
_slot_keys = itertools.count()


@dataclass
class Slot:
    """One environment's episode in progress. ``key`` names it to the policy, which
    keeps the slot's last turn's key/value cache under it (``Policy.turn_cache``) until
    the engine drops it (:meth:`Episodes.end_slot`)."""

    observation: Any
    info: dict
    episode: Episode
    history: list[dict[str, str]] = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_slot_keys))
    #: each env step so far: the legal action's index and name, or (None, the value
    #: given to ``env.step``) for an agent that names no actions; and the env's reward
    #: for it. A saved episode in progress is replayed from them (``rollout.carried``).
    steps: list[tuple[int | None, Any]] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    #: what the episode tried where (``rollout.explore``)
    tried: Tried = field(default_factory=Tried)

    @property
    def system_prompt(self) -> str:
        """The system prompt the episode is played with (its episode's)."""
        return self.episode.system_prompt


@dataclass
class Lockstep:
    """A collection's envs (:meth:`RolloutEngine.collect`): env ``p`` plays the episode
    in ``slots[p]`` (None once no episode is left to start).

    With ``num_episodes`` set, the collection starts that many episodes, seeded by
    ``seeds``, and ends when they have finished. An open lockstep (``num_episodes``
    None) never runs out: an env whose episode ends starts the next at once, with a seed
    drawn as it starts, and the lockstep outlives the collection that opened it
    (:meth:`RolloutEngine.play` with ``carry``)."""

    envs: list[Any]
    seeds: Sequence[int] | None
    num_episodes: int | None
    group_size: int
    on_episode: Callable[[Episode], None] | None
    slots: list[Slot | None]
    #: the turns an episode of each env may last (read again when an env is replaced)
    turn_caps: list[int]
    #: the episodes finished so far, in the order they ended
    finished: list[Episode] = field(default_factory=list)
    #: the index of the next episode to start
    next_episode: int = 0
    #: stamped on every turn played (:attr:`Turn.policy_version`): the number of
    #: updates the weights that played it had seen
    policy_version: int = 0
    #: the episodes the current collection returns (None: all); ``on_episode`` hears of
    #: those, and of the others when the next collection hands them out
    wanted: int | None = None

    def active(self) -> list[tuple[int, Slot]]:
        """The envs with an episode in progress, and their slots."""
        return [(position, slot) for position, slot in enumerate(self.slots) if slot is not None]

    def returns_latest(self) -> bool:
        """Whether the episode that finished last is one the current collection returns
        (its ``on_episode`` hears of it now)."""
        return self.wanted is None or len(self.finished) <= self.wanted

    def has_more(self) -> bool:
        """Whether an episode is still due to start."""
        return self.num_episodes is None or self.next_episode < self.num_episodes


@dataclass
class RolloutStats:
    env_steps: int = 0
    #: decisions made, and the batched passes they were made in (their ratio is the
    #: rows a forward holds on average)
    decisions: int = 0
    batched_decisions: int = 0
    env_failures: int = 0
    seconds_model: float = 0.0
    seconds_total: float = 0.0


class Episodes:
    """The rollout engine's episodes in progress: each env's :class:`Slot` started (its
    env reset, with the system prompt ``system_prompt(observation, info)`` gives),
    stepped with its turn's action, finished (the ``llamagym_episode_end`` hook unless
    ``observe`` is off, the lockstep's ``on_episode``) or dropped.

    It holds what that takes: the ``agent`` (its env actions, its plugins' reward
    shaping), the rollout ``settings``, the ``policy`` (told when an episode's turn
    cache can go), the ``stats`` it counts env steps in, the env ``failures``, and
    ``draw_seed``, which draws an open lockstep's next seed from the engine's stream.
    """

    def __init__(
        self,
        agent: Task,
        settings: RolloutSettings,
        policy: RolloutPolicy,
        stats: RolloutStats,
        failures: EnvFailures,
        *,
        system_prompt: Callable[[Any, dict], str],
        draw_seed: Callable[[], int],
        observe: bool = True,
    ):
        self.agent = agent
        self.plugins = agent.plugins
        self.settings = settings
        self.policy = policy
        self.stats = stats
        self.failures = failures
        self.system_prompt = system_prompt
        self.draw_seed = draw_seed
        self.observe = observe

    def new_slot(self, observation: Any, info: dict, seed: int | None, group: int | None) -> Slot:
        """A slot for an episode that starts at ``observation`` (reset with ``seed``; its
        seed group ``group``)."""
        system_prompt = self.system_prompt(observation, info)
        episode = Episode(seed=seed, group=group, system_prompt=system_prompt)
        return Slot(observation=observation, info=info, episode=episode)

    def end_slot(self, slot: Slot) -> None:
        """The slot's episode is over (ended, dropped, or abandoned): the policy forgets
        the key/value cache it kept for it."""
        drop = getattr(self.policy, "drop_turn_cache", None)
        if drop is not None:
            drop(slot.key)

    def open(
        self, envs: list[Any], seeds: Sequence[int] | None, num_episodes: int | None,
        group_size: int,
    ) -> Lockstep:
        """A lockstep over ``envs`` (open when ``num_episodes`` is None), an episode
        started in every env."""
        lockstep = Lockstep(
            envs, seeds, num_episodes, group_size, None,
            slots=[None] * len(envs),
            turn_caps=[max_turns(env, self.settings.max_episode_turns) for env in envs],
        )
        for position in range(len(envs)):
            self.start(lockstep, position)
        return lockstep

    def start(self, lockstep: Lockstep, position: int) -> None:
        """Reset env ``position`` for the next episode due, or leave it idle if none is."""
        while lockstep.has_more():
            k = lockstep.next_episode
            lockstep.next_episode += 1
            seeds = lockstep.seeds
            seed = self.draw_seed() if seeds is None else seeds[k]
            try:
                observation, info = checked_reset(lockstep.envs[position], seed)
            except Exception as error:  # an env that raises must not end the run
                self._replace_env(lockstep, position, error)
                continue
            lockstep.slots[position] = self.new_slot(
                observation, info, seed, k // lockstep.group_size
            )
            return
        lockstep.slots[position] = None

    def play_turn(self, lockstep: Lockstep, position: int, slot: Slot, turn: Turn) -> None:
        """Carry out one env's turn: step the env with its action, or end the episode."""
        episode = slot.episode
        if turn.ends_episode:
            # The end-episode policy: the env is not stepped; the penalty is the turn's
            # only reward and the env is reset for the next episode.
            episode.turns += turn.training_turns(self.settings.invalid_action.train_on_reprompts)
            episode.length += 1
            ended = {"terminated": False, "ended_by_invalid_reply": True}
            self._finish_episode(lockstep, position, slot, ended)
            return
        # The chosen action's name, and what the env is stepped with: the agent's, or
        # for an agent that names no actions, extract_action's value as it is.
        index = turn.action_index
        if index is None:
            action_name, env_action = str(turn.env_action), turn.env_action
        else:  # stepped as the action's place among all the legal actions
            action_name, index = turn.legal_actions[index], slot.tried.full_index(index)
            env_action = self.agent.env_action(index, slot.tried.all_legal(turn.legal_actions))
        try:
            observation, reward, terminated, truncated, info = checked_step(
                lockstep.envs[position], env_action
            )
        except Exception as error:
            # Whatever went wrong (it raised, the old 4-tuple API, a reward that is not
            # a finite number), the partial episode is dropped, never trained on nor
            # averaged into a return.
            self.end_slot(slot)
            self._replace_env(lockstep, position, error)
            self.start(lockstep, position)
            return
        slot.tried.count(action_name)
        self._record_step(slot, turn, action_name, observation, reward, info)
        slot.steps.append((index, env_action if index is None else action_name))
        slot.rewards.append(reward)
        turn_cap = lockstep.turn_caps[position]
        if terminated or truncated:
            summary = {**info_summary(info), "terminated": terminated}
            self._finish_episode(lockstep, position, slot, summary)
        elif episode.length >= turn_cap:
            # An env that never ends (or sets no limit) is cut here: truncated.
            summary = {**info_summary(info), "terminated": False, "turn_cap": turn_cap}
            self._finish_episode(lockstep, position, slot, summary)

    def _record_step(
        self, slot: Slot, turn: Turn, action_name: str, observation: Any, reward: float,
        info: dict,
    ) -> None:
        """Add a stepped turn to the slot: its episode's rewards and turns, the history."""
        self.failures.succeeded()
        self.stats.env_steps += 1
        shaped = step_reward(reward, info, self.settings.progress_reward)
        if self.settings.reward_shaping:
            shaped += self.plugins.shape_reward(
                self.agent, slot.observation, action_name, reward, info
            )
        turn.reward += shaped
        episode = slot.episode
        episode.turns += turn.training_turns(self.settings.invalid_action.train_on_reprompts)
        episode.env_return += reward
        episode.length += 1
        slot.history += turn.context_messages()
        slot.observation, slot.info = observation, info

    def _finish_episode(
        self, lockstep: Lockstep, position: int, slot: Slot, summary: dict
    ) -> None:
        """Hand out a finished episode (hooks, ``on_episode``), then start the env's next."""
        self.end_slot(slot)
        episode = slot.episode
        episode.info = summary
        lockstep.finished.append(episode)
        if self.observe:
            self.plugins.episode_end(self.agent, episode)
        if lockstep.on_episode is not None and lockstep.returns_latest():
            lockstep.on_episode(episode)
        self.start(lockstep, position)

    def _replace_env(self, lockstep: Lockstep, position: int, error: Exception) -> None:
        """Count env ``position``'s failure and replace the env (:class:`EnvFailures`)."""
        self.failures.replace(lockstep.envs, position, error)
        lockstep.turn_caps[position] = max_turns(
            lockstep.envs[position], self.settings.max_episode_turns
        )

    def abandon(self, lockstep: Lockstep) -> None:
        """End the episodes still in progress (a stop, an error): their caches go."""
        for abandoned in lockstep.slots:
            if abandoned is not None:
                self.end_slot(abandoned)
