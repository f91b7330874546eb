"""Evaluation: the trained agent and its baselines on the same episode seeds."""

from __future__ import annotations

import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from llamagym.errors import EnvFailureError, LlamaGymError
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.env_checks import checked_reset, checked_step, max_turns
from llamagym.rollout.trajectory import Episode, info_summary

logger = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003  # evaluation episodes never reuse training seeds

Progress = Callable[[int, int], None]
"""Told ``(episodes finished, episodes in all)`` as an evaluation goes on."""


@dataclass
class EvalResult:
    name: str
    episodes: int
    mean: float
    ci95: float
    invalid_rate: float = 0.0
    #: Share of the episodes with each of the agent's named outcomes, in the agent's
    #: ``outcome_names`` order; empty for an agent that names none.
    outcomes: dict[str, float] = field(default_factory=dict)
    #: How many different episodes were played (same observations, actions and
    #: rewards count as one); None when not counted.
    distinct_episodes: int | None = None

    @property
    def identical(self) -> bool:
        """Every one of several episodes was the same episode: the 95% CI is then no
        estimate of anything (a deterministic env that ignores the seed, played greedily)."""
        return episodes_identical(self.episodes, self.distinct_episodes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def episodes_identical(episodes: int, distinct_episodes: int | None) -> bool:
    """More than one episode, and all of them the same one."""
    return episodes > 1 and distinct_episodes == 1


def outcome_reader(agent: Any) -> Callable[[float, Mapping[str, Any]], str | None]:
    """``agent.outcome`` as a function of an episode's return and last ``info``; an
    override that takes the return alone (as the method first did) is given it alone."""
    method = agent.outcome
    try:
        parameters = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: give it both
        return method
    takes_info = len(parameters) >= 2 or any(
        p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters
    )
    return method if takes_info else lambda episode_return, info: method(episode_return)


def outcome_shares(
    agent: Any, returns: Sequence[float], infos: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, float]:
    """The share of episodes (their ``returns`` and last ``infos``, ``{}`` each if not
    given) with each outcome the agent names (:meth:`llamagym.Agent.outcome`), in its
    ``outcome_names`` order: ``{}`` for an agent that names none. An outcome missing
    from ``outcome_names`` is an error that says so."""
    if agent is None:
        return {}
    names = list(getattr(agent, "outcome_names", ()) or ())
    if infos is None:
        infos = [{}] * len(returns)
    outcome = outcome_reader(agent)
    found: dict[str, int] = {}
    for value, info in zip(returns, infos, strict=True):
        label = outcome(float(value), info)
        if label is None:
            continue
        if label not in names:
            raise LlamaGymError(
                f"{type(agent).__name__}.outcome({float(value)!r}) returned {label!r}, "
                f"which is not in its outcome_names ({', '.join(map(repr, names)) or 'empty'}): "
                "list every outcome there, in the order evaluations should show them"
            )
        found[label] = found.get(label, 0) + 1
    if not names:
        return {}
    total = len(returns) or 1
    return {name: found.get(name, 0) / total for name in names}


def summarise(
    name: str,
    returns: Sequence[float],
    invalid_rate: float = 0.0,
    *,
    agent: Any = None,
    infos: Sequence[Mapping[str, Any]] | None = None,
    distinct_episodes: int | None = None,
) -> EvalResult:
    """Mean return with its 95% CI, and the share of each outcome ``agent`` names (from
    the returns and each episode's last ``infos``)."""
    values = np.asarray(returns, dtype=float)
    n = len(values)
    mean = float(values.mean()) if n else float("nan")
    ci95 = float(1.96 * values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")
    outcomes = outcome_shares(agent, returns, infos) if n else {}
    return EvalResult(name, n, mean, ci95, invalid_rate, outcomes, distinct_episodes)


def _episode_key(episode: Episode) -> int:
    """What makes two played episodes the same: what the model read, what it did, and
    what came of it, turn by turn."""
    turns = tuple((t.user_text, t.action_index, t.reply, t.reward) for t in episode.turns)
    return hash((episode.env_return, episode.length, turns))


def _observation_key(observation: Any) -> Any:
    """An observation as something hashable that tells different ones apart (a large
    array's repr elides its middle; its bytes do not)."""
    if isinstance(observation, np.ndarray):
        return (observation.shape, observation.dtype.str, observation.tobytes())
    return repr(observation)


def warn_if_identical(result: EvalResult, greedy: bool) -> None:
    """One warning when every evaluation episode was the same one."""
    if not result.identical:
        return
    how = (
        "greedy actions in deterministic dynamics then repeat one episode"
        if greedy
        else "the sampled actions did not differ either"
    )
    logger.warning(
        "all %d evaluation episodes were the same episode (same observations, actions "
        "and rewards), so their 95%% CI is not an estimate: the environment starts from "
        "the same state whatever the seed, and %s. Evaluate one episode "
        "(training.eval_episodes=1, llamagym eval -n 1), or make the environment's "
        "reset(seed=...) choose its start state from the seed",
        result.episodes,
        how,
    )


def evaluation_seeds(seed: int, episodes: int) -> list[int]:
    return [EVAL_SEED_OFFSET + seed * 100_003 + k for k in range(episodes)]


def evaluate_agent(
    engine: RolloutEngine,
    episodes: int,
    seed: int = 0,
    greedy: bool = True,
    examples: list[Episode] | None = None,
    on_progress: Progress | None = None,
    seconds: float | None = None,
) -> EvalResult:
    """Run the policy of ``engine`` (greedy by default) on ``episodes`` seeded episodes.
    The engine is the evaluation's own (``make_engine(..., observe=False)``, or an
    agent's ``evaluation_engine()``), closed at the end: these episodes reach no
    training observer (``episode_end``) and leave the training engine's random streams
    where they were. ``examples``, when
    given, receives the episodes played (in seed order), e.g. for transcripts;
    ``on_progress`` is told ``(finished, episodes)`` at the start and after each episode.
    With ``seconds``, the evaluation stops after that long with the episodes finished
    (a warning says how many); each episode lasts at most the engine's turn cap.

    Outcomes are the agent's own (:meth:`llamagym.Agent.outcome`). When every episode
    turns out the same, one warning says why and how to fix it, and the result's
    ``identical`` is true."""
    agent = engine.agent
    policy: Any = engine.policy  # a model's (train / eval); the protocol names neither
    was_training = policy.training
    policy.eval()
    try:
        on_episode = None
        if on_progress is not None:
            on_progress(0, episodes)
            done = 0

            def on_episode(_: Episode) -> None:
                nonlocal done
                done += 1
                on_progress(done, episodes)

        deadline = None if seconds is None else time.monotonic() + seconds
        with torch.no_grad(), engine.greedy_memo():
            finished: list[Episode] = engine.play(
                episodes,
                greedy=greedy,
                seeds=evaluation_seeds(seed, episodes),
                on_episode=on_episode,
                should_stop=None if deadline is None else lambda: time.monotonic() > deadline,
            )
    finally:
        policy.train(was_training)
        engine.close()
    if len(finished) < episodes:
        logger.warning(
            "the evaluation's time budget (%.0f s, training.minutes) ran out after %d of %d "
            "episodes; the results (and the baselines', on the same episodes) are over those",
            seconds,
            len(finished),
            episodes,
        )

    turns = sum(len(e.turns) for e in finished)
    invalid = sum(e.invalid_replies for e in finished) / max(1, turns)
    if examples is not None:
        examples += finished
    result = summarise(
        "agent",
        [e.env_return for e in finished],
        invalid,
        agent=agent,
        infos=[e.info for e in finished],
        distinct_episodes=len({_episode_key(e) for e in finished}),
    )
    warn_if_identical(result, greedy)
    return result


@dataclass
class BaselineStep:
    """One decision of a baseline: what it saw, what it chose, what came of it."""

    episode: int  # index of the episode among those played
    observation: Any
    info: dict
    action: str
    reward: float
    done: bool
    next_info: dict  # the info the step gave (the episode's last, when ``done``)


def play_baseline(
    agent: Any, name: str, seeds: Sequence[int], rng_seed: int = 0
) -> Iterator[BaselineStep]:
    """Play one of the agent's baseline policies, one episode per seed, step by step
    (``rng_seed`` seeds the baseline's own randomness, e.g. the random policy's)."""
    baseline = agent.baselines[name]
    rng = np.random.default_rng(rng_seed)
    env = agent.make_env()
    turn_cap = max_turns(env, agent.config.rollout.max_episode_turns)
    try:
        for index, episode_seed in enumerate(seeds):
            try:
                observation, info = checked_reset(env, episode_seed)
            except Exception as error:
                raise _baseline_failed(agent, name, error) from error
            if hasattr(baseline, "reset"):
                baseline.reset()  # stateful baselines (e.g. a walkthrough) start over
            done, turns = False, 0
            while not done:
                legal = list(agent.named_actions(observation, info))
                action_name = baseline(observation, info, legal, rng)
                action = agent.env_action(legal.index(action_name), legal)
                try:
                    next_observation, reward, terminated, truncated, next_info = checked_step(
                        env, action
                    )
                except Exception as error:
                    raise _baseline_failed(agent, name, error) from error
                turns += 1
                done = terminated or truncated or turns >= turn_cap
                yield BaselineStep(
                    index, observation, info, action_name, reward, done, next_info
                )
                observation, info = next_observation, next_info
    finally:
        env.close()


def _baseline_failed(agent: Any, name: str, error: Exception) -> LlamaGymError:
    text = " ".join(str(error).split())[:300]
    return EnvFailureError(
        f"baseline {name!r} of agent {agent.name!r}: the environment failed "
        f"({type(error).__name__}: {text!r}); baselines play on a working env only"
    )


def evaluate_baseline(
    agent: Any,
    name: str,
    episodes: int,
    seed: int = 0,
    on_progress: Progress | None = None,
    seeds: Sequence[int] | None = None,
) -> EvalResult:
    """Play one of the agent's baseline policies on the evaluation seeds (or ``seeds``,
    the ones the agent's evaluation finished), its outcomes named by the agent
    (``on_progress`` as for :func:`evaluate_agent`)."""
    if seeds is None:
        seeds = evaluation_seeds(seed, episodes)
    episodes = len(seeds)
    returns = [0.0] * episodes
    infos: list[dict] = [{}] * episodes  # each episode's last info
    keys = [0] * episodes  # a running hash of each episode's steps
    done = 0
    if on_progress is not None:
        on_progress(0, episodes)
    for step in play_baseline(agent, name, seeds, rng_seed=seed):
        returns[step.episode] += step.reward
        keys[step.episode] = hash(
            (keys[step.episode], _observation_key(step.observation), step.action, step.reward)
        )
        if step.done:
            infos[step.episode] = info_summary(step.next_info)
            done += 1
            if on_progress is not None:
                on_progress(done, episodes)
    return summarise(
        name, returns, agent=agent, infos=infos, distinct_episodes=len(set(keys))
    )
