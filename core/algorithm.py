"""The base class of every training algorithm plugin, and the pieces the built-in ones
share (clipped surrogate, KL to the reference, target-KL stop, adaptive KL coefficient).

An algorithm gets finished episodes and changes the policy's weights. It owns its
optimizer; the rollout engine, hooks and loggers sit outside it. Everything it needs to
resume exactly (optimizer, counters, random state, parts such as a replay buffer) is
reachable from :meth:`Algorithm.state_dict`, as tensors or JSON-able values.

With several processes (``llamagym.distributed``) every process runs ``update`` on its
own episodes and :meth:`Algorithm.step` averages the gradients over the processes, so
every process must call ``step`` the same number of times: an algorithm takes its
number of minibatches per epoch from :meth:`Algorithm.minibatch_count` (the smallest
over the processes; the extra turns of a process with more are left out of that
epoch, a different random share each epoch) and stops early only on an agreed signal
(:func:`passes_target_kl` compares the largest KL of all processes). With one process
all of this is exactly the single-process computation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from llamagym import distributed
from llamagym.config import RolloutSettings
from llamagym.credit import unsupported_credit_message
from llamagym.policy import Evaluation, Policy, padded
from llamagym.trajectory import Episode, Turn

#: An update's remaining epochs stop once KL(rollout || current) passes this x target_kl.
TARGET_KL_TOLERANCE = 1.5


class AlgorithmConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    #: Credit rules the algorithm accepts; a config with a ``credit`` field is checked
    #: against them, so ``--set algorithm.credit=gae`` on GRPO fails before any loading.
    credit_rules: ClassVar[tuple[str, ...]] = ()

    @field_validator("credit", check_fields=False)
    @classmethod
    def _credit_is_supported(cls, rule: str) -> str:
        if cls.credit_rules and rule not in cls.credit_rules:
            name = cls.__name__.removesuffix("Config").lower()
            raise PydanticCustomError(
                "unsupported_credit", unsupported_credit_message(name, rule, cls.credit_rules)
            )
        return rule


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


class Algorithm:
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig
    #: Credit rules this algorithm accepts (mirrors its Config's; documented in credit.py).
    credit_rules: ClassVar[tuple[str, ...]] = ()

    def __init__(self, policy: Policy, config: AlgorithmConfig, rollout: RolloutSettings):
        self.policy = policy
        self.config = config
        self.rollout = rollout
        self.skipped_updates = 0
        self.updates = 0
        self.target_kl_stops = 0
        # Minibatch order and replay sampling; seeded from torch so a seeded run repeats.
        self.rng = random.Random(torch.initial_seed())
        self.optimizer: torch.optim.Optimizer | None = None  # set by each algorithm
        #: Fraction of the run's budget used so far, set by the trainer before each update
        #: (learning-rate and temperature schedules read it); stays 0 in a hand-written loop.
        self.progress = 0.0
        #: Set by the trainer for the length of a run (None otherwise). ``should_stop()``
        #: turns True once a stop has been asked for (SIGINT/SIGTERM): ``update`` then ends
        #: at the next minibatch boundary (:meth:`stop_requested`), keeping the steps
        #: already taken, and reports ``update_interrupted: 1.0``. ``on_epoch(k, epochs)``
        #: is told when epoch ``k`` of the update starts (the progress bar shows it).
        self.should_stop: Callable[[], bool] | None = None
        self.on_epoch: Callable[[int, int], None] | None = None

    def annealed_lr(self, lr: float, anneal: bool) -> float:
        """Linear decay to 5% of ``lr`` over the run: late updates stop undoing progress."""
        rate = lr * max(0.05, 1.0 - self.progress) if anneal else lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = rate
        return rate

    def stateful_parts(self) -> dict[str, Stateful | None]:
        """Named parts with their own state (KL controller, replay buffer...)."""
        return {}

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume this algorithm exactly."""
        state: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
            "counters": {
                "updates": self.updates,
                "skipped_updates": self.skipped_updates,
                "target_kl_stops": self.target_kl_stops,
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

    def update(self, episodes: list[Episode]) -> dict[str, float]:
        raise NotImplementedError

    # -- helpers shared by the algorithms -----------------------------------------
    def stop_requested(self) -> bool:
        """True when the update should end now, before its next minibatch. Checked
        between optimizer steps only, so the weights are always those after a whole
        number of steps (a valid state to checkpoint)."""
        return self.should_stop is not None and bool(self.should_stop())

    def epoch_started(self, epoch: int, epochs: int) -> None:
        """Report that epoch ``epoch`` (from 1) of ``epochs`` begins."""
        if self.on_epoch is not None:
            self.on_epoch(epoch, epochs)

    def evaluate(self, turns: Sequence[Turn]) -> Evaluation:
        """Current log-probabilities, entropy and values for ``turns`` (with gradients)."""
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            return self.policy.evaluate_choices(
                prompts,
                [turn.candidates for turn in turns],
                [turn.action_index for turn in turns],
                temperature=self.rollout.temperature_at(self.progress),
            )
        return self.policy.evaluate_replies(prompts, [turn.action_tokens for turn in turns])

    def old_logprobs(self, turns: Sequence[Turn], width: int) -> torch.Tensor:
        """The rollout-time log-probabilities, padded to ``width`` action units."""
        return self.padded([turn.logprobs for turn in turns], width)

    def padded(self, rows: Sequence[Sequence[float]], width: int) -> torch.Tensor:
        """Per-turn lists of per-unit numbers as a zero-padded [N, width] tensor."""
        return padded(rows, width, 0.0, dtype=torch.float32).to(self.policy.device)

    @torch.no_grad()
    def reference_logprobs(self, turns: Sequence[Turn]) -> torch.Tensor:
        """Log-probabilities of the chosen actions under the reference policy (the
        adapter switched off, or the frozen copy of a fully fine-tuned model)."""
        prompts = [turn.prompt_tokens for turn in turns]
        if turns[0].candidates:
            scores, _ = self.policy.score(prompts, [t.candidates for t in turns], reference=True)
            log_policy = (scores / self.rollout.temperature_at(self.progress)).log_softmax(-1)
            chosen = torch.tensor([t.action_index for t in turns], device=self.policy.device)
            return log_policy.gather(-1, chosen[:, None])
        replies = [turn.action_tokens for turn in turns]
        return self.policy.evaluate_replies(prompts, replies, reference=True).logprobs

    def reference_logprob_lists(self, turns: Sequence[Turn], chunk: int) -> list[list[float]]:
        """Reference log-probabilities of every turn, once per update (the reference
        never changes, so epochs reuse them), ``chunk`` turns per forward pass."""
        lists: list[list[float]] = []
        for start in range(0, len(turns), chunk):
            batch = turns[start : start + chunk]
            table = self.reference_logprobs(batch).cpu()
            for row, turn in enumerate(batch):
                units = 1 if turn.candidates else len(turn.action_tokens)
                lists.append(table[row, :units].tolist())
        return lists

    def model_parameters(self) -> list[torch.nn.Parameter]:
        """The language model's trainable parameters, without the value head (for the
        algorithms that have no critic)."""
        return [p for p in self.policy.model.parameters() if p.requires_grad]

    def minibatch_count(self, turns: int, size: int) -> int:
        """Gradient steps per epoch over ``turns`` turns in minibatches of ``size``:
        ``ceil(turns / size)``, the smallest over the processes when there are several."""
        return distributed.agreed_min(-(-turns // size))

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
        parameters = self.policy.trainable_parameters()
        if not distributed.average_gradients(parameters, finite):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return False
        norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
        if not math.isfinite(float(norm)):
            optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
            return False
        optimizer.step()
        return True


# -- losses ---------------------------------------------------------------------------
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
    shorter); ``count`` comes from :meth:`Algorithm.minibatch_count`."""
    return [list(order[k * size : (k + 1) * size]) for k in range(count)]


def passes_target_kl(approx_kl: float, target_kl: float | None) -> bool:
    """True when the update should stop: KL(rollout || current) past 1.5x the target,
    judged on the largest KL of all processes so they all stop at the same step."""
    if target_kl is None:
        return False
    return distributed.agreed_max(approx_kl) > TARGET_KL_TOLERANCE * target_kl


class KLController:
    """The weight of the KL-to-reference penalty: fixed, or steered towards a target KL
    with the proportional controller of Ziegler et al. (2019), sec. 2.2:
    ``coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * samples / horizon``."""

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10_000):
        self.coef, self.target, self.horizon = coef, target, horizon

    def update(self, measured_kl: float, samples: int) -> None:
        """Steer by ``measured_kl`` over ``samples`` turns; with several processes, by
        their turn-weighted mean KL and all their turns, so the weight stays the same on
        every process (each process must call this once per update)."""
        if self.target is None:
            return
        measured_kl, samples = distributed.weighted_mean(measured_kl, samples)
        if not math.isfinite(measured_kl):
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
