"""What the model is shown each turn: a slot's chat (system prompt, the history the run
keeps, the current observation) rendered through the tokenizer's chat template into
prompt token ids that fit the context, the reply prefix a generated reply continues,
and the tokens of each candidate action's name. :class:`PromptRendering` is the
rollout engine's part that does this, with its caches."""

from __future__ import annotations

import logging
import string
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from llamagym.config import RolloutSettings
from llamagym.errors import LlamaGymError
from llamagym.models.chat_template import render_chat
from llamagym.models.policy import name_tokens
from llamagym.plugin_runtime.manager import Plugins
from llamagym.rollout.rollout_policy import RolloutPolicy
from llamagym.rollout.slots import Slot

if TYPE_CHECKING:
    from llamagym.task import Task

logger = logging.getLogger(__name__)

PROMPT_CACHE_TOKENS = 1_000_000  # about 8 MB of cached prompt ids at most


def reply_closing(prefix: str) -> str:
    """What closes a reply started by ``prefix`` after its action's name: ``"}`` after an
    open JSON string (``{"action": "``), ``}`` after another opener."""
    return '"}' if prefix.rstrip().endswith('"') else "}"


def fill_reply_prefix(template: str, agent: Task, observation: Any) -> str:
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


def env_name(agent: Task) -> str:
    """The env as messages name it: agent and env id."""
    env_id = getattr(agent, "env_id", None)
    name = agent.name or type(agent).__name__
    return f"env {env_id!r} of agent {name!r}" if env_id else f"the env of agent {name!r}"


class PromptRendering:
    """Prompts for ``agent``'s slots under ``settings``, tokenized for ``policy``.

    It holds the agent (and its plugins, whose hooks format observations and give the
    system prompt), the rollout settings and the policy (its tokenizer, end-of-turn
    token and context). Rendering is deterministic, so what it computes is cached:
    prompt ids (bounded by :data:`PROMPT_CACHE_TOKENS`), reply prefixes' tokens and
    candidates' tokens.
    """

    def __init__(self, agent: Task, policy: RolloutPolicy, settings: RolloutSettings) -> None:
        self.agent = agent
        self.plugins: Plugins = agent.plugins
        self.policy = policy
        self.settings = settings
        self._candidate_cache: dict[str, list[int]] = {}
        self._reply_prefix_tokens: dict[str, list[int]] = {}
        self._prompt_cache: dict[tuple, list[int]] = {}
        self._prompt_cache_tokens = 0
        self._warned_long_prompt = False
        self._warned_context: set[str] = set()

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
            limit = self.policy.max_context - rooms[row]
            if len(prompt) <= limit:
                continue
            # Old turns go first, then the current observation is cut; the system
            # prompt never is.
            if histories[row]:
                self._warn_once("history", "the oldest turns of its conversation are dropped")
            while len(prompt) > limit and histories[row]:
                histories[row] = histories[row][2:]
                conversations[row] = self._messages(slots[row], user_texts[row], histories[row])
                [prompt] = self.prompt_tokens([conversations[row]])
            if len(prompt) > limit:
                user_texts[row], prompt = self._cut_to_context(
                    slots[row], user_texts[row], prompt, limit
                )
                conversations[row] = self._messages(slots[row], user_texts[row], [])
            ids[row] = prompt
        return user_texts, ids, conversations

    def _cut_to_context(
        self, slot: Slot, text: str, prompt: list[int], limit: int
    ) -> tuple[str, list[int]]:
        """The observation's ``text`` cut until its prompt, without history, takes at most
        ``limit`` tokens, and that prompt's ids (one warning per engine); a
        :class:`LlamaGymError` when the system prompt alone takes more."""
        while len(prompt) > limit and text:
            # Shrinks by a tenth more than the excess, so a few renders reach the limit.
            text = text[: int(len(text) * limit / len(prompt) * 0.9)]
            [prompt] = self.prompt_tokens([self._messages(slot, text, [])])
        if len(prompt) > limit:
            raise LlamaGymError(
                f"{env_name(self.agent)}: the system prompt (with the episode's context) takes "
                f"{len(prompt):,} tokens, more than the {limit:,} the model's context of "
                f"{self.policy.max_context:,} tokens leaves a prompt; shorten the agent's "
                "system prompt or episode context, or use a model with a longer context"
            )
        self._warn_once("observation", "observations are cut to fit")
        return text, prompt

    def _warn_once(self, what: str, done: str) -> None:
        """One warning per engine and kind (``what``) of cut made to fit the context."""
        if what in self._warned_context:
            return
        self._warned_context.add(what)
        logger.warning(
            "a prompt of %s is longer than the model's context of %s tokens holds (less "
            "the reply's room): %s (lower rollout.history_turns or rollout.max_prompt_chars"
            " to show less)",
            env_name(self.agent),
            f"{self.policy.max_context:,}",
            done,
        )

    def _within_prompt_cap(self, text: str) -> str:
        """An observation's text, cut to ``rollout.max_prompt_chars`` (one warning per
        engine the first time one is longer), with any lone surrogate (text no encoding
        writes) escaped as ``\\udXXX``."""
        text = printable_text(text)
        cap = self.settings.max_prompt_chars
        if len(text) <= cap:
            return text
        if not self._warned_long_prompt:
            self._warned_long_prompt = True
            logger.warning(
                "%s gave an observation of %s characters, more than rollout.max_prompt_chars"
                " = %s; such observations are cut to their first %s characters (raise "
                "rollout.max_prompt_chars if the model's context holds more)",
                env_name(self.agent),
                f"{len(text):,}",
                f"{cap:,}",
                f"{cap:,}",
            )
        return text[:cap]

    def episode_system_prompt(self, observation: Any, info: dict) -> str:
        """The system prompt an episode is played with: the agent's (through the hooks),
        then what its ``episode_context`` says holds for this episode (a game's goal),
        bounded like an observation."""
        system_prompt = self.plugins.system_prompt(self.agent)
        context = self._within_prompt_cap(str(self.agent.episode_context(observation, info) or ""))
        if context:
            system_prompt = f"{system_prompt}\n\n{context}" if system_prompt else context
        return system_prompt

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

    def reply_prefixes(self, slots: Sequence[Slot]) -> list[str]:
        """Each slot's reply prefix: ``rollout.reply_prefix`` with the ``$name`` fields
        of the agent's :meth:`~llamagym.task.Task.reply_fields` filled in."""
        template = self.settings.reply_prefix
        if "$" not in template:
            return [template] * len(slots)
        return [fill_reply_prefix(template, self.agent, slot.observation) for slot in slots]

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
        """Context positions a generate-mode reply is kept after its prompt: its prefix
        and ``max_new_tokens``, at most half the model's context (a longer reply gives
        way to the prompt, and ends where the context does: ``Policy.generate``)."""
        room = len(self.reply_prefix_tokens(prefix)) + self.settings.max_new_tokens
        return min(room, self.policy.max_context // 2)

    def candidate_tokens(self, name: str) -> list[int]:
        tokens = self._candidate_cache.get(name)
        if tokens is None:
            tokens = name_tokens(self.policy.tokenizer, self.policy.eos_id, [name])[0]
            if len(self._candidate_cache) < 100_000:
                self._candidate_cache[name] = tokens
        return tokens


def feedback_message(legal_actions: Sequence[str], shown: int = 20) -> str:
    """What a re-prompt tells the model (a bounded list of the legal actions)."""
    names = ", ".join(legal_actions[:shown]) + (", ..." if len(legal_actions) > shown else "")
    return f"That reply named no legal action. Reply with one of: {names}."


def printable_text(text: str) -> str:
    """``text`` with each lone surrogate (``"\\ud800"``, which no tokenizer or file
    takes) written as its escape; other text is returned as it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _characters(slot: Slot, user_text: str, history: list[dict[str, str]]) -> int:
    return len(slot.system_prompt) + len(user_text) + sum(len(m["content"]) for m in history)
