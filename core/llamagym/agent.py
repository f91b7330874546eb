"""The LlamaGym ``Agent``: subclass it, say how to prompt, then ``act`` in your own loop.

    class BlackjackAgent(Agent):
        action_names = ["stick", "hit"]
        def get_system_prompt(self): ...
        def format_observation(self, observation): ...
        def extract_action(self, response): ...      # optional

    agent = BlackjackAgent(model, tokenizer, device)   # or BlackjackAgent() for tiny
    action = agent.act(observation); agent.assign_reward(reward)
    stats = agent.terminate_episode()                  # trains when a batch is full

An ``Agent`` is a :class:`~llamagym.task.Task` (the env, prompts, actions, parsing,
options) that acts: its session holds the policy and the run. Env plugins register
subclasses that also declare ``env_id``, ``defaults`` and ``baselines``; ``llamagym run``
then drives many envs at once through the same engine.

Top level: a floor of its own, the classic API's class; the tools for authors and
the CLI build on it, and nothing below may reach up to it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llamagym import moved_name as _moved_name
from llamagym.plugin_runtime.manager import Plugins, get_plugins
from llamagym.task import Task

if TYPE_CHECKING:
    from llamagym.algorithms.algorithm import Algorithm
    from llamagym.rollout.engine import RolloutEngine
    from llamagym.schedule import Control
    from llamagym.session import Session
    from llamagym.training.loop.run_state import Run

__all__ = ["Agent", "load_agent"]


class Agent(Task):
    """An LLM agent for one kind of environment: the task, and the classic loop on it.
    Subclasses say how to talk to the environment (see :class:`~llamagym.task.Task`)."""

    _session: Session | None = None

    # -- the classic loop, through the agent's session ---------------------------------
    @property
    def session(self) -> Session:
        """The policy, run and open episode this agent acts with (:mod:`llamagym.session`),
        made on first use: the one way from an agent to the machinery."""
        if self._session is None:
            from llamagym.session import Session

            self._session = Session(self, self._model, self._tokenizer)
        return self._session

    def act(self, observation: Any, info: dict | None = None) -> Any:
        """Choose an action for ``observation`` (always a legal one)."""
        return self.session.act(observation, info)

    def assign_reward(self, reward: float) -> None:
        """Credit ``reward`` to the latest action."""
        self.session.assign_reward(reward)

    def terminate_episode(self) -> dict[str, float]:
        """End the episode; train when ``episodes_per_update`` episodes are stored.

        Returns the update's metrics, or an empty dict when no update ran.
        """
        return self.session.terminate_episode()

    @property
    def policy(self) -> Any:
        """The policy (model, tokenizer, value head), loaded on first use."""
        return self.session.policy

    def use_policy(self, policy: Any) -> None:
        """Act with ``policy`` from now on (e.g. a scripted stand-in in tests)."""
        self.session.use_policy(policy)

    @property
    def run(self) -> Run:
        """The run this agent acts in (:func:`llamagym.run.build_run`), built on first use."""
        return self.session.run

    def start_run(self, control: Control | None = None) -> Run:
        """A new run on this agent's policy (the trainer passes its ``control``)."""
        return self.session.start_run(control)

    def evaluation_engine(self, num_envs: int | None = None) -> RolloutEngine:
        """An engine of its own for evaluation: its episodes reach no training observer
        and draw nothing from the training engine's random streams. It needs no run, so
        evaluating never builds an algorithm (no warm start: evaluating never trains);
        it samples at the run's current temperature when there is a run."""
        return self.session.evaluation_engine(num_envs)

    @property
    def engine(self) -> RolloutEngine:
        return self.session.run.engine

    @property
    def algorithm(self) -> Algorithm:
        return self.session.run.algorithm


def load_agent(
    path: Path | str,
    *,
    overrides: Mapping[str, Any] | None = None,
    agent: str | None = None,
    plugins: Plugins | None = None,
    trust_remote_code: bool = False,
) -> Agent:
    """A trained agent, ready to ``act``: ``path`` is a run directory (its newest intact
    checkpoint; a damaged newer one is skipped with a warning), one checkpoint, or an
    export. The agent class comes from the registry (the plugin that trained it must be
    installed), the config from the checkpoint with ``overrides`` over it, and the
    weights from the checkpoint. ``agent`` checks the checkpoint's agent name.

    A checkpoint is data: its ``model.trust_remote_code`` is never used. Only
    ``trust_remote_code=True`` (or an override setting it) lets the model run code of
    its own, with a warning naming the model; without it, a checkpoint naming a local
    model directory that maps classes to its own Python code is refused
    (:func:`llamagym.run.read_trained`)."""
    from llamagym.run import load_trained_weights, read_trained  # torch: loading only

    plugins = plugins or get_plugins()
    trained = read_trained(
        path, overrides=overrides, agent=agent, plugins=plugins,
        trust_remote_code=trust_remote_code,
    )
    loaded: Agent = trained.agent_class(config=trained.resolved, plugins=plugins)
    load_trained_weights(loaded.policy, trained)
    loaded.checkpoint = trained.directory
    loaded.checkpoint_meta = trained.meta
    return loaded


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
