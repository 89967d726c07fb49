"""Chat templates: a tokenizer's Jinja template, rendered as Hugging Face renders it (trimmed
blocks, `raise_exception`, `tojson`, `strftime_now`), inside bounds, since the template comes with
a tokenizer someone else wrote.

Jinja's immutable sandbox keeps a template away from Python's internals and from changing the
conversation (and caps `range()` at 100,000). On top of it, each render of a conversation gets at
most MAX_SECONDS (a timer interrupts any loop), no value or output longer than MAX_CHARS, no
number beyond MAX_INT_BITS, and what can multiply a size is checked before it runs: `*`, `**`,
`+`, `~`, format widths, and a method or filter whose subject times its largest argument (a
width, a count, a string to insert) passes MAX_WORK. Whatever fails, a Jinja error, `1 // 0` or
a bound, is one line naming the template's file and the record.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

# jinja2 comes with torch (one of its dependencies).
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loom.checked import cause
from loom.errors import LoomError

MAX_CHARS = 1 << 20  # a conversation renders to far less (a 128k-token window is ~500k characters)
MAX_WORK = 1 << 26  # characters one method or filter may be asked to produce
MAX_INT_BITS = 1024
MAX_SECONDS = 2.0  # a template renders a conversation in about a millisecond
_DIGITS = re.compile(r"\d+")


class TemplateBound(Exception):
    """A template passed one of the bounds (raised inside a render, one line outside it)."""


def _size(value: Any, limit: int = MAX_CHARS) -> int:
    """Characters and items a value holds, counted until `limit` is passed."""
    if isinstance(value, str):
        return len(value)
    if not isinstance(value, (list, tuple, dict, set, frozenset)):
        return 1
    total = len(value)
    for item in value.items() if isinstance(value, dict) else value:
        kind = type(item)  # the common items counted inline: a call per item doubled a long list's check
        total += len(item) if kind is str else 1 if kind in _SCALARS else _size(item, limit - total)
        if total > limit:
            break
    return total


_SCALARS = frozenset({int, float, bool, type(None)})


def _checked(value: Any) -> Any:
    """A value the template made or reached, refused if it is too large."""
    if type(value) is str and len(value) <= MAX_CHARS:  # the common case, first: this runs on every access
        return value
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise TemplateBound(f"computes a number of {value.bit_length():,} bits (at most {MAX_INT_BITS})")
    if _size(value) > MAX_CHARS:
        raise TemplateBound(f"makes a value of more than {MAX_CHARS:,} characters")
    return value


def _check_format(fmt: str, args: Any) -> None:
    """`fmt % args`, `fmt.format(...)`, `fmt|format(...)`: widths come from the digits in the
    format string and from integer arguments (`%*d`, `{:{w}}`)."""
    numbers = args if isinstance(args, (tuple, list)) else (args,)
    widths = sum(map(int, _DIGITS.findall(fmt))) + sum(abs(n) for n in numbers if isinstance(n, int))
    if widths > MAX_CHARS:
        raise TemplateBound(f"formats with widths adding up to {widths:,} (at most {MAX_CHARS:,})")


def _check_call(subject: Any, args: tuple, kwargs: dict) -> None:
    """A method (subject: its object) or filter (subject: its value) call: inputs within MAX_CHARS,
    and subject × its largest argument within MAX_WORK (`s.replace(a, b)`, `s|indent(n)`, `s.center(n)`)."""
    values = [*args, *kwargs.values()]
    for value in values:
        _checked(value)
    largest = max((abs(v) if isinstance(v, int) else _size(v) for v in values), default=1)
    if max(_size(subject), 1) * max(largest, 1) > MAX_WORK:
        raise TemplateBound(f"calls a method or filter that could make up to {_size(subject) * largest:,} "
                            f"characters (at most {MAX_WORK:,})")


def _check_binop(operator: str, left: Any, right: Any) -> None:
    ints = isinstance(left, int) and isinstance(right, int)
    if operator == "**" and ints and right > 0 and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
        raise TemplateBound(f"computes {left} ** {right} (numbers of at most {MAX_INT_BITS} bits)")
    if operator == "*" and not ints:  # a sequence repeated
        sequence, count = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(count, int) and _size(sequence) * count > MAX_CHARS:
            raise TemplateBound(f"repeats a value {count:,} times (at most {MAX_CHARS:,} characters)")
    if operator == "+" and _size(left) + _size(right) > MAX_CHARS:
        raise TemplateBound(f"makes a value of more than {MAX_CHARS:,} characters")
    if operator == "%" and isinstance(left, str):
        _check_format(left, right)


def _materialized(value: Any) -> Any:
    """A generator handed to a filter, as a list checked item by item (its size shows only then)."""
    if not isinstance(value, Iterator):
        return value
    items, total = [], 0
    for item in value:
        total += _size(item) + 1
        if total > MAX_CHARS:
            raise TemplateBound(f"makes a sequence of more than {MAX_CHARS:,} characters")
        items.append(item)
    return items


def _bounded_filter(fn: Callable) -> Callable:
    skip = 0 if getattr(fn, "jinja_pass_arg", None) is None else 1  # the context/environment first

    @functools.wraps(fn)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        args = (*args[:skip], _materialized(args[skip]), *args[skip + 1:])
        _check_call(args[skip], args[skip + 1:], kwargs)
        if fn.__name__ == "do_format" and isinstance(args[skip], str):
            _check_format(args[skip], args[skip + 1:])
        return _checked(fn(*args, **kwargs))

    return bounded


class _CodeGenerator(CodeGenerator):
    def visit_Concat(self, node: Any, frame: Any) -> None:
        """`a ~ b ~ c` joins through the environment, so that its size is checked first."""
        self.write("environment.concat_checked((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every value it hands out and every growing operation checked."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # and not folded when the template compiles

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return _checked(super().call_binop(context, operator, left, right))

    def getattr(self, obj: Any, attribute: str) -> Any:
        return _checked(super().getattr(obj, attribute))

    def getitem(self, obj: Any, argument: Any) -> Any:
        return _checked(super().getitem(obj, argument))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (Jinja's)
        subject = getattr(__obj, "__self__", None)
        _check_call(subject if isinstance(subject, (str, list, tuple, dict)) else None, args, kwargs)
        return _checked(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        """`s.format(...)` / `s.format_map(...)`, as the sandbox runs them, after their widths are checked."""
        sandboxed = super().wrap_str_format(value)
        if sandboxed is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(value.__self__, (*args, *kwargs.values()))
            return sandboxed(*args, **kwargs)

        return checked

    @staticmethod
    def concat_checked(parts: tuple) -> str:
        texts = [str(part) for part in parts]
        if sum(map(len, texts)) > MAX_CHARS:
            raise TemplateBound(f"joins a value of more than {MAX_CHARS:,} characters with ~")
        return "".join(texts)


def _expired(signum: int, frame: Any) -> None:
    raise TemplateBound(f"runs longer than {MAX_SECONDS:g} s")


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """SIGALRM after `seconds` interrupts the template wherever it loops; a timer set before (a
    caller's) is put back with what was left of it. Signals reach the main thread only (where loom
    renders: the launcher, a rank, a DataLoader or `data prepare` worker); elsewhere only the size
    bounds hold."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    start = time.monotonic()
    handler = signal.signal(signal.SIGALRM, _expired)
    before, interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, handler)
        if before:
            signal.setitimer(signal.ITIMER_REAL, max(before - (time.monotonic() - start), 1e-6), interval)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template; `source` is the file it comes from (tokenizer_config.json or
    chat_template.jinja), named in every error."""

    def __init__(self, template: str, special_tokens: dict[str, str], source: str) -> None:
        self.source, self.special_tokens = source, special_tokens
        env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], finalize=_checked)
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                      indent=indent)
        env.filters = {name: _bounded_filter(fn) for name, fn in env.filters.items()}
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        try:
            with _deadline(MAX_SECONDS):
                self._compiled = env.from_string(template)
        except Exception as e:  # a syntax error, or a bound passed folding its constants
            raise LoomError(f"{source}: the chat template does not compile ({cause(e)}); fix it") from None

    def render(self, messages: list, add_generation_prompt: bool, where: str) -> str:
        """The conversation as text; one line naming the file and `where` (the record) if the template
        fails on it or passes a bound."""
        try:
            with _deadline(MAX_SECONDS):
                parts, total = [], 0
                variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                             **self.special_tokens}
                for part in self._compiled.generate(variables):
                    total += len(part)
                    if total > MAX_CHARS:
                        raise TemplateBound(f"renders more than {MAX_CHARS:,} characters")
                    parts.append(part)
                return "".join(parts)
        except TemplateBound as e:
            raise LoomError(f"{self.source}: the chat template {e} on {where}; a template renders a "
                            f"conversation in far less: fix the template") from None
        except Exception as e:  # TemplateError (raise_exception), ZeroDivisionError, RecursionError, …
            raise LoomError(f"{self.source}: the chat template fails on {where} ({cause(e)}); fix the "
                            f"template or the record") from None
