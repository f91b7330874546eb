"""SFT warm-start: supervised steps on a JSONL file of demonstrations before RL starts,
and on the best episodes seen so far between RL updates.

Every built-in algorithm's config has a ``warm_start`` section (:class:`WarmStartConfig`,
``--set algorithm.warm_start.lr=1e-3``); an algorithm builds a :class:`WarmStart` from
it. The demonstrations are a phase of their own: a fresh run calls
``Algorithm.warm_start()`` before the first update (then ``freeze_reference()``, so the
KL reference is the policy they taught); ``after_update`` runs at the end of each update.
The demonstrations are a file (``demonstrations``) or one of the agent's baselines
(``baseline``): a training run records that baseline's successful episodes into its
directory (:mod:`llamagym.training.loop.baseline_warm_start`) and builds its algorithm
with that file as its ``demonstrations``.

The loss is the masked cross-entropy of the action only, through the same forward pass
RL uses (``Algorithm.evaluate``): in score mode ``-log pi(chosen | legal actions)``, a
cross-entropy over the candidates; in generate mode the mean ``-log p`` of the reply
tokens, the prompt never being a target.

Why not TRL's ``SFTTrainer``: each call builds a full ``transformers.Trainer`` (a
``datasets.Dataset``, accelerate state, its own optimizer, scheduler, callbacks and
logging) for what is here a handful of steps on a few dozen turns, several times a
minute; it would also wrap the model again (PEFT), and it has no way to say "the
cross-entropy over these legal actions", which is score mode's loss. A small masked-loss
step on the same model object costs nothing extra, works for LoRA and full fine-tuning
alike, and keeps all its state (its own Adam, the buffer) in the algorithm's
``state_dict``.

The demonstrations file's format, and how its lines become turns:
:mod:`llamagym_builtins.demonstrations_file`.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from llamagym.algorithms.losses import masked_mean
from llamagym.errors import ConfigError
from llamagym.rollout.demonstrations import MAX_BASELINE_EPISODES
from llamagym.rollout.trajectory import Episode, Turn
from llamagym_builtins.demonstrations_file import (
    Demonstration,
    choice_turns,
    demonstration_turns,
    load_demonstrations,
)

if TYPE_CHECKING:
    from llamagym.algorithms.algorithm import Algorithm

logger = logging.getLogger(__name__)


class WarmStartConfig(BaseModel):
    """The ``algorithm.warm_start`` section: supervised steps with their own Adam."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    replay: bool = Field(
        False, description="After each RL update, supervised steps on the best episodes so far."
    )
    buffer_size: int = Field(256, ge=1, description="Episodes the replay buffer keeps.")
    top_k: int = Field(16, ge=1, description="Best episodes of each batch offered to it.")
    min_return: float | None = Field(
        None, description="Only episodes with a return above this enter the buffer."
    )
    replay_per: str | None = Field(
        None,
        max_length=100,
        description="An info key naming the task an episode played (TextWorld's "
        "game_index): the buffer keeps the best episode of each task, so every game "
        "someone won stays taught, not only the easiest.",
    )
    steps: int = Field(1, ge=0, description="Supervised steps after each RL update.")
    batch_size: int = Field(32, ge=1, description="Turns per supervised step.")
    # 1e-3 and 4 passes: what teaches a pretrained model through its LoRA adapter (on
    # SmolLM2-135M, 400 decisions of the vault game's expert: 100% of greedy games won
    # after the warm start, where 1e-4 and one pass left it at 15%).
    lr: float = Field(1e-3, gt=0, le=10, description="Learning rate of the supervised Adam.")
    demonstrations: Path | None = Field(
        None, description="JSONL of demonstrations to train on before RL starts."
    )
    demonstration_epochs: int = Field(
        4, ge=1, le=1000, description="Passes over the demonstrations before RL."
    )
    baseline: str | None = Field(
        None,
        max_length=100,
        description="One of the agent's baselines to warm-start from (llamagym run "
        "--warm-start NAME), or expert: the agent's expert_baseline (a solver, an oracle, "
        "a bot), else its one baseline besides random. A training run plays it for "
        "baseline_episodes episodes, records the decisions of its successful ones (those "
        "that end in the agent's first named outcome: Blackjack's win, TextWorld's won; for "
        "an agent that names no outcomes, a return above 0) as the run's model sees them "
        "in its mode, writes them to demonstrations.jsonl in the run directory and trains "
        "on them first, as on demonstrations. A resumed run records nothing: it reads "
        "that file again.",
    )
    baseline_episodes: int = Field(
        100,
        ge=1,
        le=MAX_BASELINE_EPISODES,
        description="Episodes of the baseline played for its warm start (seeds of their "
        "own, never the final evaluation's); only the successful ones are kept.",
    )

    @field_validator("demonstrations")
    @classmethod
    def _file_exists(cls, path: Path | None) -> Path | None:
        if path is not None and not path.is_file():
            raise ValueError(f"no demonstrations file at {str(path)!r}")
        return path

    @field_validator("baseline")
    @classmethod
    def _one_source(cls, baseline: str | None, info: ValidationInfo) -> str | None:
        """Declared after ``demonstrations``: a warm start trains on one of them."""
        if baseline is not None and info.data.get("demonstrations") is not None:
            raise ValueError(
                "a warm start trains on one set of demonstrations: a baseline's (recorded "
                "by the run) or a file's (demonstrations); unset one of them"
            )
        return baseline


# -- the replay buffer -----------------------------------------------------------------
def episode_return(episode: Episode) -> float:
    """What the buffer ranks by: the learner's return (env reward plus penalties), so a
    win reached through an unparsable reply ranks below a clean one."""
    return episode.total_reward


class ReplayBuffer:
    """The best episodes seen so far, at most ``capacity`` of them; with ``per`` (a key
    of the episodes' info), only the best of each value of it (each game's best).

    A min-heap keyed by (return, arrival): when full, the worst episode leaves, and among
    equals the oldest, so the buffer drifts towards what the current policy does.
    """

    def __init__(self, capacity: int, min_return: float | None = None, per: str | None = None):
        self.capacity, self.min_return, self.per = capacity, min_return, per
        self._heap: list[tuple[float, int, Episode]] = []
        self._arrivals = 0

    def __len__(self) -> int:
        return len(self._heap)

    def offer(self, episodes: Sequence[Episode], top_k: int) -> int:
        """Add the ``top_k`` best of ``episodes`` that pass the bar; returns how many stayed."""
        ranked = sorted(episodes, key=episode_return, reverse=True)[:top_k]
        added = []
        for episode in ranked:
            score = episode_return(episode)
            if self.min_return is not None and score <= self.min_return:
                continue
            if not any(turn.valid for turn in episode.turns):
                continue  # nothing in it worth imitating
            if self.per is not None and not self._best_of_its_task(episode, score):
                continue
            entry = (score, self._arrivals, episode)
            self._arrivals += 1
            heapq.heappush(self._heap, entry)
            added.append(entry[1])
        while len(self._heap) > self.capacity:
            heapq.heappop(self._heap)
        kept = {arrival for _, arrival, _ in self._heap}
        return sum(arrival in kept for arrival in added)

    def _best_of_its_task(self, episode: Episode, score: float) -> bool:
        """Whether ``episode`` is at least as good as the kept one of its task; if so, that
        one leaves (the newer of equals stays)."""
        assert self.per is not None
        if self.per not in episode.info:
            raise ConfigError(
                f"algorithm.warm_start.replay_per={self.per!r}: the episodes' info has no "
                f"such key; it has {sorted(episode.info)[:20]}. Name one of them (the "
                "task an episode played, e.g. game_index) or unset replay_per"
            )
        task = episode.info[self.per]
        for index, (kept, _, other) in enumerate(self._heap):
            if other.info.get(self.per) == task:
                if kept > score:
                    return False
                self._heap.pop(index)
                heapq.heapify(self._heap)
                break
        return True

    def returns(self) -> list[float]:
        return sorted((score for score, _, _ in self._heap), reverse=True)

    def turns(self) -> list[Turn]:
        """The valid turns of every kept episode (an unparsable reply is never a target)."""
        return [turn for _, _, episode in self._heap for turn in episode.turns if turn.valid]

    def state_dict(self) -> dict:
        return {
            "arrivals": self._arrivals,
            "entries": [
                {"return": score, "arrival": arrival, "episode": dataclasses.asdict(episode)}
                for score, arrival, episode in self._heap
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        self._arrivals = int(state["arrivals"])
        self._heap = []
        for entry in state["entries"]:
            episode = Episode.from_dict(entry["episode"])
            self._heap.append((float(entry["return"]), int(entry["arrival"]), episode))
        heapq.heapify(self._heap)


# -- the supervised steps --------------------------------------------------------------
class WarmStart:
    """The replay buffer and the supervised optimizer of one algorithm."""

    def __init__(self, algorithm: Algorithm, config: WarmStartConfig):
        self.algorithm = algorithm
        self.config = config
        self.buffer = ReplayBuffer(config.buffer_size, config.min_return, config.replay_per)
        # Its own Adam: the supervised loss has another scale than the RL one, and
        # sharing moment estimates would let one disturb the other's step sizes.
        self.optimizer = torch.optim.Adam(algorithm.model_parameters(), lr=config.lr)
        self.steps = 0
        self.demonstrations_done = False
        self.demonstration_batches: int | None = None  # None: not trained on yet

    @classmethod
    def create(cls, algorithm: Algorithm, config: WarmStartConfig) -> WarmStart | None:
        """The warm start ``config`` asks for, or None when it asks for none."""
        if not config.replay and config.demonstrations is None:
            return None
        return cls(algorithm, config)

    @torch.enable_grad()
    def supervised_step(self, turns: Sequence[Turn]) -> float:
        """One masked cross-entropy step on the actions of ``turns``; returns the loss.
        Score mode's policy is the one that acts now (the schedule's temperature). It
        takes its gradients even when called under ``torch.no_grad()`` (a run built
        inside an evaluation trains its demonstrations all the same)."""
        algorithm = self.algorithm
        evaluation = algorithm.scoring.evaluate(
            turns, temperature=algorithm.schedule.temperature()
        )
        loss = -masked_mean(evaluation.logprobs, evaluation.mask)
        max_grad_norm = float(getattr(algorithm.config, "max_grad_norm", 1.0))
        if algorithm.step(self.optimizer, loss, max_grad_norm):
            self.steps += 1
        return loss.item()

    def demonstration_turns(self, demonstrations: Sequence[Demonstration]) -> list[Turn]:
        """The file's decisions as turns of this run's mode: in score mode, recordings
        that name their legal actions become choices among them; other demonstrations
        are replies, their tokens the target."""
        policy, rollout = self.algorithm.policy, self.algorithm.rollout
        named = sum(d.legal_actions is not None for d in demonstrations)
        if rollout.mode == "score" and named == len(demonstrations):
            return choice_turns(
                demonstrations, policy.tokenizer, policy.max_context, policy.eos_id
            )
        if rollout.mode == "score" and named:
            raise ConfigError(
                f"{named:,} of {len(demonstrations):,} demonstrations name their legal "
                "actions and the others do not: record them in one mode (llamagym record "
                "--mode score) and train on one file of them"
            )
        if rollout.mode == "score":
            logger.warning(
                "the demonstrations name no legal actions (recorded in generate mode): a "
                "score-mode run trains them as replies; `llamagym record --mode score` "
                "records the choices score mode makes"
            )
        return demonstration_turns(
            [d.messages for d in demonstrations], policy.tokenizer, policy.max_context,
            reply_prefix=rollout.reply_prefix if rollout.mode == "generate" else "",
        )

    def train_on_demonstrations(self) -> dict[str, float]:
        """Before RL: ``demonstration_epochs`` passes over the demonstrations file, ended
        early where the run's :class:`~llamagym.schedule.WarmStartLimit` says (a warm
        start may spend half of a time budget; a resumed run takes the batches its run
        took)."""
        path = self.config.demonstrations
        if path is None or self.demonstrations_done:
            return {}
        turns = self.demonstration_turns(load_demonstrations(path))
        losses: list[float] = []
        size = self.config.batch_size
        limit = self.algorithm.control.warm_start
        batches_per_epoch = -(-len(turns) // size)
        for _ in range(self.config.demonstration_epochs):
            order = list(range(len(turns)))
            self.algorithm.rng.shuffle(order)
            for start in range(0, len(order), size):
                if limit.reached(len(losses)):
                    break
                batch = [turns[i] for i in order[start : start + size]]
                losses.append(self.supervised_step(batch))
        self.demonstrations_done = True
        self.demonstration_batches = len(losses)
        planned = batches_per_epoch * self.config.demonstration_epochs
        if len(losses) < planned:
            logger.warning(
                "warm start: stopped after %d of %d batches (%.1f of %d passes over the "
                "demonstrations), %s; fewer demonstrations (algorithm.warm_start."
                "baseline_episodes) or a larger budget (--minutes) let it finish",
                len(losses), planned, len(losses) / max(batches_per_epoch, 1),
                self.config.demonstration_epochs,
                "as the run it continues did" if limit.batches is not None
                else "at the share of the time budget a warm start may take",
            )
        if not losses:
            return {}
        logger.info(
            "warm start on %d demonstrations: loss %.3f -> %.3f", len(turns), losses[0], losses[-1]
        )
        return {"sft_demo_loss_first": losses[0], "sft_demo_loss_last": losses[-1],
                "sft_demo_batches": float(len(losses))}

    def after_update(self, episodes: Sequence[Episode]) -> dict[str, float]:
        """Offer the batch's best episodes to the buffer, then ``steps`` steps on it;
        every process takes as many steps as the one with the fewest (a collective)."""
        if not self.config.replay:
            return {}
        self.buffer.offer(episodes, self.config.top_k)
        turns = self.buffer.turns()
        losses = []
        # The same number of steps on every process (each has its own buffer).
        steps = self.algorithm.group.all_min(self.config.steps if turns else 0)
        interrupted = False
        for _ in range(steps):
            if self.algorithm.stop_requested():
                interrupted = True  # a stop was asked for (see Algorithm.control)
                break
            size = min(self.config.batch_size, len(turns))
            losses.append(self.supervised_step(self.algorithm.rng.sample(turns, size)))
        metrics = {"sft_buffer_episodes": float(len(self.buffer))}
        if interrupted:
            metrics["update_interrupted"] = 1.0
        if losses:
            metrics["sft_loss"] = sum(losses) / len(losses)
            metrics["sft_buffer_min_return"] = self.buffer.returns()[-1]
        return metrics

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "buffer": self.buffer.state_dict(),
            "steps": self.steps,
            "demonstrations_done": self.demonstrations_done,
            "demonstration_batches": self.demonstration_batches,
        }

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.buffer.load_state_dict(state["buffer"])
        self.steps = int(state["steps"])
        self.demonstrations_done = bool(state["demonstrations_done"])
        batches = state.get("demonstration_batches")  # absent in older checkpoints
        self.demonstration_batches = None if batches is None else int(batches)

