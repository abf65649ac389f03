"""Hugging Face chat templates (Jinja) rendered in a sandbox.

A template arrives with a checkpoint from anyone, so it is untrusted code: it renders in
jinja2's ``ImmutableSandboxedEnvironment`` (no Python internals, no calls to unsafe
methods, no mutation of its inputs) and sees only plain JSON data. It gets what templates
are written against (transformers' ``utils/chat_template_utils.py``, reimplemented here):
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, a
``tojson`` filter that does not escape HTML, ``strftime_now``, ``namespace`` (refusing
underscore attributes), ``dict`` and the ``{% generation %}`` tag.

Nothing is evaluated at compile time (jinja2 folds constant expressions while compiling:
``{% set s = 'a' * 2000000000 %}`` would allocate 2 GB before any request). At render
time ``*``, ``+``, ``**`` and ``%`` refuse to build a value past :data:`MAX_ITEMS` items
(:data:`MAX_INT_BITS` bits for integers) and the output is cut at ``max_chars``. Those are
cheap guards, not a bound: a template can still loop for long or grow a string by other
means, so the server renders in a separate process under a time and memory limit
(:mod:`xspec.chat.renderer`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from xspec.errors import RequestError

if TYPE_CHECKING:
    import jinja2

MAX_ITEMS = 1 << 24  # the longest string / list an operator may build (16 Mi)
MAX_INT_BITS = 1 << 14  # the largest integer an operator may build
# one printf-style field of ``fmt % args``: its width and precision pad the output
_PRINTF_FIELD = re.compile(r"%(?:\([^)]*\))?[#0 +-]*(\*|\d*)(?:\.(\*|\d*))?")


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping (what chat templates are written against)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _oversize(op: str, a: Any, b: Any) -> str | None:
    """What ``a <op> b`` would build past the caps (None: it stays small), known from
    the operands' sizes before the operation runs."""
    sized = (str, list, tuple)
    if op == "*" and isinstance(b, sized) and isinstance(a, int):
        a, b = b, a
    if op == "*" and isinstance(a, sized) and isinstance(b, int):
        items = len(a) * max(b, 0)
    elif op == "+" and isinstance(a, sized) and isinstance(b, sized):
        items = len(a) + len(b)
    elif op == "%" and isinstance(a, str):
        fields = _PRINTF_FIELD.findall(a)
        if any("*" in f for f in fields):
            return "a '*' width or precision in a % format"
        items = len(a) + sum(int(w or 0) + int(p or 0) for w, p in fields)
    elif op in ("*", "**") and isinstance(a, int) and isinstance(b, int):
        bits = a.bit_length() + b.bit_length() if op == "*" else a.bit_length() * max(b, 0)
        return f"an integer of {bits} bits" if bits > MAX_INT_BITS else None
    else:
        return None
    return f"a value of {items} items" if items > MAX_ITEMS else None


def _keep(context: Any, value: Any) -> Any:
    """The identity, as ``finalize``: a finalize that takes the context makes jinja2
    evaluate every output expression at render time, none while compiling."""
    return value


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """The sandbox templates render in (built once; jinja2 is imported on first use)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering keeps its body (in a call block's scope, as there)."""

        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class SafeNamespace(Namespace):
        """``namespace()`` that refuses underscore attributes (no path to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the underscore attribute {name!r}"
                )

    class DictMaker:
        """``dict(...)`` / ``dict.fromkeys(...)`` without handing the template the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    class Sandbox(ImmutableSandboxedEnvironment):
        """The sandbox with size caps on the operators that can build large values."""

        intercepted_binops = frozenset({"*", "+", "**", "%"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if (what := _oversize(operator, left, right)) is not None:
                raise jinja2.exceptions.SecurityError(
                    f"'{operator}' would build {what}; a chat template may build at most "
                    f"{MAX_ITEMS} items ({MAX_INT_BITS}-bit integers)"
                )
            return super().call_binop(context, operator, left, right)

    env = Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, "jinja2.ext.loopcontrols"],
        optimized=False,  # no constant folding of {% set %} / expressions while compiling
        finalize=jinja2.pass_context(_keep),  # nor of output expressions
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=SafeNamespace,
        dict=DictMaker(),
    )
    return env


@lru_cache(maxsize=8)
def compile_template(text: str) -> jinja2.Template:
    return _environment().from_string(text)


class OutOfMemory(RequestError):
    """A render that ran out of memory (the process that ran it may stay fragmented)."""


class _TooLong(Exception):
    pass


def _joined(pieces: Iterator[str], max_chars: int) -> str:
    """The pieces joined; :class:`_TooLong` as soon as they pass ``max_chars``."""
    out, size = [], 0
    for piece in pieces:
        size += len(piece)
        if size > max_chars:
            raise _TooLong
        out.append(piece)
    return "".join(out)


def render(
    text: str,
    source: str,
    special_tokens: Mapping[str, str],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    options: Mapping[str, Any],
    max_chars: int = MAX_ITEMS,
) -> str:
    """Render as ``apply_chat_template(..., tokenize=False)`` does: special tokens, then
    the request's kwargs over them, then the messages. An output longer than
    ``max_chars`` stops the render (a :class:`~xspec.errors.RequestError`)."""
    import jinja2

    context = {
        **special_tokens,
        "tools": None,
        "documents": None,
        **options,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _joined(compile_template(text).generate(**context), max_chars)
    except _TooLong:
        raise RequestError(
            f"the chat template ({source}) wrote more than {max_chars} characters for these "
            "messages, more than a prompt can hold; shorten the conversation"
        ) from None
    except MemoryError:
        raise OutOfMemory(
            f"the chat template ({source}) ran out of memory on these messages"
        ) from None
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, or the sandbox
        raise RequestError(f"the chat template ({source}) refused these messages: {e}") from None
    except Exception as e:  # the template tripped on the input (a stranger's code)
        raise RequestError(
            f"the chat template ({source}) failed on these messages: {type(e).__name__}: {e}"
        ) from None
