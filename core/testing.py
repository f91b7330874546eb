"""Helpers for testing agents and plugins (also a pytest plugin: ``llamagym.testing``).

* :class:`TwoArmedBandit` / :class:`BanditAgent`: the smallest task that shows learning;
* :func:`temporary_plugin`: register a throwaway plugin in-process, removed afterwards;
* :func:`tiny_agent`: an agent on the offline tiny model with small, fast settings.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import gymnasium
import numpy as np

from llamagym.agent import Agent
from llamagym.config import build_config, deep_merge
from llamagym.plugin_manager import get_plugins


class TwoArmedBandit(gymnasium.Env):
    """One-step episodes: lever ``right`` pays 1 with probability 0.8, ``left`` 0.2."""

    observation_space = gymnasium.spaces.Discrete(1)
    action_space = gymnasium.spaces.Discrete(2)
    payout = (0.2, 0.8)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        return 0, {}

    def step(self, action: int):
        reward = float(self.np_random.random() < self.payout[int(action)])
        return 0, reward, True, False, {}


class BanditAgent(Agent):
    name = "bandit"
    action_names = ("left", "right")
    baselines = {"left": lambda *_: "left", "right": lambda *_: "right"}

    def get_system_prompt(self) -> str:
        return "Pull one lever: left or right."

    def format_observation(self, observation: Any) -> str:
        return "Which lever?"

    def make_env(self) -> TwoArmedBandit:
        return TwoArmedBandit()


FAST_SETTINGS: Mapping[str, Any] = {
    "rollout": {"num_envs": 8, "mode": "score"},
    "algorithm": {"episodes_per_update": 16, "minibatch_size": 16, "epochs": 2},
    "training": {"episodes": 32, "eval_episodes": 0},
}


def tiny_agent(agent_class: type[Agent] = BanditAgent, **overrides: Any) -> Agent:
    """An agent on the tiny model with settings small enough for a unit test."""
    layers = deep_merge(deep_merge(dict(agent_class.defaults), dict(FAST_SETTINGS)), overrides)
    config = build_config({"agent": {"name": agent_class.name}}, layers)
    return agent_class(config=config)


@contextlib.contextmanager
def temporary_plugin(plugin: Any, name: str = "temporary-plugin") -> Iterator[Any]:
    """Register ``plugin`` in this process for the duration of the ``with`` block."""
    plugins = get_plugins()
    if not plugins.register(plugin, name=name, distribution="(in-process)"):
        raise RuntimeError(f"plugin {name!r} was refused: {plugins.problems[-1]}")
    try:
        yield plugins
    finally:
        plugins.unregister(name)


def action_probabilities(agent: Agent, observation: Any, info: dict | None = None) -> np.ndarray:
    """Score-mode probabilities of every legal action for one observation."""
    import torch

    engine = agent.engine
    slot = engine.new_slot(observation, dict(info or {}), None, None)
    _, prompts = engine.render_prompts([slot])
    legal = list(agent.legal_actions(observation, slot.info))
    candidates = [[engine.candidate_tokens(name) for name in legal]]
    with torch.no_grad():
        scores, _ = agent.policy.score(prompts, candidates)
    return (scores / agent.config.rollout.temperature).softmax(-1)[0].cpu().numpy()
