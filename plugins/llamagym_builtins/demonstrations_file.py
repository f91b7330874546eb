"""A demonstrations file, read as data, and the turns the warm start trains on.

Demonstration file, one JSON object per line (blank lines are skipped)::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "hit"}]}
    {"prompt": "Your sum: 12. Dealer shows: 10. Usable ace: no.", "response": "hit"}
    {"system": "Blackjack: reply stick or hit.", "prompt": "...", "response": "stick"}
    {"messages": [...], "legal_actions": ["stick", "hit"]}

A line that names its ``legal_actions`` (score mode's recordings) answers with one of
them; in a score-mode run the file's lines then train the choice among them. Any other
line trains its reply's tokens.

The last message must be the assistant's. Everything before it is rendered with the
tokenizer's chat template and a generation prompt, exactly as the rollout engine renders
an observation; the target is the response's tokens followed by the end-of-turn token,
exactly what a sampled reply looks like.

The file is data: its size and each line's are bounded before anything is decoded
(:data:`MAX_FILE_BYTES`, :data:`MAX_LINE_BYTES`), a line must be UTF-8 with no lone
surrogate and JSON no deeper than the parser's limit, and a conversation with more
characters than any tokenization fits in the model's context is skipped before its
template renders or anything is tokenized.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llamagym.errors import ConfigError
from llamagym.models.chat_template import render_chat
from llamagym.models.policy import name_tokens
from llamagym.rollout.prompts import reply_closing
from llamagym.rollout.trajectory import Turn

logger = logging.getLogger(__name__)


#: Bounds on a demonstration's ``legal_actions`` (a file is data, not trusted).
MAX_LEGAL_ACTIONS, MAX_ACTION_CHARS = 4096, 1000


@dataclasses.dataclass(frozen=True)
class Demonstration:
    """One decision of a demonstrations file: the conversation, ending with the
    assistant's reply, and the legal actions it was chosen from (score mode's
    recordings name them; None where the line names none)."""

    messages: list[dict[str, str]]
    legal_actions: list[str] | None = None


#: Bounds checked before a byte of a demonstrations file is decoded: a line (one
#: decision, its whole conversation) and the file.
MAX_LINE_BYTES = 4 * 2**20
MAX_FILE_BYTES = 2 * 2**30


def load_demonstrations(path: Path) -> list[Demonstration]:
    """Read a JSONL demonstrations file: conversations whose last message is the
    assistant's, each with the legal actions its line names. The file is data: its size
    and each line's are bounded before anything is decoded, a line must be UTF-8 with no
    lone surrogate and JSON no deeper than the parser's limit; a bad line is a
    ConfigError naming its number."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no demonstrations file at {str(path)!r}")
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise ConfigError(
            f"{path}: {size:,} bytes, over the {MAX_FILE_BYTES:,} a demonstrations file may "
            "hold; record fewer episodes or split the file"
        )
    demonstrations = []
    with path.open("rb") as lines:
        for number in itertools.count(1):
            raw = lines.readline(MAX_LINE_BYTES + 1)
            if not raw:
                break
            where = f"{path}: line {number}"
            if len(raw) > MAX_LINE_BYTES:
                raise ConfigError(
                    f"{where}: longer than {MAX_LINE_BYTES:,} bytes (one demonstration is a "
                    "line: is this a JSONL file?)"
                )
            record = _record(raw, where)
            if record is None:
                continue
            messages = _conversation(record, where)
            demonstrations.append(
                Demonstration(messages, _legal_actions(record, messages[-1]["content"], where))
            )
    if not demonstrations:
        raise ConfigError(f"{path}: no demonstrations in the file")
    return demonstrations


def _record(raw: bytes, where: str) -> Any:
    """One line's JSON value (None for a blank line)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{where}: not UTF-8 (byte {error.start + 1}: {raw[error.start:error.start + 1]!r})"
        ) from None
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{where}: not valid JSON ({error.msg})") from None
    except RecursionError:
        raise ConfigError(f"{where}: JSON nested too deeply to be a demonstration") from None
    return record


def _text(value: str, where: str, field: str) -> str:
    """``value``, which must encode as UTF-8 (JSON's escapes can spell a lone surrogate)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            f"{where}: {field} holds a lone surrogate ({value[:40]!r}), which is no text"
        ) from None
    return value


def _legal_actions(record: dict[str, Any], reply: str, where: str) -> list[str] | None:
    if "legal_actions" not in record:
        return None
    names = record["legal_actions"]
    if not (
        isinstance(names, list)
        and 0 < len(names) <= MAX_LEGAL_ACTIONS
        and all(isinstance(n, str) and len(n) <= MAX_ACTION_CHARS for n in names)
    ):
        raise ConfigError(
            f"{where}: 'legal_actions' must be a list of 1 to {MAX_LEGAL_ACTIONS:,} strings "
            f"of at most {MAX_ACTION_CHARS:,} characters"
        )
    for name in names:
        _text(name, where, "'legal_actions'")
    if reply not in names:
        raise ConfigError(
            f"{where}: the reply {reply[:200]!r} is not one of its 'legal_actions' (a "
            "score-mode demonstration answers with the name of the action it took)"
        )
    return names


def _conversation(record: Any, where: str) -> list[dict[str, str]]:
    expected = 'expected {"messages": [...]} or {"prompt": "...", "response": "..."}'
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: {expected}, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or len(messages) < 2:
            raise ConfigError(f"{where}: 'messages' must be a list of at least two messages")
        for index, message in enumerate(messages):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ConfigError(
                    f"{where}: message {index} must be an object with string 'role' and "
                    f"'content', got {message!r}"
                )
        if messages[-1]["role"] != "assistant":
            raise ConfigError(
                f"{where}: the last message must be the assistant's (the response to learn), "
                f"got role {messages[-1]['role']!r}"
            )
        return [{"role": _text(m["role"], where, f"message {i}'s role"),
                 "content": _text(m["content"], where, f"message {i}'s content")}
                for i, m in enumerate(messages)]
    if isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"{where}: 'system' must be a string")
        head = [{"role": "system", "content": _text(system, where, "'system'")}] if system else []
        return head + [
            {"role": "user", "content": _text(record["prompt"], where, "'prompt'")},
            {"role": "assistant", "content": _text(record["response"], where, "'response'")},
        ]
    raise ConfigError(f"{where}: {expected}; keys given: {sorted(record)}")


#: How many characters of a conversation one token may stand for, at most, in units of
#: the tokenizer's longest vocabulary entry (a normalizer may fold a few into one).
_CHARS_PER_ENTRY = 4


@functools.lru_cache(maxsize=8)
def _longest_entry(tokenizer: Any) -> int:
    """The length of the tokenizer's longest vocabulary entry (bytes as characters)."""
    return max((len(entry) for entry in tokenizer.get_vocab()), default=1)


def _surely_too_long(messages: Sequence[dict[str, str]], tokenizer: Any, max_context: int) -> bool:
    """Whether ``messages`` hold more characters than ``max_context`` tokens can: such a
    conversation is over the context however it tokenizes, and is never tokenized (a
    demonstration line may be megabytes)."""
    chars = sum(len(message["content"]) for message in messages)
    return chars > max_context * _CHARS_PER_ENTRY * _longest_entry(tokenizer)


def demonstration_turns(
    conversations: Sequence[list[dict[str, str]]],
    tokenizer: Any,
    max_context: int,
    reply_prefix: str = "",
) -> list[Turn]:
    """Conversations as generate-mode turns: prompt tokens and target reply tokens.

    With a ``reply_prefix`` (``{"action": "``) the prefix ends the prompt, as in a
    rollout, and the target is the rest of the JSON reply: a response given as a bare
    action (``stick``) becomes ``stick"}``, one given in full loses the prefix.
    """
    template = string.Template(reply_prefix)
    if template.get_identifiers():
        raise ConfigError(
            f"rollout.reply_prefix {reply_prefix!r} names fields of an observation, and "
            "demonstrations are text without one to fill them from: set a prefix "
            "without $fields (e.g. '{\"action\": \"') for a run with demonstrations"
        )
    reply_prefix = template.substitute({})  # $$ is a dollar sign
    prefix_tokens = tokenizer(reply_prefix, add_special_tokens=False)["input_ids"]
    closing = reply_closing(reply_prefix)
    turns, too_long = [], 0
    for messages in conversations:
        if _surely_too_long(messages, tokenizer, max_context):
            too_long += 1
            continue
        [text] = render_chat(tokenizer, [messages[:-1]])
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        response = messages[-1]["content"]
        if reply_prefix:
            prompt = prompt + prefix_tokens
            if response.startswith(reply_prefix):
                target = response[len(reply_prefix) :]
            else:
                target = response + closing
            # A sampled reply stops where the JSON object closes.
            reply = tokenizer(target, add_special_tokens=False)["input_ids"]
        else:
            reply = tokenizer(response, add_special_tokens=False)["input_ids"]
            reply = reply + [tokenizer.eos_token_id]  # a sampled reply ends with it too
        if len(prompt) + len(reply) > max_context:
            too_long += 1
            continue
        turns.append(
            Turn(
                prompt_tokens=prompt,
                legal_actions=[],
                action_index=None,
                reply=response,
                logprobs=[],
                value=0.0,
                action_tokens=reply,
            )
        )
    return _kept(turns, too_long)


def choice_turns(
    demonstrations: Sequence[Demonstration],
    tokenizer: Any,
    max_context: int,
    eos_id: int,
) -> list[Turn]:
    """Score-mode demonstrations as the turns a score-mode rollout makes: the prompt,
    each legal action's tokens as a candidate (:func:`name_tokens`, the rollout's own
    tokenization), and the demonstrated one as the choice. Their loss is score mode's,
    ``-log pi(demonstrated | legal actions)``."""
    turns, too_long = [], 0
    for demonstration in demonstrations:
        names = demonstration.legal_actions
        if names is None:
            raise ValueError("a choice turn needs the demonstration's legal actions")
        if _surely_too_long(demonstration.messages, tokenizer, max_context):
            too_long += 1
            continue
        [text] = render_chat(tokenizer, [demonstration.messages[:-1]])
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        candidates = name_tokens(tokenizer, eos_id, names)
        if len(prompt) + max(len(c) for c in candidates) > max_context:
            too_long += 1
            continue
        reply = demonstration.messages[-1]["content"]
        turns.append(Turn(prompt_tokens=prompt, legal_actions=list(names),
                          action_index=names.index(reply), reply=reply, logprobs=[],
                          value=0.0, candidates=candidates))
    return _kept(turns, too_long)


def _kept(turns: list[Turn], too_long: int) -> list[Turn]:
    if too_long:
        logger.warning("%d demonstrations longer than the model's context were skipped", too_long)
    if not turns:
        raise ConfigError("every demonstration is longer than the model's context")
    return turns
