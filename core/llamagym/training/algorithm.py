"""The base class of every training algorithm plugin, and the pieces the built-in ones
share (the clipped-policy-gradient loop, KL to the reference, target-KL stop, adaptive
KL coefficient).

An algorithm gets finished episodes and changes the policy's weights. It owns its
optimizer; the rollout engine, hooks and loggers sit outside it. It is built with all
it reads: ``Algorithm(policy, config, rollout, schedule=..., group=..., control=...)``
(the run's :class:`~llamagym.schedule.Schedule`, the processes' collectives, the
trainer's :class:`~llamagym.schedule.Control`). A run then takes it through visible
phases: on a fresh start :meth:`Algorithm.warm_start` (supervised steps on
demonstrations, when configured) and :meth:`Algorithm.freeze_reference` (the KL
reference keeps the weights RL starts from), then :meth:`Algorithm.update` once per
batch. Everything it needs to resume exactly (optimizer, counters, random state, parts
such as a replay buffer) is in :meth:`Algorithm.state_dict`, as tensors or JSON-able
values.

With several processes (``llamagym.training.distributed``) every process runs ``update`` on its
own episodes and :meth:`Algorithm.step` averages the gradients over the processes, so
every process must call ``step`` the same number of times. What decides that is agreed
through the algorithm's ``group``, in its methods named ``sync_*``: the minibatches per
epoch (:meth:`Algorithm.sync_minibatch_count`, the smallest count over the processes;
the extra turns of a process with more are left out of that epoch, a different random
share each epoch), the target-KL stop (:meth:`Algorithm.sync_target_kl_stop`, on the
largest KL of all processes) and the adaptive KL weight (:meth:`Algorithm.sync_adapt_kl`).
With one process all of this is exactly the single-process computation.
"""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, ValidationError

from llamagym.config import RolloutSettings
from llamagym.models.policy import Evaluation, Policy, name_tokens, padded
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.schedule import Control, Schedule
from llamagym.training import distributed
from llamagym.training.credit import unsupported_credit_message

if TYPE_CHECKING:
    from typing import Self

#: An update's remaining epochs stop once KL(rollout || current) passes this x target_kl.
TARGET_KL_TOLERANCE = 1.5

#: The flat ``algorithm.sft_*`` keys of the supervised settings, and their names in the
#: ``algorithm.warm_start`` section that holds them.
FLAT_WARM_START_KEYS: dict[str, str] = {
    "sft_warm_start": "replay",
    "sft_buffer_size": "buffer_size",
    "sft_top_k": "top_k",
    "sft_min_return": "min_return",
    "sft_steps": "steps",
    "sft_batch_size": "batch_size",
    "sft_lr": "lr",
    "sft_demonstrations": "demonstrations",
    "sft_demonstration_epochs": "demonstration_epochs",
}


def nest_warm_start_keys(section: Mapping[str, Any]) -> dict[str, Any]:
    """An algorithm section with the flat ``sft_*`` keys moved into its ``warm_start``
    section, for reading a config written with them (an older checkpoint's)."""
    nested = {key: value for key, value in section.items() if key not in FLAT_WARM_START_KEYS}
    moved = {
        FLAT_WARM_START_KEYS[key]: value
        for key, value in section.items()
        if key in FLAT_WARM_START_KEYS
    }
    if moved:
        nested["warm_start"] = {**moved, **dict(section.get("warm_start") or {})}
    return nested


class AlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    #: Credit rules the algorithm accepts; a config with a ``credit`` field is checked
    #: against them, so ``--set algorithm.credit=gae`` on GRPO fails before any loading.
    credit_rules: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _warm_start_keys_are_nested(cls, data: Any) -> Any:
        """A config with a ``warm_start`` section refuses the flat ``sft_*`` keys, each
        with the key to use instead."""
        if not isinstance(data, Mapping) or "warm_start" not in cls.model_fields:
            return data
        flat = [key for key in data if key in FLAT_WARM_START_KEYS]
        if not flat:
            return data
        raise ValidationError.from_exception_data(
            cls.__name__,
            [
                {
                    "type": PydanticCustomError(
                        "nested_key",
                        "this key is now algorithm.warm_start.{key}",
                        {"key": FLAT_WARM_START_KEYS[key]},
                    ),
                    "loc": (key,),
                    "input": data[key],
                }
                for key in flat
            ],
        )

    @field_validator("credit", check_fields=False)
    @classmethod
    def _credit_is_supported(cls, rule: str) -> str:
        if cls.credit_rules and rule not in cls.credit_rules:
            name = cls.__name__.removesuffix("Config").lower()
            raise PydanticCustomError(
                "unsupported_credit", unsupported_credit_message(name, rule, cls.credit_rules)
            )
        return rule


def microbatch_size_field() -> Any:
    """The ``microbatch_size`` setting of a config whose algorithm steps through
    :meth:`Algorithm.optimise` (PPO's and GRPO's)."""
    return Field(
        None,
        ge=1,
        description="Turns per forward and backward pass; a step accumulates its "
        "minibatch's gradients from such pieces (less memory, same step). null = the "
        "whole minibatch.",
    )


def warmup_steps_field() -> Any:
    """The ``warmup_steps`` setting of a config whose algorithm steps with Adam."""
    return Field(
        0,
        ge=0,
        description="Optimizer steps over which the learning rate rises linearly to its "
        "value (0 = none). Adam's first step moves every weight by the whole rate, "
        "whatever its gradient's size.",
    )


def check_group_divides_batch(group_size: int, info: ValidationInfo) -> int:
    """Field validator body for ``group_size`` (declared after ``episodes_per_update``, so
    that is validated first): a batch must hold whole seed groups."""
    episodes = info.data.get("episodes_per_update")
    if episodes and episodes % group_size:
        lower = max(group_size, episodes - episodes % group_size)
        raise PydanticCustomError(
            "not_multiple_of_group",
            "episodes_per_update ({episodes}) must be a multiple of group_size "
            "({group_size}) so every seed group is complete; try episodes_per_update "
            "{lower} or {upper}",
            {"episodes": episodes, "group_size": group_size, "lower": lower,
             "upper": lower + group_size},
        )
    return group_size


def check_adaptive_kl(target: float | None, info: ValidationInfo) -> float | None:
    """Field validator body: the adaptive controller scales ``kl_coef``, so it must start >0."""
    if target is not None and not info.data.get("kl_coef"):
        raise PydanticCustomError(
            "adaptive_kl_needs_coef",
            "needs a starting kl_coef > 0 (the controller scales it); "
            "set e.g. algorithm.kl_coef=0.05",
        )
    return target


class Stateful(Protocol):
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class Supervised(Stateful, Protocol):
    """An algorithm's supervised steps, as the update calls them (the SFT warm-start of
    ``llamagym.plugins.sft`` is one)."""

    def train_on_demonstrations(self) -> dict[str, float]: ...
    def after_update(self, episodes: Sequence[Episode]) -> dict[str, float]: ...


class ClippedSettings(Protocol):
    """The settings :meth:`Algorithm.optimise` reads (the built-in configs have them)."""

    epochs: int
    minibatch_size: int
    clip_range: float
    entropy_coef: float
    target_kl: float | None
    max_grad_norm: float


@dataclass(frozen=True)
class LossTerm:
    """One more term of the clipped-policy-gradient loss: ``weight * compute(index,
    new)`` for the minibatch of turn positions ``index`` and its evaluation ``new``
    (e.g. PPO's value loss). Its mean over the update's steps is reported as ``name``."""

    name: str
    weight: float
    compute: Callable[[list[int], Evaluation], torch.Tensor]


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


class Algorithm:
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    #: Credit rules this algorithm accepts (mirrors its Config's; documented in credit.py).
    credit_rules: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        policy: Policy,
        config: AlgorithmConfig,
        rollout: RolloutSettings,
        *,
        schedule: Schedule | None = None,
        group: distributed.Collectives | None = None,
        control: Control | None = None,
    ):
        self.policy = policy
        self.config = config
        self.rollout = rollout
        #: The run's schedule (the learning rate anneals on it); moved by its owner, read
        #: here. By default one of its own, at progress 0 for good.
        self.schedule = schedule if schedule is not None else Schedule(rollout)
        #: The collectives the processes agree through (the ``sync_*`` methods and
        #: :meth:`step`); by default those of the group this process joined, which for
        #: a process started on its own is :class:`~llamagym.training.distributed.SingleProcess`.
        self.group = group if group is not None else distributed.process_group()
        #: The stop request and epoch report of the one running the updates; by
        #: default an update never stops early and reports nothing.
        self.control = control if control is not None else Control()
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

    @classmethod
    def create(
        cls,
        policy: Policy,
        config: AlgorithmConfig,
        rollout: RolloutSettings,
        *,
        schedule: Schedule | None = None,
        group: distributed.Collectives | None = None,
        control: Control | None = None,
    ) -> Self:
        """Build this algorithm for a run. A constructor that takes only ``(policy,
        config, rollout)`` is called with those, and the algorithm is then given the
        run's ``schedule``, ``group`` and ``control`` (what the keywords would set)."""
        parameters = inspect.signature(cls.__init__).parameters.values()
        takes = {p.name for p in parameters if p.kind is not p.VAR_KEYWORD}
        if {"schedule", "group", "control"} <= takes or any(
            p.kind is p.VAR_KEYWORD for p in parameters
        ):
            return cls(policy, config, rollout, schedule=schedule, group=group, control=control)
        algorithm = cls(policy, config, rollout)
        if schedule is not None:
            algorithm.schedule = schedule
        if group is not None:
            algorithm.group = group
        if control is not None:
            algorithm.control = control
        return algorithm

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
    def progress(self) -> float:
        """The share of the run's budget used so far (the schedule's; read-only here)."""
        return self.schedule.progress

    @property
    def episodes_per_update(self) -> int:
        return int(getattr(self.config, "episodes_per_update", 32))

    @property
    def group_size(self) -> int:
        """Episodes per group sharing a start seed (GRPO); 1 = independent episodes."""
        return 1

    # -- pieces shared by the algorithms ------------------------------------------
    def annealed_lr(self, lr: float, anneal: bool) -> float:
        """Set the optimizer's learning rate to the schedule's for ``lr`` (with
        ``anneal``, a linear decay to 5% of it over the run) and return it."""
        rate = self.schedule.lr(lr, anneal)
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = rate
        return rate

    def stop_requested(self) -> bool:
        """True when the update should end now, before its next minibatch. Checked
        between optimizer steps only, so the weights are always those after a whole
        number of steps (a valid state to checkpoint)."""
        return bool(self.control.should_stop())

    def epoch_started(self, epoch: int, epochs: int) -> None:
        """Report that epoch ``epoch`` (from 1) of ``epochs`` begins."""
        self.control.on_epoch(epoch, epochs)

    def sampling_temperature(self, turns: Sequence[Turn]) -> float | torch.Tensor:
        """The temperature ``turns`` were sampled at: one number when they share it (as
        a batch does), else one per turn, [N, 1]."""
        first = turns[0].temperature
        if all(turn.temperature == first for turn in turns):
            return first
        return torch.tensor([[turn.temperature] for turn in turns], device=self.policy.device)

    def evaluate(
        self, turns: Sequence[Turn], temperature: float | torch.Tensor | None = None
    ) -> Evaluation:
        """Current log-probabilities, entropy and values for ``turns`` (with gradients).
        Score mode's policy is taken at the temperature each turn was sampled at, or at
        ``temperature`` when given."""
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            if temperature is None:
                temperature = self.sampling_temperature(turns)
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                chosen_actions(turns),
                temperature=temperature,
            )
        return self.policy.evaluate_replies(
            prompts, [turn.action_tokens for turn in turns], actions=self.named_actions(turns)
        )

    def named_actions(self, turns: Sequence[Turn]) -> list[list[list[int]]]:
        """Each generate-mode turn's legal actions as tokens (empty where the agent names
        none): the entropy bonus is taken over them (:meth:`Policy.evaluate_replies`)."""
        names = sorted({name for turn in turns for name in turn.legal_actions})
        encoded = name_tokens(self.policy.tokenizer, self.policy.eos_id, names)
        tokens = dict(zip(names, encoded, strict=True))
        return [[tokens[name] for name in turn.legal_actions] for turn in turns]

    def old_logprobs(self, turns: Sequence[Turn], width: int) -> torch.Tensor:
        """The rollout-time log-probabilities, padded to ``width`` action units."""
        return self.padded([turn.logprobs for turn in turns], width)

    def padded(self, rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
        """Per-turn lists of per-unit numbers as a zero-padded [N, width] tensor."""
        return padded(rows, width, 0.0, dtype=torch.float32).to(self.policy.device)

    @torch.no_grad()
    def reference_logprobs(self, turns: Sequence[Turn]) -> torch.Tensor:
        """Log-probabilities of the chosen actions under the reference policy (the
        adapter switched off, or the frozen copy of a fully fine-tuned model). A loop
        that never called :meth:`freeze_reference` has it frozen here, at the weights
        its first update starts from."""
        self.freeze_reference()
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                chosen_actions(turns),
                temperature=self.sampling_temperature(turns),
                reference=True,
            ).logprobs
        replies = [turn.action_tokens for turn in turns]
        return self.policy.evaluate_replies(prompts, replies, reference=True).logprobs

    def reference_logprob_lists(self, turns: Sequence[Turn], chunk: int) -> list[list[float]]:
        """Reference log-probabilities of every turn, once per update (the reference
        never changes, so epochs reuse them), ``chunk`` turns per forward pass, those
        that share a prompt in the same pass."""
        lists: list[list[float]] = [[] for _ in turns]
        for piece in prompt_pieces(turns, range(len(turns)), chunk):
            table = self.reference_logprobs([turns[i] for i in piece]).cpu()
            for row, i in enumerate(piece):
                units = 1 if turns[i].candidates else len(turns[i].action_tokens)
                lists[i] = table[row, :units].tolist()
        return lists

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
        ``self.optimizer`` takes the warmup's share of its learning rate
        (:meth:`warmup_share`) and is counted."""
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
        rates = [group["lr"] for group in optimizer.param_groups]
        share = self.warmup_share(self.optimizer_steps + 1)
        for group in optimizer.param_groups:
            group["lr"] *= share
        optimizer.step()
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        self.optimizer_steps += 1
        return True

    def warmup_share(self, step: int) -> float:
        """The share of the scheduled learning rate that step number ``step`` (from 1)
        of ``self.optimizer`` takes: ``step / warmup_steps`` during the warmup, else 1."""
        warmup = int(getattr(self.config, "warmup_steps", 0) or 0)
        return min(1.0, step / warmup) if warmup else 1.0

    def keep_trunk(self, turns: Sequence[Turn], chunk: int) -> None:
        """Have the policy's frozen trunk (:attr:`Policy.trunk`) hold every turn of an
        update before its epochs: a pass without gradients, ``chunk`` turns at a time,
        runs the decoder where a context is new (a score-mode rollout already kept its
        prompts and candidates) and records it. The reference and every epoch then
        run only the trained layers. A trunk that filled its memory starts over here."""
        trunk = self.policy.trunk
        if trunk is None or not turns:
            return
        if trunk.full:
            trunk.clear()
        for piece in prompt_pieces(turns, range(len(turns)), chunk):
            batch = [turns[i] for i in piece]
            prompts = [turn.prompt_tokens for turn in batch]
            if batch[0].candidates:
                self.policy.keep_trunk(prompts, candidates=[turn.candidates for turn in batch])
            else:
                replies = [turn.action_tokens for turn in batch]
                self.policy.keep_trunk(prompts, replies=replies, actions=self.named_actions(batch))

    # -- the clipped-policy-gradient update ------------------------------------------
    def optimise(
        self,
        turns: Sequence[Turn],
        advantages: torch.Tensor,
        *,
        extra_losses: Sequence[LossTerm] = (),
        settings: ClippedSettings | None = None,
    ) -> Optimisation:
        """Epochs of clipped-surrogate steps on ``turns`` (one advantage each), in
        shuffled minibatches, with the optimizer ``self.optimizer``.

        The loss of a minibatch is the clipped surrogate, plus each of
        ``extra_losses``, minus ``entropy_coef`` x the entropy, plus ``self.kl.coef``
        x KL(current || reference) when the algorithm has a KL weight above 0 (the
        reference is scored once, before the first step). Before each step the update
        may end: on a stop request (:meth:`stop_requested`; the steps taken stand), or
        once KL(rollout || current) passes the target (:meth:`sync_target_kl_stop`).
        Afterwards the adaptive KL weight is steered (:meth:`sync_adapt_kl`).
        ``settings`` (default: the algorithm's config) gives ``epochs``,
        ``minibatch_size``, ``clip_range``, ``entropy_coef``, ``target_kl`` and
        ``max_grad_norm``, and may give ``microbatch_size`` (turns per forward and
        backward pass within a step; see :meth:`_accumulate`). An update without turns
        runs no epoch. Where the model trains only its top layers (``model.lora_layers``),
        the layers below run at most once per turn (:meth:`keep_trunk`), not in every pass.
        """
        if settings is None:
            settings = cast(ClippedSettings, self.config)
        if self.optimizer is None:
            raise RuntimeError(f"{type(self).__name__} has no optimizer to take steps with")
        optimizer = self.optimizer
        # No gradients, so no activations kept: a whole minibatch per pass.
        self.keep_trunk(turns, settings.minibatch_size)
        kl_coef = self.kl.coef if self.kl is not None else 0.0
        # The reference never moves during the update: score it once.
        reference = None
        if kl_coef > 0 and turns:
            chunk = getattr(settings, "microbatch_size", None) or settings.minibatch_size
            reference = self.reference_logprob_lists(turns, chunk)
        sums = zero_metrics(extra_losses)
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
                gradients = self._accumulate(
                    turns, index, advantages, reference, extra_losses, settings, kl_coef
                )
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
        if kl_coef > 0:  # on every process, even one without turns
            self.sync_adapt_kl(averages["kl_ref"], len(turns))
        return Optimisation(averages, steps, epochs_run, stopped, interrupted)

    def _accumulate(
        self,
        turns: Sequence[Turn],
        index: list[int],
        advantages: torch.Tensor,
        reference: list[list[float]] | None,
        extra_losses: Sequence[LossTerm],
        settings: ClippedSettings,
        kl_coef: float,
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
        values = zero_metrics(extra_losses)
        finite = True
        for number, piece in enumerate(pieces):
            share = len(piece) / len(index)
            batch = [turns[i] for i in piece]
            new = self.evaluate(batch)
            width = new.logprobs.shape[1]
            surrogate = clipped_surrogate(
                new, self.old_logprobs(batch, width), advantages[piece], settings.clip_range
            )
            values["approx_kl"] += share * surrogate.approx_kl
            values["clip_fraction"] += share * surrogate.clip_fraction
            last = number == len(pieces) - 1
            if last and self.sync_target_kl_stop(values["approx_kl"], settings.target_kl):
                optimizer.zero_grad(set_to_none=True)
                return None
            loss = surrogate.loss
            values["policy_loss"] += share * surrogate.loss.item()
            for term in extra_losses:
                value = term.compute(piece, new)
                loss = loss + term.weight * value
                values[term.name] += share * value.item()
            entropy = masked_mean(new.entropy, new.mask)
            loss = loss - settings.entropy_coef * entropy
            values["entropy"] += share * entropy.item()
            if reference is not None:
                reference_t = self.padded([reference[i] for i in piece], width)
                kl_ref = reference_kl(new.logprobs, reference_t, new.mask)
                loss = loss + kl_coef * kl_ref
                values["kl_ref"] += share * kl_ref.item()
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


def history_groups(turns: Sequence[Turn]) -> list[list[int]]:
    """The turns that minibatches keep together, as positions in ``turns``: a turn whose
    prompt starts with another's (the turns of one episode with its history) joins that
    one's group, so a pass runs their shared tokens once (:func:`prefix_rows`); every
    other turn is a group of its own. Groups come in the order of their first turn
    (without history, ``[[0], [1], ...]``: shuffling them is shuffling the turns)."""
    ordered = sorted(range(len(turns)), key=lambda i: turns[i].prompt_tokens)
    group_of = list(range(len(turns)))
    for before, after in zip(ordered, ordered[1:], strict=False):
        first, then = turns[before].prompt_tokens, turns[after].prompt_tokens
        if len(first) < len(then) and then[: len(first)] == first:
            group_of[after] = group_of[before]
    groups: dict[int, list[int]] = {}
    for index in range(len(turns)):
        groups.setdefault(group_of[index], []).append(index)
    return sorted(groups.values(), key=lambda group: group[0])


def prompt_pieces(turns: Sequence[Turn], index: Iterable[int], size: int) -> list[list[int]]:
    """``index`` (positions in ``turns``) cut into forward passes of at most ``size``
    turns, in the order of their prompts, so turns that share a prompt go through the
    same pass: the policy computes a prompt, and a reply repeated after it, once per
    pass (a seed group's episodes all start from one prompt, and a small action space
    repeats replies)."""
    ordered = sorted(index, key=lambda i: turns[i].prompt_tokens)
    return [ordered[start : start + size] for start in range(0, len(ordered), size)]


# -- losses ---------------------------------------------------------------------------
def zero_metrics(extra_losses: Sequence[LossTerm]) -> dict[str, float]:
    """The metrics of a clipped-policy-gradient step, each at 0, in their report order."""
    metrics = {"policy_loss": 0.0, **{term.name: 0.0 for term in extra_losses}}
    metrics.update(entropy=0.0, kl_ref=0.0, approx_kl=0.0, clip_fraction=0.0)
    return metrics


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over each row's unmasked units, then over rows (long replies don't dominate)."""
    per_row = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_row.mean()


@dataclass
class Surrogate:
    loss: torch.Tensor  # the clipped surrogate, to minimise
    approx_kl: float  # KL(rollout || current) on this minibatch, ((r - 1) - log r)
    clip_fraction: float  # share of units whose ratio left [1 - eps, 1 + eps]


def clipped_surrogate(
    new: Evaluation, old_logprobs: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> Surrogate:
    """PPO's clipped objective per action unit; ``advantages`` is one number per turn.

    At the first step after a rollout the ratio is 1 and this is the plain policy
    gradient, so REINFORCE-style algorithms take the same path and stay safe over epochs.
    """
    log_ratio = (new.logprobs - old_logprobs) * new.mask
    ratio = log_ratio.exp()
    advantage = advantages[:, None]
    surrogate = torch.max(
        -advantage * ratio, -advantage * ratio.clamp(1 - clip_range, 1 + clip_range)
    )
    with torch.no_grad():
        approx_kl = masked_mean((ratio - 1) - log_ratio, new.mask).item()
        clipped = ((ratio - 1).abs() > clip_range).float()
        clip_fraction = masked_mean(clipped, new.mask).item()
    return Surrogate(masked_mean(surrogate, new.mask), approx_kl, clip_fraction)


def reference_kl(
    new_logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """KL(current || reference) per unit with the non-negative ``k3`` estimator
    (exp(d) - 1 - d, d = log ref - log current), as in GRPO and TRL."""
    delta = (reference_logprobs - new_logprobs) * mask
    return masked_mean(delta.exp() - 1 - delta, mask)


def minibatches(order: Sequence[int], size: int, count: int) -> list[list[int]]:
    """The first ``count`` minibatches of ``size`` indices of ``order`` (the last may be
    shorter); ``count`` comes from :meth:`Algorithm.sync_minibatch_count`."""
    return [list(order[k * size : (k + 1) * size]) for k in range(count)]


class KLController:
    """The weight of the KL-to-reference penalty: fixed, or steered towards a target KL
    with the proportional controller of Ziegler et al. (2019), sec. 2.2:
    ``coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon``."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10_000):
        self.coef, self.target, self.horizon = coef, target, horizon

    @classmethod
    def from_config(cls, config: Any) -> KLController:
        """From a config's ``kl_coef``, ``adaptive_kl_target`` and ``adaptive_kl_horizon``."""
        return cls(config.kl_coef, config.adaptive_kl_target, config.adaptive_kl_horizon)

    def update(self, measured_kl: float, samples: float) -> None:
        """Steer by ``measured_kl`` over ``samples`` turns (with several processes, what
        they agreed on: :meth:`Algorithm.sync_adapt_kl`). A fixed weight, or a measure
        that is not finite, leaves it as it is."""
        if self.target is None or not math.isfinite(measured_kl):
            return
        error = min(max(measured_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * samples / self.horizon

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])


# -- bookkeeping ------------------------------------------------------------------------
def seed_groups(episodes: Sequence[Episode]) -> list[list[Episode]]:
    """Episodes grouped by the seed group the engine gave them, in batch order.

    Episodes without a group (the LlamaGym ``act``/``terminate_episode`` loop, which
    does not seed resets) form one group together: a batch-level baseline is the best
    that can be done for them.
    """
    groups: dict[int | None, list[Episode]] = {}
    for episode in episodes:
        groups.setdefault(episode.group, []).append(episode)
    return list(groups.values())


def chosen_actions(turns: Sequence[Turn]) -> list[int]:
    """The index of the legal action each turn took (score mode's chosen candidate)."""
    chosen = []
    for turn in turns:
        if turn.action_index is None:
            raise ValueError(
                "a turn with no chosen action (action_index None) cannot be trained on"
            )
        chosen.append(turn.action_index)
    return chosen


def rng_state(rng: random.Random) -> list:
    """A ``random.Random`` state as JSON-able lists."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def set_rng_state(rng: random.Random, state: Sequence) -> None:
    version, internal, gauss = state
    rng.setstate((version, tuple(internal), gauss))


def rollout_metrics(episodes: Sequence[Episode]) -> dict[str, float]:
    turns = sum(len(e.turns) for e in episodes)
    return {
        "episodes": float(len(episodes)),
        "return_mean": sum(e.env_return for e in episodes) / max(1, len(episodes)),
        "invalid_rate": sum(e.invalid_replies for e in episodes) / max(1, turns),
        "episode_length": turns / max(1, len(episodes)),
    }
