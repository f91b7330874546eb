"""The base class of every training algorithm plugin, and the pieces the built-in ones
share (the clipped-policy-gradient loop, KL to the reference, target-KL stop, adaptive
KL coefficient).

An algorithm gets finished episodes and changes the policy's weights. It owns its
optimizer; the rollout engine, hooks and loggers sit outside it. It is built with all
it reads, one frozen :class:`AlgorithmContext` (the policy, the algorithm's validated
config, the rollout settings, the run's :class:`~llamagym.schedule.Schedule`, the
processes' collectives, the trainer's :class:`~llamagym.schedule.Control`):
``PPO(context)``, the one constructor every algorithm has. The learning rate of its
optimizer has one writer, the :class:`~llamagym.schedule.LearningRate` on the run's
schedule, set before each step. A run then takes it through visible
phases: on a fresh start :meth:`Algorithm.warm_start` (supervised steps on
demonstrations, when configured) and :meth:`Algorithm.freeze_reference` (the KL
reference keeps the weights RL starts from), then :meth:`Algorithm.update` once per
batch. Everything it needs to resume exactly (optimizer, counters, random state, parts
such as a replay buffer) is in :meth:`Algorithm.state_dict`, as tensors or JSON-able
values.

With several processes (``llamagym.distributed``) every process runs ``update`` on its
own episodes and :meth:`Algorithm.step` averages the gradients over the processes, so
every process must call ``step`` the same number of times. What decides that is agreed
through the algorithm's ``group``, in its methods named ``sync_*``: the minibatches per
epoch (:meth:`Algorithm.sync_minibatch_count`, the smallest count over the processes;
the extra turns of a process with more are left out of that epoch, a different random
share each epoch), the target-KL stop (:meth:`Algorithm.sync_target_kl_stop`, on the
largest KL of all processes) and the adaptive KL weight (:meth:`Algorithm.sync_adapt_kl`).
With one process all of this is exactly the single-process computation.

The pieces have modules of their own, and their names are imported from there: the
config and the fields the built-in configs share (``algorithm_config``), how an update
groups and cuts its batch (``batching``), the loss terms (``losses``), the adaptive KL
weight (``kl_control``) and how turns are scored under the policy (``turn_scoring``: the
algorithm's ``scoring``, a part it holds).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch

from llamagym import distributed
from llamagym import moved_name as _moved_name
from llamagym.algorithms.algorithm_config import (
    AlgorithmConfig,
    ClippedSettings,
)
from llamagym.algorithms.batching import history_groups, minibatches, prompt_pieces
from llamagym.algorithms.kl_control import KLController
from llamagym.algorithms.losses import (
    LossTerm,
    clipped_surrogate,
    zero_metrics,
)
from llamagym.algorithms.turn_scoring import TurnScoring
from llamagym.config import RolloutSettings
from llamagym.models.policy import Policy
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.schedule import Control, LearningRate, Schedule

__all__ = [
    "MOVED_METHODS",
    "TARGET_KL_TOLERANCE",
    "Algorithm",
    "AlgorithmContext",
    "Optimisation",
    "Stateful",
    "Supervised",
    "rng_state",
    "rollout_metrics",
    "set_rng_state",
]

#: An update's remaining epochs stop once KL(rollout || current) passes this x target_kl.
TARGET_KL_TOLERANCE = 1.5


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Supervised(Stateful, Protocol):
    """An algorithm's supervised steps, as the update calls them (the SFT warm-start of
    ``llamagym_builtins.sft`` is one)."""

    def train_on_demonstrations(self) -> dict[str, float]: ...
    def after_update(self, episodes: Sequence[Episode]) -> dict[str, float]: ...


@dataclass
class Optimisation:
    """What one :meth:`Algorithm.optimise` did."""

    #: Means over the steps taken: policy_loss, each extra term, entropy, kl_ref,
    #: approx_kl, clip_fraction.
    averages: dict[str, float]
    steps: int
    epochs_run: int
    target_kl_stop: bool
    interrupted: bool


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm is built with: ``Algorithm(context)``, for every algorithm."""

    policy: Policy
    #: The run's ``algorithm`` section, validated by the algorithm's ``Config``.
    config: AlgorithmConfig
    rollout: RolloutSettings
    #: The run's schedule (the learning rate anneals on it); moved by its owner, read
    #: by the algorithm.
    schedule: Schedule
    #: The collectives the processes agree through (the ``sync_*`` methods and
    #: :meth:`Algorithm.step`): :func:`~llamagym.distributed.process_group`, which for a
    #: process started on its own is :class:`~llamagym.distributed.SingleProcess`.
    group: distributed.Collectives
    #: The stop request and epoch report of the one running the updates; by default an
    #: update never stops early and reports nothing.
    control: Control = field(default_factory=Control)


#: What an Algorithm offered in LlamaGym 0.3 that 0.4 moved, and where it is now: a 0.3
#: algorithm that asks for one is told in one line (:meth:`Algorithm.__getattr__`).
MOVED_METHODS = {
    **{name: f"self.scoring.{name}" for name in (
        "evaluate", "sampling_temperature", "named_actions", "old_logprobs", "padded",
        "reference_logprobs", "reference_logprob_lists", "keep_trunk",
    )},
    "annealed_lr": "self.learning_rate = LearningRate(context.schedule, lr, anneal) "
                   "(llamagym.schedule), which self.step applies",
    "warmup_share": "LearningRate(...).at(step) (llamagym.schedule)",
    "progress": "self.schedule.progress",
}


class Algorithm:
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    #: Credit rules this algorithm accepts (mirrors its Config's; documented in credit.py).
    credit_rules: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An algorithm written for LlamaGym 0.3 (``__init__(self, policy, config,
        rollout, ...)``) is refused where it is defined, with the fix."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        code = getattr(init, "__code__", None)
        defaults = getattr(init, "__defaults__", None) or ()
        # Positional parameters after self without a default: the context is the one.
        if code is not None and code.co_argcount - 1 - len(defaults) > 1:
            taken = ", ".join(code.co_varnames[1 : code.co_argcount])
            raise TypeError(
                f"{cls.__module__}.{cls.__qualname__}.__init__ takes ({taken}): since "
                "LlamaGym 0.4 an algorithm is built with one AlgorithmContext; write "
                "`def __init__(self, context: AlgorithmContext)` and call "
                "`super().__init__(context)` (context.policy, context.config, "
                "context.rollout, ...; llamagym.algorithms.algorithm)"
            )

    def __init__(self, context: AlgorithmContext):
        self.context = context
        self.policy, self.config, self.rollout = context.policy, context.config, context.rollout
        self.schedule, self.group, self.control = context.schedule, context.group, context.control
        #: How turns are scored under the policy (now, as sampled, under the reference).
        self.scoring = TurnScoring(context.policy)
        #: The one writer of ``self.optimizer``'s rate, set before each of its steps
        #: (on the run's schedule: annealed, warmed up); None: the rate it was made with.
        self.learning_rate: LearningRate | None = None
        self.skipped_updates = 0
        self.updates = 0
        self.target_kl_stops = 0
        #: Steps taken by ``self.optimizer`` (the learning-rate warmup counts them).
        self.optimizer_steps = 0
        # Minibatch order and replay sampling; seeded from torch so a seeded run repeats.
        self.rng = random.Random(torch.initial_seed())
        self.optimizer: torch.optim.Optimizer | None = None  # set by each algorithm
        #: The weight of the KL-to-reference penalty, in an algorithm that has one.
        self.kl: KLController | None = None
        #: Supervised steps (demonstrations before RL, the best episodes between
        #: updates), in an algorithm configured for them.
        self.sft: Supervised | None = None

    if not TYPE_CHECKING:  # to a type checker a moved method is missing, as it is
        def __getattr__(self, name: str) -> object:
            """Only for a name the instance lacks: one that 0.4 moved names its place."""
            if name in MOVED_METHODS:
                raise AttributeError(f"{type(self).__name__}.{name} is "
                                     f"{MOVED_METHODS[name]} since LlamaGym 0.4")
            raise AttributeError(
                f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    # -- phases of a run -----------------------------------------------------------
    def warm_start(self) -> dict[str, float]:
        """Before the first update of a fresh run: supervised steps on the configured
        demonstrations (``algorithm.warm_start.demonstrations``). Returns their first
        and last loss, or {} when there are none (or they were trained on already)."""
        if self.sft is None:
            return {}
        return self.sft.train_on_demonstrations()

    def freeze_reference(self) -> None:
        """Once the starting weights are final (after :meth:`warm_start`): fix the KL
        reference at them, so RL is pulled back to what the demonstrations taught. With
        a LoRA adapter this costs nothing (the reference is the adapter switched off,
        i.e. the base model); a fully fine-tuned model keeps a frozen copy. Nothing to
        do without a KL penalty. A resumed run calls it before loading its weights."""
        if self.kl is not None and self.kl.coef > 0:
            self.policy.freeze_reference()

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        raise NotImplementedError

    # -- state ----------------------------------------------------------------------
    def stateful_parts(self) -> dict[str, Stateful | None]:
        """Named parts with their own state: the KL controller and the warm start,
        where there are; an algorithm with more parts adds them."""
        parts: dict[str, Stateful | None] = {}
        if self.kl is not None:
            parts["kl_controller"] = self.kl
        if self.sft is not None:
            parts["warm_start"] = self.sft
        return parts

    def state_dict(self) -> dict:
        """Everything needed to resume this algorithm exactly: the optimizer, the
        counters, the random state and every stateful part. (The schedule is the run's,
        the control the trainer's: neither is the algorithm's state.)"""
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "counters": {
                "updates": self.updates,
                "skipped_updates": self.skipped_updates,
                "target_kl_stops": self.target_kl_stops,
                "optimizer_steps": self.optimizer_steps,
            },
            "rng": rng_state(self.rng),
        }
        for name, part in self.stateful_parts().items():
            if part is not None:
                state[name] = part.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        counters = state.get("counters", {})
        self.updates = counters.get("updates", 0)
        self.skipped_updates = counters.get("skipped_updates", 0)
        self.target_kl_stops = counters.get("target_kl_stops", 0)
        self.optimizer_steps = counters.get("optimizer_steps", 0)
        if state.get("rng") is not None:
            set_rng_state(self.rng, state["rng"])
        for name, part in self.stateful_parts().items():
            if part is not None and state.get(name) is not None:
                part.load_state_dict(state[name])

    @property
    def episodes_per_update(self) -> int:
        return int(getattr(self.config, "episodes_per_update", 32))

    @property
    def group_size(self) -> int:
        """Episodes per group sharing a start seed (GRPO); 1 = independent episodes."""
        return 1

    # -- pieces shared by the algorithms ------------------------------------------
    def stop_requested(self) -> bool:
        """True when the update should end now, before its next minibatch. Checked
        between optimizer steps only, so the weights are always those after a whole
        number of steps (a valid state to checkpoint)."""
        return bool(self.control.should_stop())

    def epoch_started(self, epoch: int, epochs: int) -> None:
        """Report that epoch ``epoch`` (from 1) of ``epochs`` begins."""
        self.control.on_epoch(epoch, epochs)

    def model_parameters(self) -> list[torch.nn.Parameter]:
        """The language model's trainable parameters, without the value head (for the
        algorithms that have no critic)."""
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    # -- decisions every process takes alike (collectives) ---------------------------
    def sync_minibatch_count(self, turns: int, size: int) -> int:
        """Gradient steps per epoch over ``turns`` turns in minibatches of ``size``:
        ``ceil(turns / size)``, agreed as the smallest over the processes."""
        return self.group.all_min(-(-turns // size))

    def sync_target_kl_stop(self, approx_kl: float, target_kl: float | None) -> bool:
        """True when the update should stop: KL(rollout || current) past 1.5x the
        target, judged on the largest KL of all processes so they all stop at the same
        step."""
        if target_kl is None:
            return False
        return self.group.all_max(approx_kl) > TARGET_KL_TOLERANCE * target_kl

    def sync_adapt_kl(self, measured_kl: float, samples: int) -> None:
        """Steer the adaptive KL weight (``self.kl``) by the turn-weighted mean KL of
        all processes over all their turns, so the weight stays the same on every
        process; each process calls this once per update."""
        if self.kl is None or self.kl.target is None:
            return
        mean_kl, all_samples = self.group.all_mean(measured_kl, samples)
        self.kl.update(mean_kl, all_samples)

    def step(
        self, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float
    ) -> bool:
        """Backward and step; a non-finite loss or gradient skips the step (counted).

        With several processes the gradients are averaged over them before clipping, and
        a non-finite loss on any of them skips the step on all."""
        optimizer.zero_grad(set_to_none=True)
        finite = bool(torch.isfinite(loss))
        if finite:
            loss.backward()
        return self.apply_gradients(optimizer, finite, max_grad_norm)

    def apply_gradients(
        self, optimizer: torch.optim.Optimizer, finite: bool, max_grad_norm: float
    ) -> bool:
        """Step on the gradients the parameters hold (``finite``: every loss behind them
        was); see :meth:`step`, which takes the backward pass first. A step of
        ``self.optimizer`` is taken at the rate :attr:`learning_rate` gives it, and is
        counted."""
        parameters = self.policy.trainable_parameters()
        if not self.group.average_gradients(parameters, finite):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return False
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        if not math.isfinite(float(norm)):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return False
        if optimizer is not self.optimizer:  # another optimizer's step (the warm start's)
            optimizer.step()
            return True
        if self.learning_rate is not None:
            self.learning_rate.set(optimizer, self.optimizer_steps + 1)
        optimizer.step()
        self.optimizer_steps += 1
        return True

    # -- the clipped-policy-gradient update ------------------------------------------
    def optimise(
        self,
        turns: Sequence[Turn],
        advantages: torch.Tensor,
        terms: Sequence[LossTerm] = (),
        *,
        settings: ClippedSettings | None = None,
    ) -> Optimisation:
        """Epochs of clipped-surrogate steps on ``turns`` (one advantage each), in
        shuffled minibatches, with the optimizer ``self.optimizer``.

        The loss of a minibatch is the clipped surrogate plus each of ``terms`` (the
        algorithm's: its own, :func:`~llamagym.algorithms.losses.entropy_bonus`,
        :func:`~llamagym.algorithms.losses.reference_penalty`), in their order. Before
        each step the update may end: on a stop request (:meth:`stop_requested`; the
        steps taken stand), or once KL(rollout || current) passes the target
        (:meth:`sync_target_kl_stop`). Afterwards the adaptive KL weight ``self.kl`` is
        steered by the ``kl_ref`` term's mean (:meth:`sync_adapt_kl`).
        ``settings`` (default: the algorithm's config) gives ``epochs``,
        ``minibatch_size``, ``clip_range``, ``target_kl`` and
        ``max_grad_norm``, and may give ``microbatch_size`` (turns per forward and
        backward pass within a step; see :meth:`_accumulate`). An update without turns
        runs no epoch. Where the model trains only its top layers (``model.lora_layers``),
        the layers below run at most once per turn (``scoring.keep_trunk``), not in every pass.
        """
        if settings is None:
            settings = cast(ClippedSettings, self.config)
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__} has no optimizer to take steps with")
        optimizer = self.optimizer
        # No gradients, so no activations kept: a whole minibatch per pass.
        self.scoring.keep_trunk(turns, settings.minibatch_size)
        kl_coef = self.kl.coef if self.kl is not None else 0.0
        chunk = getattr(settings, "microbatch_size", None) or settings.minibatch_size
        for term in terms:
            if term.prepare is not None:
                term.prepare(turns, chunk)
        sums = zero_metrics(terms)
        steps, epochs_run, stopped, interrupted = 0, 0, False, False
        groups = history_groups(turns)
        steps_per_epoch = self.sync_minibatch_count(len(turns), settings.minibatch_size)
        for epoch in range(settings.epochs if turns else 0):
            epochs_run += 1
            self.epoch_started(epoch + 1, settings.epochs)
            self.rng.shuffle(groups)
            order = [i for group in groups for i in group]
            for index in minibatches(order, settings.minibatch_size, steps_per_epoch):
                if self.stop_requested():
                    interrupted = True  # asked to stop: the steps taken so far stand
                    break
                gradients = self._accumulate(turns, index, advantages, terms, settings)
                if gradients is None:
                    stopped = True  # this step would move further from the rollout policy
                    break
                values, finite = gradients
                self.apply_gradients(optimizer, finite, settings.max_grad_norm)
                steps += 1
                for key, value in values.items():
                    sums[key] += value
            if stopped:
                self.target_kl_stops += 1
                break
            if interrupted:
                break
        averages = {key: value / max(1, steps) for key, value in sums.items()}
        if kl_coef > 0 and "kl_ref" in averages:  # on every process, even one without turns
            self.sync_adapt_kl(averages["kl_ref"], len(turns))
        return Optimisation(averages, steps, epochs_run, stopped, interrupted)

    @torch.enable_grad()  # an update asked for under torch.no_grad() still learns
    def _accumulate(
        self,
        turns: Sequence[Turn],
        index: list[int],
        advantages: torch.Tensor,
        terms: Sequence[LossTerm],
        settings: ClippedSettings,
    ) -> tuple[dict[str, float], bool] | None:
        """The gradients of one step over the minibatch ``index``, accumulated from
        forward and backward passes over pieces of ``microbatch_size`` turns (the whole
        minibatch when the config has none): each piece's loss counts by its share of
        the minibatch, so the step is the one a single pass would take, with a piece's
        activations held instead of the minibatch's. Returns the step's share-weighted
        metrics and whether every loss was finite; None, with no gradient kept, when
        KL(rollout || current) over the minibatch is past the target (judged before the
        last piece's backward pass, so a minibatch in one piece stops without one)."""
        optimizer = cast(torch.optim.Optimizer, self.optimizer)
        optimizer.zero_grad(set_to_none=True)
        size = getattr(settings, "microbatch_size", None) or len(index)
        pieces = prompt_pieces(turns, index, size)
        values = zero_metrics(terms)
        finite = True
        for number, piece in enumerate(pieces):
            share = len(piece) / len(index)
            batch = [turns[i] for i in piece]
            new = self.scoring.evaluate(batch)
            width = new.logprobs.shape[1]
            surrogate = clipped_surrogate(
                new, self.scoring.old_logprobs(batch, width), advantages[piece],
                settings.clip_range,
            )
            values["approx_kl"] += share * surrogate.approx_kl
            values["clip_fraction"] += share * surrogate.clip_fraction
            last = number == len(pieces) - 1
            if last and self.sync_target_kl_stop(values["approx_kl"], settings.target_kl):
                optimizer.zero_grad(set_to_none=True)
                return None
            loss = surrogate.loss
            values["policy_loss"] += share * surrogate.loss.item()
            for term in terms:
                value = term.compute(piece, new)
                if value is not None:
                    loss = loss + term.weight * value
                    values[term.name] += share * value.item()
            finite = finite and bool(torch.isfinite(loss))
            if finite:
                (loss * share).backward()
        return values, finite

    def finish_update(
        self,
        episodes: Sequence[Episode],
        result: Optimisation,
        batch: Mapping[str, float] | None = None,
    ) -> dict[str, float]:
        """Count the update, take the warm start's supervised steps on the batch (when
        configured), and gather the metrics: the loop's means, the warm start's, the
        rollout's, ``batch`` (what the algorithm says of its batch) and the counters."""
        metrics = dict(result.averages)
        self.updates += 1
        if self.sft is not None:
            metrics.update(self.sft.after_update(episodes))
        metrics.update(rollout_metrics(episodes))
        metrics.update(batch or {})
        metrics.update(
            policy_steps=float(result.steps),
            epochs_run=float(result.epochs_run),
            target_kl_stop=float(result.target_kl_stop),
            update_interrupted=float(
                result.interrupted or bool(metrics.get("update_interrupted"))
            ),
            target_kl_stops=float(self.target_kl_stops),
            kl_coef=self.kl.coef if self.kl is not None else 0.0,
            skipped_steps=float(self.skipped_updates),
        )
        return metrics


# -- bookkeeping ------------------------------------------------------------------------
def rng_state(rng: random.Random) -> list:
    """A ``random.Random`` state as JSON-able lists."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    turns = sum(len(e.turns) for e in episodes)
    versions = [turn.policy_version for e in episodes for turn in e.turns]
    latest = max(versions, default=0)
    return {
        # turns of episodes carried in from an earlier collection, played by older weights
        "carried_turns": sum(v < latest for v in versions) / max(1, turns),
        "episodes": float(len(episodes)),
        "return_mean": sum(e.env_return for e in episodes) / max(1, len(episodes)),
        "invalid_rate": sum(e.invalid_replies for e in episodes) / max(1, turns),
        "episode_length": turns / max(1, len(episodes)),
    }


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
