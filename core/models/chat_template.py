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

import functools
import math
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
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        folded = _folded_size(template)
        if folded > MAX_TEMPLATE_EXTRA_CHARS:
            raise ChatTemplateError(
                f"the chat template of model {name!r} holds a constant of about {folded:,} "
                f"characters (more than {MAX_TEMPLATE_EXTRA_CHARS:,}), which compiling it "
                "would build; it is refused (use a model whose template renders the "
                "conversation)"
            )
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


@functools.lru_cache(maxsize=32)
def _folded_size(template: str) -> int:
    """The largest constant product (``'x' * 10**8``, ``9**10**7``) in ``template``,
    in characters: Jinja folds constant expressions while it compiles, outside any
    limit of the render, so they are measured before, without being computed."""
    from jinja2 import TemplateSyntaxError, nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        tree = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(
            template
        )
    except TemplateSyntaxError:
        return 0  # transformers' own compile names the problem

    def size(node: Any) -> tuple[str, float] | None:
        """(kind, size) of a constant: "seq" and its length, or "int" and its value."""
        if isinstance(node, nodes.Const):
            value = node.value
            if isinstance(value, (str, list, tuple)):
                return "seq", float(len(value))
            if isinstance(value, int) and not isinstance(value, bool):
                return "int", float(abs(value))
            return None
        if isinstance(node, (nodes.List, nodes.Tuple)):
            return "seq", float(len(node.items))
        if isinstance(node, (nodes.Mul, nodes.Pow)):
            left, right = size(node.left), size(node.right)
            if left is None or right is None:
                return None
            if isinstance(node, nodes.Pow):
                if left[0] != "int" or right[0] != "int":
                    return None
                digits = right[1] * math.log10(max(left[1], 2.0))
                return "int", math.inf if digits > 300 else left[1] ** right[1]
            kind = "seq" if "seq" in (left[0], right[0]) else "int"
            return kind, left[1] * right[1]
        return None

    largest = 0.0
    for node in tree.find_all((nodes.Mul, nodes.Pow)):
        found = size(node)
        if found is None:
            continue
        kind, amount = found
        # A sequence costs its length; an integer its digits.
        if kind == "int":
            amount = math.log10(amount + 1) if math.isfinite(amount) else math.inf
        largest = max(largest, amount)
    return int(min(largest, 2**62))
