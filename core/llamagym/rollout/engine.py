"""The rollout engine: N environments in lockstep, one batched forward pass per step.

Each step renders every active env's prompt through the hooks and the tokenizer's chat
template (the engine's :class:`~llamagym.rollout.prompts.PromptRendering`), asks the
policy once for all of them (score or generate mode), turns replies into legal actions
(extraction chain, then the invalid-action policy), and steps the envs (the engine's
:class:`~llamagym.rollout.slots.Episodes`, through :mod:`llamagym.rollout.env_checks`). The
LlamaGym-style ``Agent.act`` drives the same :meth:`RolloutEngine.decide` with one env,
so there is one code path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llamagym import moved_name as _moved_name
from llamagym.config import RolloutSettings
from llamagym.models.legal_replies import ReplyTree, legal_reply_text
from llamagym.models.policy import Policy
from llamagym.rollout import carried
from llamagym.rollout.env_checks import checked_legal_actions
from llamagym.rollout.env_failures import EnvFailures
from llamagym.rollout.invalid_replies import apply_fallback, ask_again, take_retries, unnamed_action
from llamagym.rollout.prompts import PromptRendering, env_name
from llamagym.rollout.rollout_policy import RolloutPolicy
from llamagym.rollout.slots import Episodes, Lockstep, RolloutStats, Slot
from llamagym.rollout.trajectory import Episode, Turn, retry_messages
from llamagym.schedule import Schedule

if TYPE_CHECKING:
    from llamagym.task import Task

logger = logging.getLogger(__name__)


class RolloutEngine:
    """Plays episodes with ``policy`` under ``settings``.

    ``schedule`` gives the sampling temperature (the run's schedule, moved by its owner;
    by default one of its own that stays at progress 0). ``max_failures_in_a_row``
    environment errors in a row end a collection with :class:`EnvFailureError`. With
    ``observe`` off, finished episodes are not passed to the ``llamagym_episode_end``
    hook (an evaluation's episodes are not training data for the observers).

    The engine decides each step's turns; it holds two parts built here: :attr:`prompts`
    (:class:`PromptRendering`: what each step shows the model) and :attr:`episodes`
    (:class:`Episodes`: each env's episode started, stepped and finished).
    """

    def __init__(
        self,
        agent: Task,
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
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.stats = RolloutStats()
        self._greedy_memo: dict[tuple, Turn] | None = None
        #: each (reply prefix, action)'s reply tokens under rollout.legal_replies
        self._legal_replies: dict[tuple[str, str], list[int] | None] = {}
        self.failures = EnvFailures(
            lambda: self.agent.make_env(), lambda: env_name(self.agent), max_failures_in_a_row,
            self.stats,
        )
        self.prompts = PromptRendering(agent, policy, settings)
        self.episodes = Episodes(
            agent, settings, policy, self.stats, self.failures,
            system_prompt=self.prompts.episode_system_prompt,
            draw_seed=lambda: int(self.rng.integers(0, 2**31 - 1)),
            observe=observe,
        )
        self._envs: list[Any] | None = None
        #: the open lockstep a carrying collection left (see :meth:`play`)
        self._carried: Lockstep | None = None

    # -- checkpoints -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The engine's random state, where the next episode seeds and samples come
        from, and the episodes carried into the next collection (:mod:`.carried`).

        With this state restored a resumed run plays exactly the episodes the unbroken
        run would have. Everything else the engine keeps is a cache (prompt and
        candidate tokens), statistics the trainer reads as differences, or settings
        given to its constructor.
        """
        state = {"rng": self.rng.bit_generator.state, "generator": self.generator.get_state()}
        if self._carried is not None:
            state["carried"] = carried.snapshot(self._carried)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state: the carried episodes are played again in
        the engine's envs (a ``ValueError`` if they do not read)."""
        self.rng.bit_generator.state = state["rng"]
        self.generator.set_state(state["generator"])
        self.drop_carried()
        if state.get("carried") is not None:
            lockstep = carried.replay(state["carried"], self)
            for position, slot in enumerate(lockstep.slots):
                if slot is None:
                    self.episodes.start(lockstep, position)
            self._carried = lockstep

    # -- the schedule ----------------------------------------------------------------
    @property
    def temperature(self) -> float:
        """The sampling temperature now (the schedule's)."""
        return self.schedule.temperature()

    # -- slots and prompts, from the parts ----------------------------------------------
    def new_slot(self, observation: Any, info: dict, seed: int | None, group: int | None) -> Slot:
        """A slot for an episode that starts at ``observation`` (:meth:`Episodes.new_slot`)."""
        return self.episodes.new_slot(observation, info, seed, group)

    def end_slot(self, slot: Slot) -> None:
        """The slot's episode is over: :meth:`Episodes.end_slot`."""
        self.episodes.end_slot(slot)

    def render_prompts(
        self, slots: Sequence[Slot], prefixes: Sequence[str] | None = None
    ) -> tuple[list[str], list[list[int]], list[list[dict[str, str]]]]:
        """Each slot's user text, prompt ids and conversation, as each step shows them
        (:meth:`PromptRendering.render_prompts`)."""
        return self.prompts.render_prompts(slots, prefixes)

    def prompt_tokens(self, conversations: list[list[dict[str, str]]]) -> list[list[int]]:
        """Token ids of each conversation (:meth:`PromptRendering.prompt_tokens`)."""
        return self.prompts.prompt_tokens(conversations)

    def candidate_tokens(self, name: str) -> list[int]:
        """A candidate action name's tokens (:meth:`PromptRendering.candidate_tokens`)."""
        return self.prompts.candidate_tokens(name)

    def decision_prompt(self, slot: Slot, retries: Sequence[Turn] = ()) -> tuple[str, list[int]]:
        """The user text and the prompt tokens of a decision at ``slot``, as
        :meth:`decide` renders them (in generate mode, the prompt ends with the reply
        prefix); after ``retries``, failed attempts at it, as :meth:`_reprompt` asks
        again."""
        if self.settings.mode != "generate":
            texts, prompts, _ = self.render_prompts([slot], [])
            return texts[0], prompts[0]
        prefixes = self.prompts.reply_prefixes([slot])
        texts, prompts, conversations = self.render_prompts([slot], prefixes)
        prompt = prompts[0]
        if retries:
            [prompt] = self.prompt_tokens([conversations[0] + retry_messages(retries)])
        return texts[0], prompt + self.prompts.reply_prefix_tokens(prefixes[0])

    def reply_text(self, slot: Slot, tokens: list[int]) -> str:
        """The reply a generate-mode decision at ``slot`` makes of sampled ``tokens``
        (:meth:`_reply_text` after its reply prefix)."""
        [prefix] = self.prompts.reply_prefixes([slot])
        return self._reply_text(prefix, tokens)

    def _reply_text(self, prefix: str, tokens: list[int]) -> str:
        """A sampled reply as the parsers read it: the reply prefix, then the tokens' text."""
        return prefix + self.policy.tokenizer.decode(tokens, skip_special_tokens=True)

    def generation_prompts(self, slots: Sequence[Slot]) -> tuple[list[list[int]], list[str]]:
        """Each slot's generate-mode context, its prompt followed by its reply prefix's
        tokens, and the reply prefix (which the model's reply continues)."""
        prefixes = self.prompts.reply_prefixes(slots)
        prompts = [
            prompt + self.prompts.reply_prefix_tokens(prefix)
            for prompt, prefix in zip(
                self.render_prompts(slots, prefixes)[1], prefixes, strict=True
            )
        ]
        return prompts, prefixes

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
        prefixes = self.prompts.reply_prefixes(slots) if self.settings.mode == "generate" else []
        user_texts, prompts, conversations = self.render_prompts(slots, prefixes)
        legal = [
            slot.tried.offer(self.agent, slot.observation, slot.info, names,
                             self.settings.explore)
            for slot, names in zip(slots, checked_legal_actions(
                self.agent,
                env_name(self.agent),
                [self.agent.legal_actions(s.observation, s.info) for s in slots],
                self.settings.mode,
                self.settings.max_action_chars,
            ), strict=True)
        ]
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
                apply_fallback(turn, self.settings.invalid_action, self.rng)
        return turns

    def _decide_by_score(
        self, prompts: list[list[int]], legal: list[list[str]], greedy: bool, keys: list[int]
    ) -> list[Turn]:
        candidates = [[self.prompts.candidate_tokens(name) for name in names] for names in legal]
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
            prompt + self.prompts.reply_prefix_tokens(prefix)
            for prompt, prefix in zip(prompts, prefixes, strict=True)
        ]
        temperature = self.temperature
        trees = None
        if settings.legal_replies:
            trees = [self._reply_tree(prefix, names) for prefix, names in zip(
                prefixes, legal, strict=True)]
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
            **({} if trees is None else {"reply_trees": trees}),
        )
        turns = []
        for row, reply_tokens in enumerate(replies.tokens):
            text = self._reply_text(prefixes[row], reply_tokens)
            env_action, parser = None, None
            if legal[row]:
                index, parser = self.agent.read_reply(text, legal[row])
            else:
                index, env_action = None, unnamed_action(self.agent, text)
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

    def _reply_tree(self, prefix: str, names: Sequence[str]) -> ReplyTree | None:
        """The replies after ``prefix`` that write one of ``names`` (None: no name has one:
        the row writes freely)."""
        replies = [self._legal_reply(prefix, name) for name in names]
        tree = ReplyTree([reply for reply in replies if reply is not None])
        return tree or None

    def _legal_reply(self, prefix: str, name: str) -> list[int] | None:
        """The tokens of the reply that writes action ``name`` after ``prefix``, ending
        the turn: None where its text does not come back from its tokens, is longer than
        ``max_new_tokens``, or the agent's parsers do not read it as ``name``."""
        key = (prefix, name)
        if key in self._legal_replies:
            return self._legal_replies[key]
        text = legal_reply_text(prefix, name)
        tokenizer = self.policy.tokenizer
        tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
        reply: list[int] | None = [*tokens, self.policy.eos_id]
        if (len(tokens) > self.settings.max_new_tokens
                or tokenizer.decode(tokens, skip_special_tokens=True) != text
                or self.agent.read_reply(prefix + text, [name])[0] != 0):
            reply = None
        if len(self._legal_replies) < 100_000:
            self._legal_replies[key] = reply
        return reply

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
            pending = ask_again(turns, conversations, policy.penalty)
            if not pending:
                return
            prompts = self.prompt_tokens([conversations[row] for row in pending])
            pending_prefixes = [prefixes[row] for row in pending]
            if any(
                len(prompt) > self.policy.max_context - self.prompts.reply_room(prefix)
                for prompt, prefix in zip(prompts, pending_prefixes, strict=True)
            ):
                return  # no room left to ask again: the fallback applies
            legal = [turns[row].legal_actions for row in pending]
            retried = self._decide_by_generation(
                prompts, legal, pending_prefixes, greedy, [keys[row] for row in pending],
                should_stop,
            )
            take_retries(turns, pending, retried)

    # -- the engine's own envs --------------------------------------------------------
    @property
    def envs(self) -> list[Any]:
        """The engine's envs: ``settings.num_envs`` of the agent's (``make_env``), made on
        first use and kept across collections; one that fails is replaced in place."""
        if self._envs is None:
            self._envs = [self.agent.make_env() for _ in range(self.settings.num_envs)]
        return self._envs

    def play(
        self, num_episodes: int, *, carry: bool = False,
        enough: Callable[[int], bool] | None = None, **options: Any,
    ) -> list[Episode]:
        """:meth:`collect` over the engine's own :attr:`envs` (``options`` as there).

        With ``carry`` (one episode per group, seeds drawn by the engine), no env waits:
        one whose episode ends starts the next at once, the collection returns the first
        ``num_episodes`` episodes to finish, and the episodes still in progress (and any
        that finished beyond ``num_episodes``) carry into the next ``carry`` collection.
        ``enough``, asked after each batched env step with the number finished, may end
        a carrying collection sooner: it returns those, and the rest carry as above
        (unlike ``should_stop``'s cut, which carries nothing). Any other collection,
        :meth:`drop_carried` and :meth:`close` end the carried episodes untrained."""
        if not carry:
            if enough is not None:
                raise ValueError("only a carrying collection can end with what is enough")
            self.drop_carried()
            return self.collect(self.envs, num_episodes, **options)
        if options.get("seeds") is not None or options.get("group_size", 1) != 1:
            raise ValueError("a carrying collection draws its own seeds, one per episode")
        options.pop("group_size", None)
        if self._carried is None:
            self._carried = self.episodes.open(self.envs, None, None, 1)
        return self._run(self._carried, num_episodes, **options, enough=enough)

    def drop_carried(self) -> None:
        """End the episodes carried into the next collection (see :meth:`play`): none of
        their turns is trained on."""
        carried, self._carried = self._carried, None
        if carried is not None:
            self.episodes.abandon(carried)

    def close(self) -> None:
        """Close the engine's envs; a later :meth:`play` makes new ones."""
        self.drop_carried()
        envs, self._envs = self._envs or [], None
        for env in envs:
            env.close()

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
        policy_version: int = 0,
    ) -> list[Episode]:
        """Run ``num_episodes`` fresh episodes over ``envs`` and return them finished
        (:meth:`play` runs them over the engine's own).

        Episode ``k`` resets with seed ``seeds[k]`` (default: drawn from the engine's
        seeded generator), and episodes ``k`` with the same ``k // group_size`` share a
        seed, so a group starts from the same state. Each turn is stamped with
        ``policy_version`` (:attr:`Turn.policy_version`).

        ``should_stop`` is called after each batched env step, and in generate mode
        between the tokens of a generation and after it (replies it cut short are never
        stepped); once it returns True the collection ends there and returns the
        episodes finished so far, fewer than ``num_episodes`` (the ones in progress are
        abandoned; the next collection resets their envs); the caller knows this
        happened, since the callable is its own. The random draws made so far are not
        undone.
        """
        if seeds is None:
            group_seeds = self.rng.integers(0, 2**31 - 1, size=-(-num_episodes // group_size))
            seeds = [int(group_seeds[k // group_size]) for k in range(num_episodes)]
        lockstep = self.episodes.open(envs, seeds, num_episodes, group_size)
        return self._run(lockstep, None, greedy, on_episode, should_stop, policy_version)

    def _run(
        self,
        lockstep: Lockstep,
        until: int | None,
        greedy: bool = False,
        on_episode: Callable[[Episode], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        policy_version: int = 0,
        enough: Callable[[int], bool] | None = None,
    ) -> list[Episode]:
        """Advance ``lockstep`` to its end, or, when it is the carried one, until
        ``until`` episodes have finished (or ``enough`` says so); then it is carried
        again (see :meth:`play`)."""
        started_at = time.perf_counter()
        carried, self._carried = lockstep is self._carried, None
        lockstep.on_episode, lockstep.policy_version = on_episode, policy_version
        lockstep.wanted = until
        if on_episode is not None:  # those that finished during the last collection
            for episode in lockstep.finished[:until]:
                on_episode(episode)
        try:
            cut = self._advance(lockstep, greedy, should_stop, until, enough)
        except BaseException:
            self.episodes.abandon(lockstep)
            raise
        finally:
            self.stats.seconds_total += time.perf_counter() - started_at
        if not carried or cut:  # a cut carries nothing
            self.episodes.abandon(lockstep)
            return lockstep.finished
        batch, lockstep.finished = lockstep.finished[:until], lockstep.finished[until:]
        self._carried = lockstep
        return batch

    def _advance(
        self,
        lockstep: Lockstep,
        greedy: bool,
        should_stop: Callable[[], bool] | None,
        until: int | None = None,
        enough: Callable[[int], bool] | None = None,
    ) -> bool:
        """Step the lockstep's envs together until none has an episode left, or
        ``until`` episodes have finished (or ``enough`` of them); True when
        ``should_stop`` cut it short."""
        while (active := lockstep.active()) and (until is None or len(lockstep.finished) < until):
            turns = self.decide([slot for _, slot in active], greedy, should_stop)
            self.stats.decisions += len(active)
            self.stats.batched_decisions += 1
            if self.settings.mode == "generate" and should_stop is not None and should_stop():
                return True  # the replies may be cut short: no env steps them
            for (position, slot), turn in zip(active, turns, strict=True):
                turn.policy_version = lockstep.policy_version
                self.episodes.play_turn(lockstep, position, slot, turn)
            if should_stop is not None and should_stop():
                return True
            if enough is not None and enough(len(lockstep.finished)):
                break
        return False


if not TYPE_CHECKING:  # to a type checker a moved name is missing, as it is
    def __getattr__(name: str) -> object:
        return _moved_name(__name__, name)
