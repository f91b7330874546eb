"""Rendering a model's chat template, bounded.

A chat template comes with the model (its ``tokenizer_config.json`` or
``chat_template.jinja``): it is untrusted text. transformers renders it in Jinja's
sandbox, which keeps it from reaching Python, but not from looping for hours or writing
gigabytes. :func:`render_chat` renders under a time limit and a size limit: the template
may add at most :data:`MAX_TEMPLATE_EXTRA_CHARS` characters to what it is given, and take
at most :data:`MAX_TEMPLATE_SECONDS` per conversation. Both are measured while it runs (a
trace function on the compiled template's own frames: the clock at every line, the
characters at every piece of output), so a runaway template stops at the limit, not at
its end. Any error of a template (``raise_exception``, a syntax error, a sandbox refusal)
is one :class:`ChatTemplateError` naming the model.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

from llamagym.errors import LlamaGymError

#: Characters a template may add to a conversation's own text (a real one adds a few
#: tokens per message).
MAX_TEMPLATE_EXTRA_CHARS = 256 * 1024
#: Seconds a template may take per conversation (a real one takes a millisecond).
MAX_TEMPLATE_SECONDS = 1.0
#: The file name Jinja gives a template compiled from a string: its frames are the
#: template's own code.
_TEMPLATE_FILE = "<template>"


class ChatTemplateError(LlamaGymError):
    """A model's chat template failed, or ran past its time or size limit."""


class _Limit(Exception):
    """Raised inside the template's frames when a limit is passed."""


def render_chat(
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, str]]],
    add_generation_prompt: bool = True,
) -> list[str]:
    """Each conversation through ``tokenizer``'s chat template, as text, within the
    limits; a template that fails or passes one is a :class:`ChatTemplateError`."""
    given = sum(len(m.get("content") or "") for c in conversations for m in c)
    max_chars = given + len(conversations) * MAX_TEMPLATE_EXTRA_CHARS
    seconds = len(conversations) * MAX_TEMPLATE_SECONDS
    deadline = time.monotonic() + seconds
    produced = 0
    passed: list[str] = []

    def in_template(frame: Any, event: str, arg: Any) -> Any:
        nonlocal produced
        if time.monotonic() > deadline:
            passed.append(f"took more than {seconds:g} s")
            raise _Limit
        # A generator's yield is a "return" event carrying the value: the output.
        if event == "return" and isinstance(arg, str) and frame.f_code.co_name == "root":
            produced += len(arg)
            if produced > max_chars:
                passed.append(f"rendered more than {max_chars:,} characters")
                raise _Limit
        return in_template

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == _TEMPLATE_FILE else None

    name = str(getattr(tokenizer, "name_or_path", "") or "?")
    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        texts = tokenizer.apply_chat_template(
            [list(c) for c in conversations],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except _Limit:
        raise ChatTemplateError(
            f"the chat template of model {name!r} {passed[0]} for {len(conversations)} "
            "conversation(s), more than a chat template may; it is refused (use a model "
            "whose template renders the conversation)"
        ) from None
    except LlamaGymError:
        raise
    except Exception as error:  # whatever a broken or hostile template raises
        text = " ".join(str(error).split())[:300]
        raise ChatTemplateError(
            f"the chat template of model {name!r} failed: {type(error).__name__}: {text!r}"
        ) from None
    finally:
        sys.settrace(previous)
    # Checked again whole: output the trace did not see (a template compiled elsewhere).
    if sum(len(text) for text in texts) > max_chars:
        raise ChatTemplateError(
            f"the chat template of model {name!r} rendered more than {max_chars:,} "
            f"characters for {len(conversations)} conversation(s), more than a chat "
            "template may; it is refused (use a model whose template renders the "
            "conversation)"
        )
    return list(texts)
