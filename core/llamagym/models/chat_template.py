"""Rendering a model's chat template, bounded.

A chat template comes with the model (its ``tokenizer_config.json`` or
``chat_template.jinja``): it is untrusted text. transformers renders it in Jinja's
sandbox, which keeps it from reaching Python, but not from looping for hours or writing
gigabytes. :func:`render_chat` renders under a time limit and a size limit: the template
may add at most :data:`MAX_TEMPLATE_EXTRA_CHARS` characters to what it is given, and take
at most :data:`MAX_TEMPLATE_SECONDS` per conversation.

Both are measured while it runs. A trace function on the compiled template's own frames
checks the clock at every line and counts the characters of every piece of output, so a
runaway loop stops at the limit, not at its end. The clock is the rendering thread's CPU
time less the garbage collector's (:class:`_RenderClock`): what the template itself
spends, not a busy machine's pauses. One operation can build a huge value in
a single step the trace cannot interrupt (``'x' * 10**9``, ``'%1000000000s' % x``,
``'{:>1000000000}'.format(x)``, ``x|center(10**9)``): :class:`BoundedSandbox`, the sandbox
transformers compiles every template in, measures each one before it runs, through
Jinja's hooks for binary operators, calls, ``str.format`` and output, and through every
filter, and refuses one whose result would be larger than the render's size limit. So no
value a template holds is ever larger than that, and Jinja cannot fold such an operation
into a constant while compiling.

Any error of a template (``raise_exception``, a syntax error, a sandbox refusal) is one
:class:`ChatTemplateError` naming the model.
"""

from __future__ import annotations

import contextvars
import functools
import gc
import math
import re
import string
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2.compiler import CodeGenerator
from jinja2.constants import LOREM_IPSUM_WORDS
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import generate_lorem_ipsum
from transformers.utils import chat_template_utils

from llamagym.errors import LlamaGymError

#: Characters a template may add to a conversation's own text (a real one adds a few
#: tokens per message).
MAX_TEMPLATE_EXTRA_CHARS = 256 * 1024
#: CPU seconds a template may take per conversation (a real one takes a millisecond).
MAX_TEMPLATE_SECONDS = 1.0
#: The file name Jinja gives a template compiled from a string: its frames are the
#: template's own code.
_TEMPLATE_FILE = "<template>"
#: The largest value, in characters, the template being rendered may build (outside
#: :func:`render_chat`, a template rendered through transformers gets the default).
_largest_value: contextvars.ContextVar[int] = contextvars.ContextVar(
    "largest_template_value", default=MAX_TEMPLATE_EXTRA_CHARS
)
#: A ``%`` conversion: its width and precision are numbers or ``*`` (taken from the values).
_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class ChatTemplateError(LlamaGymError):
    """A model's chat template failed, or ran past its time or size limit."""


class _Limit(Exception):
    """Raised inside a template's render when a limit is passed; says which."""


def render_chat(
    tokenizer: Any,
    conversations: Sequence[Sequence[dict[str, str]]],
    add_generation_prompt: bool = True,
) -> list[str]:
    """Each conversation through ``tokenizer``'s chat template, as text, within the
    limits; a template that fails or passes one is a :class:`ChatTemplateError`."""
    _compile_in_bounded_sandbox()
    given = sum(len(m.get("content") or "") for c in conversations for m in c)
    max_chars = given + len(conversations) * MAX_TEMPLATE_EXTRA_CHARS
    seconds = len(conversations) * MAX_TEMPLATE_SECONDS
    clock = _RenderClock()
    produced = 0
    per = f"for {len(conversations)} conversation(s)"

    def in_template(frame: Any, event: str, arg: Any) -> Any:
        nonlocal produced
        if clock.seconds() > seconds:
            raise _Limit(f"took more than {seconds:g} s")
        # A generator's yield is a "return" event carrying the value: the output.
        if event == "return" and isinstance(arg, str) and frame.f_code.co_name == "root":
            produced += len(arg)
            if produced > max_chars:
                raise _Limit(f"rendered more than {max_chars:,} characters")
        return in_template

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        return in_template if frame.f_code.co_filename == _TEMPLATE_FILE else None

    name = str(getattr(tokenizer, "name_or_path", "") or "?")
    previous = sys.gettrace()
    largest = _largest_value.set(max_chars)
    sys.settrace(on_call)
    gc.callbacks.append(clock.on_collection)
    try:
        texts = tokenizer.apply_chat_template(
            [list(c) for c in conversations],
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except _Limit as limit:
        raise ChatTemplateError(
            f"the chat template of model {name!r} {limit} {per}, more than a chat template "
            "may; it is refused (use a model whose template renders the conversation)"
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
        gc.callbacks.remove(clock.on_collection)
        _largest_value.reset(largest)
    # Checked again whole: output the trace did not see (a template compiled elsewhere).
    if sum(len(text) for text in texts) > max_chars:
        raise ChatTemplateError(
            f"the chat template of model {name!r} rendered more than {max_chars:,} "
            f"characters {per}, more than a chat template may; it is refused (use a "
            "model whose template renders the conversation)"
        )
    return list(texts)


class _RenderClock:
    """CPU seconds this thread has spent since it was made, less the time the garbage
    collector took meanwhile: neither another process on the machine nor a collection of
    the whole program's objects counts against a template."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self._started = time.thread_time()
        self._collecting = 0.0
        self._collection_started: float | None = None

    def on_collection(self, phase: str, info: dict[str, int]) -> None:
        """A ``gc.callbacks`` entry (a collection in another thread is not this clock's)."""
        if threading.get_ident() != self._thread:
            return
        if phase == "start":
            self._collection_started = time.thread_time()
        elif self._collection_started is not None:
            self._collecting += time.thread_time() - self._collection_started
            self._collection_started = None

    def seconds(self) -> float:
        return time.thread_time() - self._started - self._collecting


@functools.cache
def _compile_in_bounded_sandbox() -> None:
    """transformers compiles chat templates in its module's ``ImmutableSandboxedEnvironment``
    (``chat_template_utils``): it compiles them in :class:`BoundedSandbox` instead, and
    forgets the templates it compiled before."""
    if not hasattr(chat_template_utils, "ImmutableSandboxedEnvironment"):
        raise LlamaGymError(
            "this transformers version compiles chat templates where LlamaGym cannot bound "
            "them: install the transformers version LlamaGym's requirements name"
        )
    # A module attribute that holds a class: mypy reads it as the class itself.
    chat_template_utils.ImmutableSandboxedEnvironment = BoundedSandbox  # type: ignore[misc]
    chat_template_utils._compile_jinja_template.cache_clear()


class _MeasuredConcat(CodeGenerator):
    """Jinja's compiler, with the text ``a ~ b`` joins measured (it has no hook for it)."""

    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.joined(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, in which no single operation builds a value larger
    than the render's size limit: each one that can (``+``, ``*``, ``**`` and ``%``,
    every call and filter, ``str.format``, the text of each ``{{ }}``) is measured
    before it runs, and what a call or filter returns, and the text ``~`` joins, is
    measured again."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    code_generator_class = _MeasuredConcat

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("finalize", _checked_output)
        super().__init__(*args, **kwargs)
        self.filters = _CheckedFilters(self.filters)
        # Its size grows with its arguments inside one call the trace cannot stop.
        self.globals["lipsum"] = lipsum

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _refuse_beyond(_binop_size(operator, left, right), repr(operator))
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        # The odd names are Jinja's: a call's own keyword arguments cannot clash with them.
        name = getattr(__obj, "__name__", "")
        if name not in ("format", "format_map"):  # sized in wrap_str_format
            value = getattr(__obj, "__self__", None)  # a method's object
            _refuse_beyond(_call_size(name, value, args, kwargs), f"{name}()")
        return _checked(super().call(__context, __obj, *args, **kwargs), f"{name}()")

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None
        text, name = value.__self__, value.__name__

        @functools.wraps(sandboxed)
        def sized(*args: Any, **kwargs: Any) -> str:
            values = args[0] if name == "format_map" and args else (args, kwargs)
            _refuse_beyond(_format_size(text, values), f"str.{name}()")
            return sandboxed(*args, **kwargs)

        return sized

    def joined(self, text: str) -> str:
        """What ``~`` joined (its pieces are values, each within the limit)."""
        return _checked(text, "'~'")


class _CheckedFilters(dict):
    """A sandbox's filters, each measured as it is added (transformers adds its own)."""

    def __init__(self, filters: Mapping[str, Callable[..., Any]]) -> None:
        super().__init__()
        for name, function in filters.items():
            self[name] = function

    def __setitem__(self, name: str, function: Callable[..., Any]) -> None:
        super().__setitem__(name, _checked_filter(name, function))


def _checked_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    # A filter marked by Jinja's pass_context (or eval_context, environment) takes that
    # first; then the value it filters, then its arguments.
    first = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)  # keeps the mark
    def checked(*args: Any, **kwargs: Any) -> Any:
        value, rest = (args[first], args[first + 1 :]) if len(args) > first else (None, ())
        if name == "format":  # value % arguments
            size = _percent_size(value, rest or kwargs) if isinstance(value, str) else 0
        else:
            size = _call_size(name, value, rest, kwargs, sequence_first=True)
        _refuse_beyond(size, f"the filter {name!r}")
        return _checked(function(*args, **kwargs), f"the filter {name!r}")

    return checked


def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
    """Jinja's ``lipsum``, refused before it runs when ``n`` paragraphs of up to ``max``
    words would be larger than the render may build."""
    if not all(isinstance(v, int) for v in (n, min, max)):
        raise _Limit("called lipsum() with arguments that are not whole numbers")
    _refuse_beyond(n * (max + 1) * (_LONGEST_LOREM_WORD + 1), "lipsum()")
    return generate_lorem_ipsum(n, html, min, max)


_LONGEST_LOREM_WORD = max(len(word) for word in LOREM_IPSUM_WORDS.split())


def _checked_output(value: Any) -> Any:
    """What a ``{{ }}`` prints, measured before it becomes text."""
    _refuse_beyond(_size(value), "'{{ }}'")
    return value


def _refuse_beyond(size: float, what: str) -> None:
    largest = _largest_value.get()
    if size > largest:
        shown = f"{size:,.0f}" if math.isfinite(size) and size < 1e30 else f"{size:.1e}"
        raise _Limit(
            f"would build a value of about {shown} characters with {what} (more than {largest:,})"
        )


def _checked(result: Any, what: str) -> Any:
    _refuse_beyond(_size(result), what)
    return result


def _size(value: Any, elements: bool = False) -> int:
    """About how many characters ``value`` takes as text (or, with ``elements``, how
    many elements it holds), each element counted as often as it is referenced (``[s] *
    1000`` is a thousand ``s``); counting stops past the largest value the render may
    build, so this takes at most that many steps."""
    largest = _largest_value.get()
    total = 0
    pending = [iter((value,))]
    while pending and total <= largest:
        item = next(pending[-1], _END)
        if item is _END:
            pending.pop()
            continue
        total += 1  # the element, or its separator
        if elements:
            pass
        elif isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 4
        elif isinstance(item, int):
            total += int(abs(item).bit_length() * math.log10(2)) + 1
        elif not isinstance(item, (Mapping, list, tuple, set, frozenset)):
            total += 8  # a float, a range, a namespace, a loop, an undefined: short
        if isinstance(item, Mapping):
            pending.append(iter(item.items()))
        elif isinstance(item, (list, tuple, set, frozenset)):
            pending.append(iter(item))
    return total


_END = object()


def _count(value: Any) -> int:
    """Where a width repeats in ``value``: its lines and tabs, or its elements."""
    if isinstance(value, str):
        return value.count("\n") + value.count("\t")
    if isinstance(value, range):
        return len(value)
    return _size(value, elements=True) - 1


def _widest_int(values: Any) -> int:
    """The largest integer among ``values``, their items and the items' items."""
    widest, level = 0, [values]
    for _ in range(3):
        widest = max([widest, *(v for v in level if isinstance(v, int))])
        level = [
            item
            for v in level
            if isinstance(v, (Mapping, list, tuple))
            for item in (v.values() if isinstance(v, Mapping) else v)
        ]
    return widest


def _number(digits: str) -> float:
    return float(digits) if len(digits) < 300 else math.inf


def _binop_size(operator: str, left: Any, right: Any) -> float:
    """About how many characters ``left <operator> right`` would take."""
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            return right * math.log10(abs(left))  # its digits
        return 0
    if operator == "*":
        if isinstance(left, (str, list, tuple)) and isinstance(right, int):
            return _size(left) * max(right, 0)
        if isinstance(right, (str, list, tuple)) and isinstance(left, int):
            return _size(right) * max(left, 0)
    if operator == "%" and isinstance(left, str):
        return _percent_size(left, right)
    return _size(left) + _size(right)


def _call_size(
    name: str,
    value: Any,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    sequence_first: bool = False,
) -> float:
    """About how many characters a call (a method of ``value``, a function when
    ``value`` is None, or a filter of ``value``) would return: its inputs, an integer
    argument (a width or a count: ``center``, ``indent``, ``batch``) at each place it
    repeats, and what ``replace`` and ``join`` repeat."""
    size = float(_size((value, args, kwargs)))
    size += _widest_int((args, kwargs)) * (_count(value) + 1)
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            size += (value.count(old) if old else len(value) + 1) * len(new)
    if name == "join":
        if sequence_first:  # the filter: items|join(separator)
            items, separator = value, args[0] if args else kwargs.get("d", "")
        else:  # the method: separator.join(items)
            items, separator = args[0] if args else (), value
        if isinstance(separator, str):
            size += len(separator) * (len(items) if isinstance(items, str) else _count(items))
    return size


def _percent_size(template: str, values: Any) -> float:
    """About how many characters ``template % values`` takes: each conversion may print
    all the values, padded to its width and precision."""
    widest = _widest_int(values)
    size = float(len(template))
    for field in _PERCENT_FIELD.finditer(template):
        size += _size(values)
        for part in field.groups():
            if part:
                size += widest if part == "*" else _number(part)
    return size


def _format_size(template: str, values: Any) -> float:
    """About how many characters ``template.format(...)`` takes: each field may print
    all the values, padded to the numbers in its format (or a value, for a nested one)."""
    try:
        fields = [
            spec for _, field, spec, _ in string.Formatter().parse(template) if field is not None
        ]
    except ValueError:
        return len(template)  # str.format names the problem
    widest = _widest_int(values)
    size = float(len(template))
    for spec in fields:
        size += _size(values) + sum(_number(run) for run in _DIGITS.findall(spec or ""))
        if "{" in (spec or ""):
            size += widest
    return size
