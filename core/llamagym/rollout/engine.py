"""The rollout engine: N environments in lockstep, one batched forward pass per step.

Each step renders every active env's prompt through the hooks and the tokenizer's chat
template, asks the policy once for all of them (score or generate mode), turns replies
into legal actions (extraction chain, then the invalid-action policy), and steps the
envs. The LlamaGym-style ``Agent.act`` drives the same :meth:`RolloutEngine.decide`
with one env, so there is one code path.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import string
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from llamagym.config import RolloutSettings
from llamagym.errors import EnvFailureError, LlamaGymError
from llamagym.models.chat_template import render_chat
from llamagym.models.policy import Policy, Replies, name_tokens
from llamagym.rollout.trajectory import Episode, Turn, info_summary
from llamagym.schedule import Schedule

if TYPE_CHECKING:
    from llamagym.agent import Agent

logger = logging.getLogger(__name__)

PROMPT_CACHE_TOKENS = 1_000_000  # about 8 MB of cached prompt ids at most

#: Each slot's key, naming its episode to the policy's turn cache.
_slot_keys = itertools.count()


class RolloutPolicy(Protocol):
    """What the engine asks of a policy: a tokenizer, the context length, and the
    batched passes that score candidates and that generate (and score) replies.
    :class:`~llamagym.models.policy.Policy` is one; a stand-in such as
    :class:`~llamagym.devtools.fake_model.FakePolicy` plays without a model. ``keys``
    name each row's episode in progress (its slot's key), so a policy may keep what a
    row's pass computed for the episode's next turn (Policy's turn cache); a policy
    with a ``drop_turn_cache(key)`` method is told when that episode is over."""

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def max_context(self) -> int: ...

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        candidates: Sequence[Sequence[Sequence[int]]],
        reference: bool = False,
        keys: Sequence[Hashable] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        greedy: bool = False,
        generator: torch.Generator | None = None,
        reply_prefix: str | Sequence[str] = "",
        should_stop: Callable[[], bool] | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> Replies: ...


def reply_closing(prefix: str) -> str:
    """What closes a reply started by ``prefix`` after its action's name: ``"}`` after an
    open JSON string (``{"action": "``), ``}`` after another opener."""
    return '"}' if prefix.rstrip().endswith('"') else "}"


def fill_reply_prefix(template: str, agent: Agent, observation: Any) -> str:
    """``template`` (a ``rollout.reply_prefix``) with its ``$name`` fields filled from
    ``agent.reply_fields(observation)``; ``$$`` is a dollar sign."""
    try:
        fields = agent.reply_fields(observation)
    except Exception as error:
        raise LlamaGymError(
            f"{type(agent).__name__}.reply_fields raised {type(error).__name__}: {error} for "
            f"the observation {observation!r}; rollout.reply_prefix {template!r} needs it "
            "for every observation"
        ) from error
    try:
        return string.Template(template).substitute(fields)
    except KeyError as missing:
        raise LlamaGymError(
            f"rollout.reply_prefix {template!r} names ${missing.args[0]}, which "
            f"{type(agent).__name__}.reply_fields does not give (it gives "
            f"{sorted(fields) or 'none'}): name one of those, or write $$ for a dollar sign"
        ) from None
    except ValueError as error:
        raise LlamaGymError(
            f"rollout.reply_prefix {template!r}: {error}; a $ starts a field name ($sum), "
            "write $$ for a dollar sign"
        ) from None


@dataclass
class Slot:
    """One environment's episode in progress. ``key`` names it to the policy, which
    keeps the slot's last turn's key/value cache under it (``Policy.turn_cache``) until
    the engine drops it (:meth:`RolloutEngine.end_slot`)."""

    observation: Any
    info: dict
    episode: Episode
    system_prompt: str
    history: list[dict[str, str]] = field(default_factory=list)
    key: int = field(default_factory=lambda: next(_slot_keys))


@dataclass
class RolloutStats:
    env_steps: int = 0
    env_failures: int = 0
    seconds_model: float = 0.0
    seconds_total: float = 0.0


class RolloutEngine:
    """Plays episodes with ``policy`` under ``settings``.

    ``schedule`` gives the sampling temperature (the run's schedule, moved by its owner;
    by default one of its own that stays at progress 0). ``max_failures_in_a_row``
    environment errors in a row end a collection with :class:`EnvFailureError`. With
    ``observe`` off, finished episodes are not passed to the ``llamagym_episode_end``
    hook (an evaluation's episodes are not training data for the observers).
    """

    def __init__(
        self,
        agent: Agent,
        policy: RolloutPolicy,
        settings: RolloutSettings,
        seed: int = 0,
        *,
        schedule: Schedule | None = None,
        max_failures_in_a_row: int = 10,
        observe: bool = True,
    ):
        self.agent = agent
        self.policy = policy
        self.settings = settings
        self.plugins = agent.plugins
        self.schedule = schedule if schedule is not None else Schedule(settings)
        self.max_failures_in_a_row = max_failures_in_a_row
        self.observe = observe
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = RolloutStats()
        self._candidate_cache: dict[str, list[int]] = {}
        self._reply_prefix_tokens: dict[str, list[int]] = {}
        self._greedy_memo: dict[tuple, Turn] | None = None
        self._prompt_cache: dict[tuple, list[int]] = {}
        self._prompt_cache_tokens = 0
        self._warned_long_prompt = False
        #: env failures in a row, across collections (a batch of dropped episodes is no
        #: success), reset by the first step an env completes
        self.failures_in_a_row = 0

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's random state: where the next episode seeds and samples come from.

        Episodes always start fresh from a drawn seed, so with this state restored a
        resumed run plays exactly the episodes the unbroken run would have. Everything
        else the engine keeps is a cache (prompt and candidate tokens), statistics the
        trainer reads as differences, or settings given to its constructor.
        """
        return {"rng": self.rng.bit_generator.state, "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state["rng"]
        self.generator.set_state(state["generator"])

    # -- prompts ---------------------------------------------------------------------
    def new_slot(self, observation: Any, info: dict, seed: int | None, group: int | None) -> Slot:
        return Slot(
            observation=observation,
            info=info,
            episode=Episode(seed=seed, group=group),
            system_prompt=self.plugins.system_prompt(self.agent),
        )

    def end_slot(self, slot: Slot) -> None:
        """The slot's episode is over (ended, dropped, or abandoned): the policy forgets
        the key/value cache it kept for it."""
        drop = getattr(self.policy, "drop_turn_cache", None)
        if drop is not None:
            drop(slot.key)

    def _messages(self, slot: Slot, user_text: str, history: list[dict]) -> list[dict]:
        messages = [{"role": "system", "content": slot.system_prompt}] if slot.system_prompt else []
        return messages + history + [{"role": "user", "content": user_text}]

    def _history(self, slot: Slot) -> list[dict]:
        keep = self.settings.history_turns
        if keep is None:
            return list(slot.history)
        return list(slot.history[len(slot.history) - 2 * keep :]) if keep else []

    def render_prompts(
        self, slots: Sequence[Slot], prefixes: Sequence[str] | None = None
    ) -> tuple[list[str], list[list[int]], list[list[dict[str, str]]]]:
        """User texts and prompt token ids; the oldest history turns go first if too long.
        In generate mode each prompt leaves room for its reply prefix (``prefixes``, the
        slots' :meth:`reply_prefixes` when the caller has them already) and the reply."""
        user_texts = [
            self._within_prompt_cap(
                self.plugins.format_observation(self.agent, slot.observation, slot.info)
            )
            for slot in slots
        ]
        histories = [self._history(slot) for slot in slots]
        cap = self.settings.max_prompt_chars
        for row, slot in enumerate(slots):
            # Bounded before the template renders or anything is tokenized.
            while histories[row] and _characters(slot, user_texts[row], histories[row]) > cap:
                histories[row] = histories[row][2:]
        conversations = [
            self._messages(slot, text, history)
            for slot, text, history in zip(slots, user_texts, histories, strict=True)
        ]
        ids = self.prompt_tokens(conversations)
        if self.settings.mode == "generate":
            if prefixes is None:
                prefixes = self.reply_prefixes(slots)
            rooms = [self.reply_room(prefix) for prefix in prefixes]
        else:
            rooms = [16] * len(slots)
        for row, prompt in enumerate(ids):
            # Never cut the system prompt or the current observation: drop old turns.
            while len(prompt) > self.policy.max_context - rooms[row] and histories[row]:
                histories[row] = histories[row][2:]
                conversations[row] = self._messages(slots[row], user_texts[row], histories[row])
                [prompt] = self.prompt_tokens([conversations[row]])
            ids[row] = prompt
        return user_texts, ids, conversations

    def _within_prompt_cap(self, text: str) -> str:
        """An observation's text, cut to ``rollout.max_prompt_chars`` (one warning per
        engine the first time one is longer)."""
        cap = self.settings.max_prompt_chars
        if len(text) <= cap:
            return text
        if not self._warned_long_prompt:
            self._warned_long_prompt = True
            logger.warning(
                "%s gave an observation of %s characters, more than rollout.max_prompt_chars"
                " = %s; such observations are cut to their first %s characters (raise "
                "rollout.max_prompt_chars if the model's context holds more)",
                self._env_name(),
                f"{len(text):,}",
                f"{cap:,}",
                f"{cap:,}",
            )
        return text[:cap]

    def _env_name(self) -> str:
        """The env as messages name it: agent and env id."""
        env_id = getattr(self.agent, "env_id", None)
        name = self.agent.name or type(self.agent).__name__
        return f"env {env_id!r} of agent {name!r}" if env_id else f"the env of agent {name!r}"

    def prompt_tokens(self, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
        """Token ids of each conversation through the chat template, with a generation
        prompt. Rendering is deterministic, so prompts seen before (a small state space
        repeats them constantly) come from a bounded cache."""
        keys = [tuple((m["role"], m["content"]) for m in c) for c in conversations]
        ids = [self._prompt_cache.get(key) for key in keys]
        missing = [row for row, found in enumerate(ids) if found is None]
        encoded_rows: dict[int, list[int]] = {}
        if missing:
            tokenizer = self.policy.tokenizer
            texts = render_chat(tokenizer, [conversations[row] for row in missing])
            encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
            for row, prompt in zip(missing, encoded, strict=True):
                encoded_rows[row] = prompt
                if self._prompt_cache_tokens + len(prompt) <= PROMPT_CACHE_TOKENS:
                    self._prompt_cache[keys[row]] = prompt
                    self._prompt_cache_tokens += len(prompt)
        return [
            list(encoded_rows[row] if prompt is None else prompt)
            for row, prompt in enumerate(ids)
        ]

    @property
    def progress(self) -> float:
        """The share of the run's budget used so far (the schedule's; read-only here)."""
        return self.schedule.progress

    @property
    def temperature(self) -> float:
        """The sampling temperature now (the schedule's)."""
        return self.schedule.temperature()

    def reply_prefixes(self, slots: Sequence[Slot]) -> list[str]:
        """Each slot's reply prefix: ``rollout.reply_prefix`` with the ``$name`` fields
        of the agent's :meth:`~llamagym.agent.Agent.reply_fields` filled in."""
        template = self.settings.reply_prefix
        if "$" not in template:
            return [template] * len(slots)
        return [fill_reply_prefix(template, self.agent, slot.observation) for slot in slots]

    def generation_prompts(self, slots: Sequence[Slot]) -> tuple[list[list[int]], list[str]]:
        """Each slot's generate-mode context, its prompt followed by its reply prefix's
        tokens, and the reply prefix (which the model's reply continues)."""
        prefixes = self.reply_prefixes(slots)
        prompts = [
            prompt + self.reply_prefix_tokens(prefix)
            for prompt, prefix in zip(
                self.render_prompts(slots, prefixes)[1], prefixes, strict=True
            )
        ]
        return prompts, prefixes

    def reply_prefix_tokens(self, prefix: str) -> list[int]:
        """The tokens of one reply prefix, which follow its generate-mode prompt."""
        tokens = self._reply_prefix_tokens.get(prefix)
        if tokens is None:
            tokenizer = self.policy.tokenizer
            tokens = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
            if len(self._reply_prefix_tokens) < 100_000:
                self._reply_prefix_tokens[prefix] = tokens
        return tokens

    def reply_room(self, prefix: str) -> int:
        """Context positions a generate-mode reply needs after its prompt."""
        return len(self.reply_prefix_tokens(prefix)) + self.settings.max_new_tokens

    def candidate_tokens(self, name: str) -> list[int]:
        tokens = self._candidate_cache.get(name)
        if tokens is None:
            tokens = name_tokens(self.policy.tokenizer, self.policy.eos_id, [name])[0]
            if len(self._candidate_cache) < 100_000:
                self._candidate_cache[name] = tokens
        return tokens

    # -- one decision for every active env --------------------------------------------
    @torch.no_grad()
    def decide(
        self,
        slots: Sequence[Slot],
        greedy: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Turn]:
        """A turn for each slot. A generation ends between tokens once ``should_stop()``
        says so; its cut replies are for a collection that ends there."""
        prefixes = self.reply_prefixes(slots) if self.settings.mode == "generate" else []
        user_texts, prompts, conversations = self.render_prompts(slots, prefixes)
        named = [self.agent.legal_actions(s.observation, s.info) for s in slots]
        # An empty list below stands for actions the agent does not name (None):
        # extract_action's value then goes to the env as it is (generate mode only).
        legal = [[] if actions is None else list(actions) for actions in named]
        for row, actions in enumerate(named):
            if actions is not None and not actions:
                raise EnvFailureError(
                    f"agent {self.agent.name!r} returned no legal actions for observation "
                    f"{slots[row].observation!r}"
                )
            if actions is None and self.settings.mode == "score":
                raise LlamaGymError(
                    f"{type(self.agent).__name__} names no actions, and score mode ranks "
                    "the legal actions: set action_names = [...] on the class (in the "
                    "env's action order), pass env=..., override legal_actions(), or use "
                    "rollout.mode=generate"
                )
        started = time.perf_counter()
        # A random fallback for an unparsable reply must stay random: no memo then.
        random_fallback = self.settings.invalid_action.policy == "random"
        memo = self._greedy_memo if greedy and not random_fallback else None
        keys = [
            (tuple(p), tuple(actions), prefixes[row] if prefixes else "")
            for row, (p, actions) in enumerate(zip(prompts, legal, strict=True))
        ]
        new = [row for row, key in enumerate(keys) if memo is None or key not in memo]
        fresh: list[Turn] = []
        if new:
            fresh = self._decide_new(
                [prompts[row] for row in new],
                [legal[row] for row in new],
                [conversations[row] for row in new],
                [prefixes[row] for row in new] if prefixes else [],
                greedy,
                [slots[row].key for row in new],
                should_stop,
            )
        self.stats.seconds_model += time.perf_counter() - started
        for row, turn in zip(new, fresh, strict=True):
            turn.user_text = user_texts[row]
            if memo is not None:
                memo[keys[row]] = replace(turn)
        made = dict(zip(new, fresh, strict=True))
        if memo is None:  # every row was new
            return [made[row] for row in range(len(keys))]
        return [made[row] if row in made else replace(memo[keys[row]]) for row in range(len(keys))]

    @contextlib.contextmanager
    def greedy_memo(self) -> Iterator[None]:
        """While the weights stay fixed (an evaluation), a greedy decision depends on the
        prompt and the legal actions alone: one seen before is reused, not recomputed.
        Blackjack's 20,000 evaluation episodes meet a few hundred distinct prompts."""
        self._greedy_memo = {}
        try:
            yield
        finally:
            self._greedy_memo = None

    def _decide_new(
        self,
        prompts: list[list[int]],
        legal: list[list[str]],
        conversations: list[list[dict[str, str]]],
        prefixes: list[str],
        greedy: bool,
        keys: list[int],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Turn]:
        """The turns of the rows that need the model; ``keys`` name each row's slot to
        the policy (its turn cache)."""
        if self.settings.mode == "score":
            return self._decide_by_score(prompts, legal, greedy, keys)
        turns = self._decide_by_generation(prompts, legal, prefixes, greedy, keys, should_stop)
        if self.settings.invalid_action.policy == "reprompt":
            self._reprompt(turns, conversations, prefixes, greedy, keys, should_stop)
        for turn in turns:
            if not turn.valid:
                self._apply_invalid_action_policy(turn)
        return turns

    def _decide_by_score(
        self, prompts: list[list[int]], legal: list[list[str]], greedy: bool, keys: list[int]
    ) -> list[Turn]:
        candidates = [[self.candidate_tokens(name) for name in names] for names in legal]
        scores, values = self.policy.score(prompts, candidates, keys=keys)
        temperature = self.temperature
        log_policy = Policy.action_log_probs(scores, temperature).cpu()
        if greedy:
            chosen = log_policy.argmax(-1)
        else:
            chosen = torch.multinomial(log_policy.exp(), 1, generator=self.generator).squeeze(-1)
        turns = []
        for row, index in enumerate(chosen.tolist()):
            turns.append(
                Turn(
                    prompt_tokens=prompts[row],
                    legal_actions=legal[row],
                    action_index=index,
                    reply=legal[row][index],
                    logprobs=[float(log_policy[row, index])],
                    value=float(values[row]),
                    candidates=candidates[row],
                    temperature=temperature,
                )
            )
        return turns

    def _decide_by_generation(
        self,
        prompts: list[list[int]],
        legal: list[list[str]],
        prefixes: list[str],
        greedy: bool,
        keys: list[int],
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Turn]:
        settings = self.settings
        # The reply prefix is context: the model continues it, the parsers read both.
        prompts = [
            prompt + self.reply_prefix_tokens(prefix)
            for prompt, prefix in zip(prompts, prefixes, strict=True)
        ]
        temperature = self.temperature
        replies = self.policy.generate(
            prompts,
            max_new_tokens=settings.max_new_tokens,
            temperature=temperature,
            top_p=settings.top_p,
            top_k=settings.top_k,
            greedy=greedy,
            generator=self.generator,
            reply_prefix=prefixes,
            should_stop=should_stop,
            keys=keys,
        )
        tokenizer = self.policy.tokenizer
        turns = []
        for row, reply_tokens in enumerate(replies.tokens):
            text = prefixes[row] + tokenizer.decode(reply_tokens, skip_special_tokens=True)
            env_action, parser = None, None
            if legal[row]:
                index, parser = self.plugins.parse_reply(self.agent, text, legal[row])
            else:
                index, env_action = None, self._unnamed_action(text)
            turns.append(
                Turn(
                    prompt_tokens=prompts[row],
                    legal_actions=legal[row],
                    action_index=index,
                    reply=text,
                    logprobs=replies.logprobs[row],
                    value=replies.values[row],
                    action_tokens=reply_tokens,
                    valid=index is not None or env_action is not None,
                    temperature=temperature,
                    env_action=env_action,
                    parser=parser or "",
                )
            )
        return turns

    def _unnamed_action(self, reply: str) -> Any:
        """The env action of an agent that names no actions: what its own
        ``extract_action`` makes of the reply. There is no legal action to fall back on,
        so a reply it cannot read stops the run with what to do."""
        value = self.agent.extract_action(reply)
        if value is None:
            raise LlamaGymError(
                f"{type(self.agent).__name__}.extract_action returned None for the reply "
                f"{reply[:120]!r}, and the agent names no actions to fall back on: return "
                "an action for every reply (a default one), or set action_names = [...] "
                "(in the env's action order) so the invalid-action policy can choose one"
            )
        return value

    def _reprompt(
        self,
        turns: list[Turn],
        conversations: list[list[dict[str, str]]],
        prefixes: list[str],
        greedy: bool,
        keys: list[int],
        should_stop: Callable[[], bool] | None = None,
    ) -> None:
        """Ask again, up to ``max_reprompts`` times, the envs whose reply had no legal
        action; the failed reply and the feedback stay in the conversation (and so,
        for the model, in each slot's turn cache)."""
        policy = self.settings.invalid_action
        for _ in range(policy.max_reprompts):
            pending = [row for row, turn in enumerate(turns) if not turn.valid]
            if not pending:
                return
            prompts = []
            for row in pending:
                failed = turns[row]
                failed.reward += policy.penalty
                failed.feedback = feedback_message(failed.legal_actions)
                conversations[row] = conversations[row] + [
                    {"role": "assistant", "content": failed.reply},
                    {"role": "user", "content": failed.feedback},
                ]
                prompts += self.prompt_tokens([conversations[row]])
            pending_prefixes = [prefixes[row] for row in pending]
            if any(
                len(prompt) > self.policy.max_context - self.reply_room(prefix)
                for prompt, prefix in zip(prompts, pending_prefixes, strict=True)
            ):
                return  # no room left to ask again: the fallback applies
            legal = [turns[row].legal_actions for row in pending]
            retried = self._decide_by_generation(
                prompts, legal, pending_prefixes, greedy, [keys[row] for row in pending],
                should_stop,
            )
            for row, turn in zip(pending, retried, strict=True):
                turn.retries = [*turns[row].retries, turns[row]]
                turns[row].retries = []
                turns[row] = turn

    def _apply_invalid_action_policy(self, turn: Turn) -> None:
        """Choose a legal action for an unparsable reply; ``None`` never reaches env.step."""
        policy = self.settings.invalid_action
        turn.reward += policy.penalty
        turn.feedback = ""
        if policy.policy == "random":
            turn.action_index = int(self.rng.integers(len(turn.legal_actions)))
        elif policy.fallback_action in turn.legal_actions:
            turn.action_index = turn.legal_actions.index(policy.fallback_action)
        else:
            turn.action_index = 0
        if policy.policy == "end_episode":
            turn.ends_episode = True

    # -- episodes over N envs ---------------------------------------------------------
    def collect(
        self,
        envs: list[Any],
        num_episodes: int,
        greedy: bool = False,
        group_size: int = 1,
        seeds: Sequence[int] | None = None,
        on_episode: Callable[[Episode], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[Episode]:
        """Run ``num_episodes`` fresh episodes over ``envs`` and return them finished.

        Episode ``k`` resets with seed ``seeds[k]`` (default: drawn from the engine's
        seeded generator), and episodes ``k`` with the same ``k // group_size`` share a
        seed, so a group starts from the same state.

        ``should_stop`` is called after each batched env step, and in generate mode
        between the tokens of a generation and after it (replies it cut short are never
        stepped); once it returns True the collection ends there and returns the
        episodes finished so far, fewer than ``num_episodes`` (the ones in progress are
        abandoned; the next collection resets their envs); the caller knows this
        happened, since the callable is its own. The random draws made so far are not
        undone.
        """
        started_at = time.perf_counter()
        if seeds is None:
            group_seeds = self.rng.integers(0, 2**31 - 1, size=-(-num_episodes // group_size))
            seeds = [int(group_seeds[k // group_size]) for k in range(num_episodes)]
        slots: list[Slot | None] = [None] * len(envs)
        finished: list[Episode] = []
        next_episode = 0
        turn_caps = [max_turns(env, self.settings.max_episode_turns) for env in envs]

        def start(position: int) -> None:
            nonlocal next_episode
            while next_episode < num_episodes:
                k = next_episode
                next_episode += 1
                try:
                    observation, info = checked_reset(envs[position], seeds[k])
                except Exception as error:  # an env that raises must not end the run
                    self._env_failed(envs, position, error)
                    turn_caps[position] = max_turns(envs[position], self.settings.max_episode_turns)
                    continue
                slots[position] = self.new_slot(observation, info, seeds[k], k // group_size)
                return
            slots[position] = None

        def finish(position: int, episode: Episode, summary: dict) -> None:
            ended = slots[position]
            if ended is not None:
                self.end_slot(ended)
            episode.info = summary
            finished.append(episode)
            if self.observe:
                self.plugins.episode_end(self.agent, episode)
            if on_episode is not None:
                on_episode(episode)
            start(position)

        for position in range(len(envs)):
            start(position)

        try:
            while any(slot is not None for slot in slots):
                active = [(p, slot) for p, slot in enumerate(slots) if slot is not None]
                turns = self.decide([slot for _, slot in active], greedy, should_stop)
                if self.settings.mode == "generate" and should_stop is not None and should_stop():
                    break  # the replies may be cut short: no env steps them
                include_retries = self.settings.invalid_action.train_on_reprompts
                for (position, slot), turn in zip(active, turns, strict=True):
                    episode = slot.episode
                    if turn.ends_episode:
                        # The end-episode policy: the env is not stepped; the penalty is the
                        # turn's only reward and the env is reset for the next episode.
                        episode.turns += turn.training_turns(include_retries)
                        episode.length += 1
                        finish(
                            position, episode, {"terminated": False, "ended_by_invalid_reply": True}
                        )
                        continue
                    index = turn.action_index
                    if index is None:  # the agent names no actions: extract_action's value
                        action_name, env_action = str(turn.env_action), turn.env_action
                    else:
                        action_name = turn.legal_actions[index]
                        env_action = self.agent.env_action(index, turn.legal_actions)
                    try:
                        observation, reward, terminated, truncated, info = checked_step(
                            envs[position], env_action
                        )
                    except Exception as error:
                        # Whatever went wrong (it raised, the old 4-tuple API, a reward that
                        # is not a finite number), the partial episode is dropped, never
                        # trained on nor averaged into a return.
                        self.end_slot(slot)
                        self._env_failed(envs, position, error)
                        turn_caps[position] = max_turns(
                            envs[position], self.settings.max_episode_turns
                        )
                        start(position)
                        continue
                    self.failures_in_a_row = 0
                    self.stats.env_steps += 1
                    shaped = reward
                    if self.settings.reward_shaping:
                        shaped += self.plugins.shape_reward(
                            self.agent, slot.observation, action_name, reward, info
                        )
                    turn.reward += shaped
                    episode.turns += turn.training_turns(include_retries)
                    episode.env_return += reward
                    episode.length += 1
                    slot.history += turn.context_messages()
                    slot.observation, slot.info = observation, info
                    if terminated or truncated:
                        finish(position, episode, {**info_summary(info), "terminated": terminated})
                    elif episode.length >= turn_caps[position]:
                        # An env that never ends (or sets no limit) is cut here: truncated.
                        finish(
                            position,
                            episode,
                            {
                                **info_summary(info),
                                "terminated": False,
                                "turn_cap": turn_caps[position],
                            },
                        )
                if should_stop is not None and should_stop():
                    break
        finally:
            for abandoned in slots:  # a stop, an error: their caches go
                if abandoned is not None:
                    self.end_slot(abandoned)
        self.stats.seconds_total += time.perf_counter() - started_at
        return finished

    def _env_failed(self, envs: list[Any], position: int, error: Exception) -> None:
        """Count a failed reset or step (in a row, across collections), then replace the
        env; more than ``max_failures_in_a_row`` end the collection."""
        self.failures_in_a_row += 1
        count = self.failures_in_a_row
        self.stats.env_failures += 1
        logger.warning(
            "%s, environment %d, failed (%s: %s); episode dropped, environment recreated",
            self._env_name(),
            position,
            type(error).__name__,
            _short(error),
        )
        if count > self.max_failures_in_a_row:
            raise EnvFailureError(
                f"{self._env_name()} failed {count} times in a row (last: "
                f"{type(error).__name__}: {_short(error)}); stopping the run "
                f"(training.max_env_failures = {self.max_failures_in_a_row})"
            ) from error
        with contextlib.suppress(Exception):  # a broken env may fail to close; it is replaced
            envs[position].close()
        envs[position] = self.agent.make_env()


def _short(error: Exception, limit: int = 300) -> str:
    """An env's error message on one bounded line (an env is untrusted)."""
    text = " ".join(str(error).split())
    return repr(text[:limit] + ("..." if len(text) > limit else ""))


def _characters(slot: Slot, user_text: str, history: list[dict[str, str]]) -> int:
    return len(slot.system_prompt) + len(user_text) + sum(len(m["content"]) for m in history)


def max_turns(env: Any, default: int) -> int:
    """The turns an episode of ``env`` may last: its own ``max_episode_steps`` (the
    registration's), else ``default`` (``rollout.max_episode_turns``)."""
    spec = getattr(env, "spec", None)
    own = getattr(spec, "max_episode_steps", None)
    return own if isinstance(own, int) and own > 0 else default


def checked_reset(env: Any, seed: int) -> tuple[Any, dict]:
    """``env.reset(seed=seed)`` as Gymnasium defines it, ``(observation, info)``;
    anything else raises ``ValueError`` saying what came back."""
    result = env.reset(seed=seed)
    if not isinstance(result, tuple) or len(result) != 2:
        raise ValueError(
            f"env.reset returned {_shape(result)}, not Gymnasium's (observation, info)"
        )
    observation, info = result
    if not isinstance(info, Mapping):
        raise ValueError(f"env.reset returned an info of type {type(info).__name__}, not a dict")
    return observation, dict(info)


def checked_step(env: Any, action: Any) -> tuple[Any, float, bool, bool, dict]:
    """``env.step(action)`` as Gymnasium defines it: ``(observation, reward, terminated,
    truncated, info)`` with a finite number for the reward. Anything else (the old gym
    API's 4-tuple, a reward of nan, inf or text) raises ``ValueError`` saying what came
    back, which counts as a failure of the env."""
    result = env.step(action)
    if not isinstance(result, tuple) or len(result) != 5:
        old_api = isinstance(result, tuple) and len(result) == 4
        raise ValueError(
            f"env.step returned {_shape(result)}, not Gymnasium's (observation, reward, "
            "terminated, truncated, info)"
            + ("; that is the old gym API's (observation, reward, done, info)" if old_api else "")
        )
    observation, reward, terminated, truncated, info = result
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(
            f"env.step returned a reward of type {type(reward).__name__}, not a number"
        ) from None
    if not math.isfinite(reward):
        raise ValueError(f"env.step returned a non-finite reward ({reward})")
    if not isinstance(info, Mapping):
        raise ValueError(f"env.step returned an info of type {type(info).__name__}, not a dict")
    return observation, reward, bool(terminated), bool(truncated), dict(info)


def _shape(result: Any) -> str:
    if isinstance(result, tuple):
        return f"a tuple of {len(result)}"
    return f"a {type(result).__name__}"


def feedback_message(legal_actions: Sequence[str], shown: int = 20) -> str:
    """What a re-prompt tells the model (a bounded list of the legal actions)."""
    names = ", ".join(legal_actions[:shown]) + (", ..." if len(legal_actions) > shown else "")
    return f"That reply named no legal action. Reply with one of: {names}."
