"""The task an agent learns: its env, prompts, legal actions, parsing, options,
outcomes and baselines (:class:`Task`); no torch, no model. The parsers it reads a
reply with are :mod:`llamagym.task.reply_parsers`.

The rollout engine, the evaluation, the trainer and the export work with a ``Task``.
:class:`llamagym.Agent` is a ``Task`` that also acts (the classic ``act`` /
``assign_reward`` / ``terminate_episode``), through the policy and run of its session;
env plugins subclass ``Agent``.

Top level: a floor of its own; the rollout, the algorithms, training and the agent
all work with a Task, and it uses only the resolver and below.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from llamagym.config import RunConfig
from llamagym.errors import ConfigError, LlamaGymError
from llamagym.plugin_runtime.hook_values import RefusedAnswer, action_index_of
from llamagym.plugin_runtime.manager import Plugins, get_plugins
from llamagym.resolver.layers import Layer, ResolvedConfig, resolve_agent_config
from llamagym.task.reply_parsers import DEFAULT_PARSERS, OWN, PARSERS

logger = logging.getLogger(__name__)

Baseline = Callable[[Any, dict, Sequence[str], Any], str]
"""A baseline policy: ``(observation, info, legal_actions, rng) -> action name``."""

# Keys of the original LlamaGym's ``ppo_config_dict`` / ``generate_config_dict``, and
# where they live now.
_LEGACY_PPO_KEYS = {
    "batch_size": "episodes_per_update",
    "mini_batch_size": "minibatch_size",
    "learning_rate": "lr",
    "ppo_epochs": "epochs",
    "gamma": "gamma",
    "lam": "gae_lambda",
    "cliprange": "clip_range",
    "vf_coef": "value_coef",
    "init_kl_coef": "kl_coef",
    "target_kl": "target_kl",
    "max_grad_norm": "max_grad_norm",
}
_LEGACY_GENERATE_KEYS = {
    "max_new_tokens": "max_new_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "do_sample": None,  # always sampled when training, greedy when evaluating
}


__all__ = ["Baseline", "Task"]


class Task:
    """One kind of environment, as an LLM agent sees it. Subclasses (through
    :class:`llamagym.Agent`) say how to talk to it.

    To have evaluations count named outcomes (win / draw / loss), list them in
    ``outcome_names`` and override :meth:`outcome`; an agent that does neither is
    evaluated by its return alone, with no outcome column."""

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    env_id: ClassVar[str | None] = None
    env_kwargs: ClassVar[Mapping[str, Any]] = {}
    action_names: ClassVar[Sequence[str] | None] = None
    defaults: ClassVar[Mapping[str, Any]] = {}
    baselines: ClassVar[Mapping[str, Baseline]] = {}
    #: The baseline that plays this env best (a solver, an oracle, a bot), which
    #: ``--warm-start expert`` warm-starts from. None: the one baseline besides
    #: ``random``, when the agent has exactly one.
    expert_baseline: ClassVar[str | None] = None
    #: The outcomes :meth:`outcome` names, in the order evaluations show them (e.g.
    #: ``("win", "draw", "loss")``); empty: the agent names none.
    outcome_names: ClassVar[Sequence[str]] = ()
    #: How a reply is read in generate mode: these parsers in order, the first that
    #: names a legal action wins (:mod:`llamagym.task.reply_parsers`). ``"json"`` reads
    #: ``{"action": ...}`` or ``{"command": ...}``; ``"extract_action"`` is this class's
    #: own :meth:`extract_action`; ``"regex"`` the first word after an action label
    #: (``Action: hit``), else the last action name in the reply. A plugin's
    #: ``llamagym_extract_action`` is asked before them, or after them when it is
    #: marked ``trylast`` (:meth:`read_reply`).
    reply_parsers: ClassVar[Sequence[str]] = DEFAULT_PARSERS
    #: The checkpoint directory a trained agent was loaded from, and that checkpoint's
    #: metadata (:func:`llamagym.agent.load_agent`); None for an agent built otherwise.
    checkpoint: Path | None = None
    checkpoint_meta: dict[str, Any] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        parsers = cls.reply_parsers
        known = tuple(dict.fromkeys((*DEFAULT_PARSERS, OWN, *PARSERS)))
        if isinstance(parsers, str) or not all(name in known for name in parsers):
            raise LlamaGymError(
                f"{cls.__name__}.reply_parsers is {parsers!r}: give a tuple of parser "
                f"names, in the order they read a reply, from {', '.join(map(repr, known))}"
            )

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        device: Any = None,
        generate_config_dict: Mapping[str, Any] | None = None,
        ppo_config_dict: Mapping[str, Any] | None = None,
        *,
        env: Any = None,
        config: ResolvedConfig | RunConfig | Mapping[str, Any] | None = None,
        plugins: Plugins | None = None,
    ):
        self.plugins = plugins or get_plugins()
        #: The validated config and the settings objects made from it (one resolver).
        self.resolved = self._resolve_config(config, generate_config_dict, ppo_config_dict, model)
        self.config = self.resolved.config
        #: The agent's own options: an instance of its ``Config``, if it declares one.
        self.options = self.resolved.agent_options
        self.env = env
        self._model, self._tokenizer, self._device = model, tokenizer, device

    @property
    def device(self) -> Any:
        """The device the task was made with (the original API's third argument, or in
        a run of several processes each process's own), or None: ``model.device``.
        Read when the model loads."""
        return self._device

    @device.setter
    def device(self, value: Any) -> None:
        self._device = value

    # -- what subclasses override -----------------------------------------------------
    def get_system_prompt(self) -> str:
        return "You are an agent acting in an environment. Reply with the action to take."

    def format_observation(self, observation: Any) -> str:
        return str(observation)

    def extract_action(self, response: str) -> Any:
        """Return the action in ``response`` (an action index, or an action name), or None."""
        return None

    def episode_context(self, observation: Any, info: Mapping[str, Any]) -> str | None:
        """What holds for a whole episode, read from its first observation and info (a
        game's objective), or None. The engine adds it to that episode's system prompt,
        so it is said once, not in every turn, and a model that keeps each episode's
        key/value cache computes it once per episode. Default: None."""
        return None

    def reply_fields(self, observation: Any) -> Mapping[str, Any]:
        """Values a generate-mode ``rollout.reply_prefix`` can name as ``$name``: with
        ``{"sum": $sum, "action": "`` and ``{"sum": 15}`` here, the reply starts with
        ``{"sum": 15, "action": "``. A prefix that restates the part of the observation
        the choice depends on puts it right before the model's first reply token.
        Default: none (a prefix with no ``$`` needs none; ``$$`` is a dollar sign)."""
        return {}

    def outcome(self, episode_return: float, info: Mapping[str, Any]) -> str | None:
        """The named outcome of an episode that returned ``episode_return`` and whose last
        step gave ``info`` (the env's JSON-friendly values: TextWorld's ``won``): one of
        ``outcome_names``, or None for an episode that fits none of them.

        Evaluations (the trained agent's and every baseline's, at the end of a run and
        in ``llamagym eval``) show the share of episodes with each outcome beside the
        mean return, in ``outcome_names`` order; ``metrics.jsonl`` keeps the shares in
        each evaluation's ``outcomes``. Blackjack says ``win`` / ``draw`` / ``loss`` by
        the sign of the return; a maze might say ``goal`` for a return of 1 and
        ``no goal`` otherwise; TextWorld says ``won`` / ``lost`` by its game's state,
        which a return shaped by step penalties no longer tells. An override may take
        the return alone (``outcome(self, episode_return)``). The default names no
        outcome, and an agent that names none gets no outcome column: a return's sign
        means different things in different envs (a return of 0 is a draw in
        Blackjack, a hole in FrozenLake)."""
        return None

    def legal_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str] | None:
        """Names of the actions allowed now. Default: ``action_names``, else the env's
        ``admissible_commands``, else the indices of a ``Discrete`` action space (of the
        ``env=`` given), else None: the actions are not known.

        Not knowing them is how the original LlamaGym worked, and still works in
        generate mode: the model replies, ``extract_action`` turns the reply into the
        value given to ``env.step`` as it is, and that must be an action for every
        reply (an agent that cannot name its actions has no invalid-action fallback;
        ``None`` stops with an error that says so). Score mode ranks the legal actions,
        so it needs them named."""
        if self.action_names is not None:
            return self.action_names
        if "admissible_commands" in info:
            return info["admissible_commands"]
        space = getattr(self.env, "action_space", None)
        if space is not None and hasattr(space, "n"):
            return [str(i) for i in range(int(space.n))]
        return None

    def exploration_place(self, observation: Any, info: Mapping[str, Any]) -> Hashable | None:
        """Where the episode stands, for ``rollout.explore=least-tried``: two decisions
        at the same place with the same legal actions share their counts of what was
        tried. Default None: the observation's text (:meth:`format_observation`). An
        agent whose text changes where the choice does not (a game that echoes the last
        command) can name the place itself, e.g. the room a text game is in."""
        return None

    def named_actions(self, observation: Any, info: Mapping[str, Any]) -> Sequence[str]:
        """:meth:`legal_actions`, for what needs the actions named (score mode,
        baselines, checks): an agent that names none is told how to."""
        names = self.legal_actions(observation, info)
        if names is None:
            raise LlamaGymError(
                f"{type(self).__name__} does not know its legal actions: set "
                "action_names = [...] on the class, pass env=..., or override legal_actions()"
            )
        return names

    def env_action(self, index: int, legal_actions: Sequence[str]) -> Any:
        """The value passed to ``env.step`` for the chosen legal action."""
        if self.action_names is not None or legal_actions == [
            str(i) for i in range(len(legal_actions))
        ]:
            return index  # a Discrete space: actions are numbered in order
        return legal_actions[index]

    def make_env(self) -> Any:
        """A new environment for this agent (default: ``gymnasium.make(env_id)``)."""
        import gymnasium

        if self.env_id is None:
            raise LlamaGymError(f"{type(self).__name__} sets no env_id; override make_env()")
        self.plugins.register_envs()
        return gymnasium.make(self.env_id, **self.env_kwargs)

    # -- how the engine talks to the subclass -------------------------------------------
    def observation_text(self, observation: Any, info: dict) -> str:
        if _takes_info(type(self).format_observation):
            return self.format_observation(observation, info)  # type: ignore[call-arg]
        return self.format_observation(observation)

    def read_reply(
        self, reply: str, legal_actions: Sequence[str]
    ) -> tuple[int | None, str | None]:
        """The index of the legal action ``reply`` names, and what found it: the plugins'
        ``llamagym_extract_action``, then :attr:`reply_parsers` in order
        (:meth:`parse_reply`), then the plugins' marked ``trylast`` (fallbacks). ``(None,
        None)`` when nothing names a legal action: the run's invalid-reply policy
        applies. The parser is a name of :attr:`reply_parsers` or a plugin's name."""
        return self.plugins.read_reply(self, reply, legal_actions)

    def parse_reply(
        self, reply: str, legal_actions: Sequence[str]
    ) -> tuple[int | None, str | None]:
        """This task's own parsers alone (:attr:`reply_parsers`, in order): the index the
        first of them finds and its name, or ``(None, None)``. An ``extract_action``
        that raises is reported once (:meth:`Plugins.agent_method_failed`) and the next parser
        reads the reply."""
        for name in self.reply_parsers:
            if name == OWN:
                try:
                    index = self.action_index(self.extract_action(reply), legal_actions)
                except Exception as error:  # one agent's bug never ends the run
                    self.plugins.agent_method_failed(self, "extract_action", error)
                    continue
            else:
                index = PARSERS[name](reply, legal_actions)
            if index is not None:
                return index, name
        return None, None

    def action_index(self, value: Any, legal_actions: Sequence[str]) -> int | None:
        """Map what ``extract_action`` returned to an index into ``legal_actions``: an
        integer (Python or numpy) in range, an integral float, or an action name
        (case-insensitive); anything else is ``None``. ``legal_actions`` is the tuple
        every parser is handed: read it, never change it."""
        try:
            return action_index_of(value, legal_actions)
        except RefusedAnswer:
            return None

    # -- configuration -------------------------------------------------------------
    def _resolve_config(
        self,
        config: ResolvedConfig | RunConfig | Mapping[str, Any] | None,
        generate_config: Mapping[str, Any] | None,
        ppo_config: Mapping[str, Any] | None,
        model: Any = None,
    ) -> ResolvedConfig:
        legacy: dict[str, Any] = {}
        for key, value in (generate_config or {}).items():
            if key not in _LEGACY_GENERATE_KEYS:
                raise ConfigError(
                    f"generate_config_dict key {key!r} is not supported; "
                    f"allowed: {', '.join(_LEGACY_GENERATE_KEYS)}"
                )
            if _LEGACY_GENERATE_KEYS[key]:
                legacy.setdefault("rollout", {})[_LEGACY_GENERATE_KEYS[key]] = value
        for key, value in (ppo_config or {}).items():
            if key not in _LEGACY_PPO_KEYS:
                raise ConfigError(
                    f"ppo_config_dict key {key!r} is not supported; "
                    f"allowed: {', '.join(_LEGACY_PPO_KEYS)}"
                )
            legacy.setdefault("algorithm", {})[_LEGACY_PPO_KEYS[key]] = value
        if isinstance(config, ResolvedConfig) and not legacy:
            return config
        later: list[Layer] = [("generate_config_dict/ppo_config_dict", legacy)]
        if isinstance(config, (ResolvedConfig, RunConfig)):
            # A whole config stands in for the defaults, as a checkpoint's does.
            whole = config.config if isinstance(config, ResolvedConfig) else config
            return resolve_agent_config(
                type(self), later, base=whole.model_dump(mode="json"), plugins=self.plugins
            )
        return resolve_agent_config(
            type(self), [("config", dict(config or {})), *later], model=model,
            plugins=self.plugins,
        )


@functools.cache
def _takes_info(method: Callable) -> bool:
    parameters = list(inspect.signature(method).parameters.values())[1:]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.name == "info" for p in parameters)
