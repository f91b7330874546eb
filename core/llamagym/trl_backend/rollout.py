"""The TRL backend's rollout: LlamaGym's engine plays the episodes TRL asks for, and
each episode goes back to TRL as one append-only token sequence with its env mask,
its sampling log-probabilities (under vLLM) and a key its reward is checked against."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llamagym.algorithms.algorithm import rollout_metrics
from llamagym.errors import LlamaGymError
from llamagym.models.chat_template import render_chat
from llamagym.models.generation import json_closed_at, reply_prefixes
from llamagym.models.policy import Policy, Replies
from llamagym.rollout.engine import RolloutEngine
from llamagym.rollout.slots import Slot
from llamagym.rollout.trajectory import Episode, Turn
from llamagym.trl_backend.settings import seed_of
from llamagym.trl_backend.sharded import whole_model


# -- episodes as sequences ------------------------------------------------------------------
class SequenceEngine(RolloutEngine):
    """A rollout engine whose episodes are append-only token sequences: every turn's
    prompt is the sequence so far (earlier prompts and the sampled reply tokens as they
    were), then the tokens the chat template adds before the next reply. A native run
    renders each turn's prompt afresh instead; the TRL backend needs the model to have
    acted on exactly the tokens that are trained."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: id(slot) -> (slot, its sequence so far, the template text it renders)
        self._sequences: dict[int, tuple[Slot, list[int], str]] = {}
        self._rendered: list[str] = []

    def render_prompts(
        self, slots: Sequence[Slot], prefixes: Sequence[str] | None = None
    ) -> tuple[list[str], list[list[int]], list[list[dict[str, str]]]]:
        user_texts, ids, conversations = super().render_prompts(slots, prefixes)
        tokenizer = self.policy.tokenizer
        texts = render_chat(tokenizer, conversations)
        for row, slot in enumerate(slots):
            state = self._sequences.get(id(slot))
            if state is None or state[0] is not slot:
                continue  # a first turn: the template's own tokens
            _, sequence, so_far = state
            text = texts[row]
            if not text.startswith(so_far):
                raise LlamaGymError(
                    "the model's chat template renders an earlier turn differently once "
                    "the next one follows, so an episode cannot be trained as one "
                    "sequence; use the native backend for this model"
                )
            between = tokenizer(text[len(so_far) :], add_special_tokens=False)["input_ids"]
            if sequence and between and sequence[-1] == between[0] == self.policy.eos_id:
                between = between[1:]  # the reply already ended its turn
            ids[row] = sequence + between
        self._rendered = list(texts)
        return user_texts, ids, conversations

    def decide(
        self,
        slots: Sequence[Slot],
        greedy: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Turn]:
        turns = super().decide(slots, greedy, should_stop)
        for slot, turn, text in zip(slots, turns, self._rendered, strict=True):
            self._sequences[id(slot)] = (
                slot,
                turn.prompt_tokens + turn.action_tokens,
                text + turn.reply,
            )
        return turns

    def collect(self, *args: Any, **kwargs: Any) -> list[Episode]:
        try:
            return super().collect(*args, **kwargs)
        finally:
            self._sequences.clear()


@dataclass
class EpisodeSequence:
    prompt_ids: list[int]
    completion_ids: list[int]
    env_mask: list[int]
    #: per completion token: the sampler's log-probability of a reply token, NaN for
    #: the environment's and the template's (TRL leaves those uncorrected)
    logprobs: list[float]


def episode_sequence(episode: Episode, eos_id: int) -> EpisodeSequence:
    """One episode as TRL's (prompt, completion, env_mask): the first turn's prompt,
    then per turn the tokens between the previous reply and this one (mask 0) and the
    reply (mask 1); an end-of-turn token closes it (mask 0) unless the last reply did."""
    if not episode.turns:
        raise LlamaGymError("an episode without turns cannot be trained")
    first = episode.turns[0]
    completion: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    so_far = list(first.prompt_tokens)
    for position, turn in enumerate(episode.turns):
        if position:
            prompt = turn.prompt_tokens
            if prompt[: len(so_far)] != so_far:
                raise LlamaGymError(
                    f"turn {position + 1} of an episode does not extend the turns before it"
                )
            between = prompt[len(so_far) :]
            completion += between
            mask += [0] * len(between)
            logprobs += [math.nan] * len(between)
        completion += turn.action_tokens
        mask += [1] * len(turn.action_tokens)
        sampled = list(turn.logprobs)[: len(turn.action_tokens)]
        logprobs += sampled + [math.nan] * (len(turn.action_tokens) - len(sampled))
        so_far = turn.prompt_tokens + turn.action_tokens
    if not completion or completion[-1] != eos_id:
        completion.append(eos_id)
        mask.append(0)
        logprobs.append(math.nan)
    return EpisodeSequence(list(first.prompt_tokens), completion, mask, logprobs)


class _Sampler:
    """The rollout side of a :class:`~llamagym.models.policy.Policy` for TRL: it samples
    replies (with TRL's vLLM engine when ``trl.use_vllm`` is on, else the policy's
    ``generate``); TRL computes every log-probability it trains on itself, and corrects
    by vLLM's own where vLLM sampled."""

    def __init__(self, policy: Any, vllm: Any = None):
        self.policy = policy
        self.vllm = vllm
        self.tokenizer = policy.tokenizer
        self.eos_id = policy.eos_id
        self.max_context = policy.max_context

    def generate(self, prompts: Sequence[Sequence[int]], **settings: Any) -> Replies:
        if self.vllm is None:
            return self.policy.generate(prompts, **settings)
        if settings.get("reply_trees") is not None:
            raise LlamaGymError("rollout.legal_replies holds replies to the legal actions "
                                "through the model's own generate, which vLLM does not run: "
                                "set trl.use_vllm=false, or rollout.legal_replies=false")
        # vLLM samples with the run's temperature, top-p and top-k (GRPOConfig's) for
        # max_new_tokens (its max_completion_length); a reply ends as the policy's do.
        # Its log-probabilities (top-1: the sampled token's, after temperature and the
        # other processors) are kept per reply token for TRL's importance-sampling
        # correction (see EpisodeRollouts.__call__).
        _, completions, logprobs, _ = self.vllm.generate(
            prompts=[list(prompt) for prompt in prompts], images=None, num_generations=1
        )
        prefixes = reply_prefixes(settings.get("reply_prefix", ""), len(prompts))
        replies, kept = [], []
        for completion, token_logprobs, prefix in zip(
            completions, logprobs, prefixes, strict=True
        ):
            reply = list(completion)
            if self.eos_id in reply:
                reply = reply[: reply.index(self.eos_id) + 1]
            reply = json_closed_at(self.tokenizer, reply, prefix)
            replies.append(reply)
            kept.append([float(top[0]) for top in token_logprobs[: len(reply)]])
        return Replies(replies, kept, [0.0] * len(replies))

    def score(self, *args: Any, **kwargs: Any) -> Any:
        raise LlamaGymError("score mode does not run under the TRL backend")


class EpisodeRollouts:
    """TRL's rollout function and reward function, over one agent's environments."""

    def __init__(self, agent: Any, tokenizer: Any, seed: int):
        self.agent = agent
        self.tokenizer = tokenizer
        self.seed = seed
        self.engine: SequenceEngine | None = None
        self._model: Any = None
        #: key -> (episode, its completion tokens), until its reward is read
        self.pending: dict[int, tuple[Episode, list[int]]] = {}
        self._next_key = 0
        #: the episodes played since the metrics were last written
        self.played: list[Episode] = []
        self.env_steps = 0
        self.episodes = 0
        self.rollout_seconds = 0.0

    def _engine_for(self, model: Any, vllm: Any = None) -> SequenceEngine:
        """The engine over ``model``, built once (the same object TRL trains)."""
        if self.engine is None or self._model is not model:
            training = model.training
            policy = Policy(model, self.tokenizer)
            model.train(training)  # TRL reads train/eval mode from the model
            self.close()  # the envs of an engine over an earlier model
            self.engine = SequenceEngine(
                self.agent,
                _Sampler(policy, vllm),
                self.agent.config.rollout,
                seed=self.seed,
                max_failures_in_a_row=self.agent.config.training.max_env_failures,
            )
            self._model = model
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:

        seeds = [seed_of(prompt) for prompt in prompts]
        started = time.perf_counter()
        episodes: dict[int, Episode] = {}
        # A sharded model's parameters are gathered once for all the turns, since the
        # processes play different numbers of forward passes (see trl_backend/sharded.py).
        with whole_model(trainer) as model:
            vllm = trainer.vllm_generation if trainer.use_vllm else None
            engine = self._engine_for(model, vllm)
            steps_before = engine.stats.env_steps
            training = model.training
            model.eval()
            try:
                with torch.no_grad():
                    while len(episodes) < len(seeds):
                        # An episode an env failure dropped is played again with its seed.
                        wanted = [k for k in range(len(seeds)) if k not in episodes]
                        for episode in engine.play(len(wanted), seeds=[seeds[k] for k in wanted]):
                            episodes[wanted[int(episode.group or 0)]] = episode
            finally:
                model.train(training)
        self.rollout_seconds += time.perf_counter() - started
        self.env_steps += engine.stats.env_steps - steps_before
        self.episodes += len(seeds)
        output: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "env_mask": [],
            "episode_key": [],
            "logprobs": [],
        }
        for k in range(len(seeds)):
            episode = episodes[k]
            sequence = episode_sequence(episode, engine.policy.eos_id)
            key = self._next_key
            self._next_key += 1
            self.pending[key] = (episode, sequence.completion_ids)
            output["prompt_ids"].append(sequence.prompt_ids)
            output["completion_ids"].append(sequence.completion_ids)
            output["env_mask"].append(sequence.env_mask)
            output["logprobs"].append(sequence.logprobs)
            output["episode_key"].append(key)
            self.played.append(episode)
        # vLLM's sampling log-probabilities, for TRL's importance-sampling correction
        # (GRPOTrainer._generate_and_score_completions: the difference to the training
        # model's own, over the tokens env_mask marks); without vLLM TRL reads none.
        if vllm is None:
            output["logprobs"] = None  # type: ignore[assignment]
        return output

    def reward(
        self,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        episode_key: list[int],
        seed: list[int],
        **_: Any,
    ) -> list[float]:
        """Each row's reward: the return (with shaping and penalties, what a native run
        trains on) of the episode that produced the row's tokens, checked."""
        rewards = []
        for row, key in enumerate(episode_key):
            episode, tokens = self.pending.pop(int(key))
            if list(completion_ids[row]) != tokens or episode.seed != int(seed[row]):
                raise LlamaGymError(
                    f"row {row} of a TRL batch is paired with another episode's tokens; "
                    "its reward would be another episode's return"
                )
            rewards.append(float(episode.total_reward))
        return rewards

    def take_metrics(self) -> dict[str, float]:
        """Rollout metrics over the episodes played since the last call."""
        played, self.played = self.played, []
        metrics = rollout_metrics(played) if played else {}
        if self.rollout_seconds:
            metrics["env_steps_per_second"] = self.env_steps / self.rollout_seconds
        return metrics


#: TRL's log keys and the LlamaGym metric each one means.
