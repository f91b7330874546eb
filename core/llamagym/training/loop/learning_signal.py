"""Whether a run can still learn: the checks over its last updates that find a dead
learning signal, each said once a run with what to do for this agent.

After every update the trainer hands the update's episodes and metrics to
:meth:`LearningSignal.add`, which keeps a summary of the last :data:`WINDOW` updates (the
episodes of every process) and looks, once the window is full, for:

* ``no-reward``: every episode returned 0, or every one the same return: no return
  differs from another, so no action is better than another;
* ``all-truncated``: every episode was cut by its time limit or turn cap before it ended;
* ``one-action``: one action chosen in at least :data:`ONE_ACTION_SHARE` of the turns that
  offered a choice (at least :data:`ONE_ACTION_TURNS` of them): the policy no longer
  explores;
* ``kl-stop``: the target-KL stop ended the epochs of every update early
  (``target_kl_stop`` in the algorithm's metrics);
* ``invalid-replies``: more than :data:`INVALID_SHARE` of the replies named no legal
  action.

A finding is said once a run: a warning, and a ``diagnosis`` record that the trainer
appends to ``metrics.jsonl`` (``{"kind": "diagnosis", "update": N, "finding": ...,
"message": ...}``) and the report lists. A resumed run reads the records of the run it
continues and does not say those findings again; its window starts with its own first
update. Action names come from the env: the messages hold them escaped
(:func:`llamagym.display.printable`).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from llamagym import distributed
from llamagym.display import printable
from llamagym.resolver.layers import expert_baseline
from llamagym.task import Task
from llamagym.training.loop.baseline_warm_start import warm_start_baseline

logger = logging.getLogger(__name__)

#: The updates each check looks at.
WINDOW = 3
#: The share of the turns with a choice at which one action counts as the only one.
ONE_ACTION_SHARE = 0.95
#: The fewest turns with a choice, over the window, for the one-action check to judge.
ONE_ACTION_TURNS = 20
#: The share of invalid replies above which they are a finding.
INVALID_SHARE = 0.5
#: The characters of an action name a message quotes.
_NAME_CHARS = 60

DIAGNOSIS = "diagnosis"


@dataclass
class UpdateSignal:
    """What the checks need of one update's episodes (one process's, or summed)."""

    episodes: int = 0
    lowest_return: float | None = None
    highest_return: float | None = None
    truncated: int = 0
    turns: int = 0
    invalid: int = 0
    #: Turns with a valid reply among two or more legal actions, by the action's name.
    choices: Counter[str] = field(default_factory=Counter)
    #: Turns that offered legal actions by name (an agent that names none offers none).
    named_turns: int = 0
    #: ``target_kl_stop`` and ``epochs_run`` of the algorithm's metrics, when it reports them.
    kl_stopped: bool | None = None
    epochs_run: float | None = None

    @classmethod
    def of(cls, episodes: Iterable[Any]) -> UpdateSignal:
        signal = cls()
        for episode in episodes:
            signal.episodes += 1
            # The learner's return (the env's reward, its progress and any shaping): a
            # dense signal that varies is something to learn from.
            learned = episode.total_reward
            signal.lowest_return = _lowest(signal.lowest_return, learned)
            signal.highest_return = _highest(signal.highest_return, learned)
            signal.truncated += bool(episode.truncated)
            for turn in episode.turns:
                signal.turns += 1
                signal.invalid += not turn.valid
                legal = turn.legal_actions
                signal.named_turns += bool(legal)
                index = turn.action_index
                if turn.valid and len(legal) > 1 and index is not None and 0 <= index < len(legal):
                    signal.choices[str(legal[index])] += 1
        return signal

    def merged(self, other: UpdateSignal) -> UpdateSignal:
        return UpdateSignal(
            self.episodes + other.episodes,
            _lowest(self.lowest_return, other.lowest_return),
            _highest(self.highest_return, other.highest_return),
            self.truncated + other.truncated,
            self.turns + other.turns,
            self.invalid + other.invalid,
            self.choices + other.choices,
            self.named_turns + other.named_turns,
            self.kl_stopped if other.kl_stopped is None else other.kl_stopped,
            self.epochs_run if other.epochs_run is None else other.epochs_run,
        )


def _lowest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


def _highest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


@dataclass(frozen=True)
class Finding:
    name: str
    message: str


class Advice:
    """What to try, in this agent's own terms: its baselines to warm-start from, its
    options, its algorithm's settings."""

    def __init__(self, agent: Task):
        config = agent.config
        self.agent_name = printable(config.agent.name or type(agent).__name__, keep="")
        self.config = config
        baselines = [name for name in agent.baselines if name != "random"]
        self.baselines = [printable(name, keep="") for name in baselines]
        expert = expert_baseline(type(agent))
        self.expert = None if expert is None else printable(expert, keep="")
        options = getattr(agent, "options", None)
        self.options = options
        self.option_names = set(type(options).model_fields) if options is not None else set()
        self.warm_started = warm_start_baseline(agent) is not None

    def warm_start(self) -> str | None:
        if not self.baselines or self.warm_started:  # none, or this run already does
            return None
        if len(self.baselines) > 1 and self.expert in self.baselines:
            others = ", ".join(name for name in self.baselines if name != self.expert)
            return (
                f"warm-starting from its expert baseline (--warm-start {self.expert}; "
                f"its others: {others})"
            )
        if len(self.baselines) == 1:
            return f"warm-starting from its baseline (--warm-start {self.baselines[0]})"
        return (
            "warm-starting from one of its baselines (--warm-start BASELINE: "
            f"{', '.join(self.baselines)})"
        )

    def easier_task(self) -> str | None:
        if not self.option_names:
            return None
        return (
            f"an easier setting of its options (llamagym config show {self.agent_name} "
            "lists them)"
        )

    def more_steps(self) -> str | None:
        if "max_episode_steps" not in self.option_names:
            return self.easier_task()
        now = getattr(self.options, "max_episode_steps", None)
        current = "" if now is None else f", now {now}"
        return f"more steps per episode (--set agent.max_episode_steps=...{current})"

    def setting(self, section: str, key: str, what: str) -> str | None:
        value = getattr(getattr(self.config, section), key, None)
        if value is None:
            return None
        return f"{what} (--set {section}.{key}=..., now {value:g})"

    @staticmethod
    def larger_budget() -> str:
        return "a larger budget (--minutes)"


def _try(*choices: str | None) -> str:
    kept = list(dict.fromkeys(choice for choice in choices if choice))  # once each, in order
    kept = kept or [Advice.larger_budget()]
    if len(kept) == 1:
        return f"try {kept[0]}"
    return f"try {', '.join(kept[:-1])} or {kept[-1]}"


def diagnose(window: Sequence[UpdateSignal], advice: Advice) -> list[Finding]:
    """The findings over ``window``, the summaries of the last updates (all of them
    judged together)."""
    updates = len(window)
    total = UpdateSignal()
    for signal in window:
        total = total.merged(signal)
    last = f"the last {updates} updates"
    findings = []
    low, high = total.lowest_return, total.highest_return
    if total.episodes and low is not None and low == high:
        what = (
            f"no episode of {last} ({total.episodes} episodes) earned a reward"
            if low == 0
            else f"every episode of {last} ({total.episodes} episodes) returned "
            f"{low:+.4g}: no return differs from another"
        )
        solved = (
            f"if {low:+.4g} is the most an episode can earn, the policy has learnt it "
            "(llamagym eval --checkpoint RUN says how it plays greedily); else "
            if low > 0 else ""
        )
        findings.append(Finding("no-reward", (
            f"{what}, so there is nothing to learn from; {solved}"
            + _try(advice.warm_start(), advice.easier_task(), advice.larger_budget())
        )))
    if total.episodes and total.truncated == total.episodes:
        findings.append(Finding("all-truncated", (
            f"every episode of {last} ({total.episodes} episodes) was cut by its time "
            "limit before it ended; " + _try(advice.more_steps(), advice.warm_start())
        )))
    chosen = sum(total.choices.values())
    if chosen >= ONE_ACTION_TURNS:
        action, count = total.choices.most_common(1)[0]
        if count >= ONE_ACTION_SHARE * chosen:
            name = printable(action, keep="")
            name = name if len(name) <= _NAME_CHARS else name[: _NAME_CHARS - 3] + "..."
            findings.append(Finding("one-action", (
                f"the policy chose '{name}' in {count / chosen:.0%} of the {chosen} turns "
                f"with a choice in {last}: it has stopped exploring, so it will not find "
                "a better action if there is one; "
                + _try(
                    advice.setting("algorithm", "entropy_coef", "a larger entropy bonus"),
                    advice.setting("rollout", "temperature", "a higher sampling temperature"),
                    advice.warm_start(),
                )
            )))
    if all(signal.kl_stopped for signal in window):
        epochs = [signal.epochs_run for signal in window if signal.epochs_run is not None]
        planned = getattr(advice.config.algorithm, "epochs", None)
        of = f" of {planned}" if planned is not None else ""
        run = f" ({sum(epochs) / len(epochs):.1f}{of} epochs run on average)" if epochs else ""
        findings.append(Finding("kl-stop", (
            f"the target-KL stop ended the epochs of each of {last} early{run}: the "
            "policy barely moves; "
            + _try(
                advice.setting("algorithm", "target_kl", "a larger target"),
                advice.setting("algorithm", "lr", "a lower learning rate"),
            )
        )))
    if total.turns and total.invalid > INVALID_SHARE * total.turns:
        held = (
            "replies held to the legal actions (--set rollout.legal_replies=true), so "
            "each one writes one of them"
            if total.named_turns and not advice.config.rollout.legal_replies else None
        )
        score = (
            "score mode (--set rollout.mode=score), which ranks the legal actions instead "
            "of reading a reply" if total.named_turns else None
        )
        findings.append(Finding("invalid-replies", (
            f"{total.invalid / total.turns:.0%} of the replies of {last} named no legal "
            "action: the model seldom answers in a form the agent reads; "
            + _try(held, advice.warm_start(), score)
        )))
    return findings


def said_before(history: Iterable[Mapping[str, Any]]) -> set[str]:
    """The findings the records of a run already hold."""
    return {
        str(record.get("finding"))
        for record in history
        if record.get("kind") == DIAGNOSIS
    }


class LearningSignal:
    """The last :data:`WINDOW` updates of a run of ``agent``, checked after each; a
    finding in ``history`` (a resumed run's earlier records) is not said again."""

    def __init__(self, agent: Task, history: Iterable[Mapping[str, Any]] = ()):
        self.advice = Advice(agent)
        self.window: deque[UpdateSignal] = deque(maxlen=WINDOW)
        self.said = said_before(history)

    def add(self, batch: Sequence[Any], metrics: Mapping[str, float]) -> list[dict[str, Any]]:
        """Count one update (every process calls it: the summaries are gathered) and
        return the diagnosis records of the findings it makes that were not said
        before; rank 0 warns with each."""
        signal = UpdateSignal()
        for share in distributed.all_gather(UpdateSignal.of(batch)):
            signal = signal.merged(share)
        if "target_kl_stop" in metrics:
            signal.kl_stopped = bool(metrics["target_kl_stop"])
            signal.epochs_run = metrics.get("epochs_run")
        self.window.append(signal)
        if len(self.window) < WINDOW:
            return []
        update = int(metrics.get("update", 0))
        records = []
        for finding in diagnose(self.window, self.advice):
            if finding.name in self.said:
                continue
            self.said.add(finding.name)
            records.append(
                {"kind": DIAGNOSIS, "update": update, "finding": finding.name,
                 "message": finding.message}
            )
            if distributed.is_main():
                logger.warning("update %d: %s", update, finding.message)
        return records


def before_training(agent: Task, result: Any, baselines: Sequence[Any]) -> str | None:
    """One line for an evaluation of the untrained model (``result``, beside the
    agent's ``baselines``: :class:`~llamagym.rollout.evaluation.EvalResult`), when
    neither it nor random play earns any reward: training would start with nothing to
    learn from. None otherwise, or when the agent has no ``random`` baseline."""

    def nothing(evaluation: Any) -> bool:
        return evaluation.episodes > 0 and evaluation.mean == 0 and evaluation.ci95 == 0

    randoms = [b for b in baselines if b.name == "random"]
    if not randoms or not nothing(result) or not all(nothing(b) for b in randoms):
        return None
    advice = Advice(agent)
    earning = [b for b in baselines if not nothing(b)]
    if not earning:
        return (
            "no policy tried earns any reward (the untrained model and every baseline "
            "returned 0 in every episode): training would have nothing to learn from; "
            + _try(advice.easier_task(), advice.more_steps(), advice.larger_budget())
        )
    named = ", ".join(
        f"{printable(b.name, keep='')} ({b.mean:+.3f})"
        for b in sorted(earning, key=lambda b: -b.mean)
    )
    best = printable(max(earning, key=lambda b: b.mean).name, keep="")
    return (
        "neither the untrained model nor random play earns any reward (0 in every "
        "episode): training would start with nothing to learn from; warm-start from a "
        f"baseline that does, {named}: --warm-start {best}"
    )
