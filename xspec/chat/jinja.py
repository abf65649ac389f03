"""Hugging Face chat templates (Jinja) rendered in a sandbox.

A template arrives with a checkpoint from anyone, so it is untrusted code: it renders in
jinja2's ``ImmutableSandboxedEnvironment`` (no Python internals, no calls to unsafe
methods, no mutation of its inputs) and sees only plain JSON data. It gets what templates
are written against (transformers' ``utils/chat_template_utils.py``, reimplemented here):
``trim_blocks`` / ``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``, a
``tojson`` filter that does not escape HTML, ``strftime_now``, ``namespace`` (refusing
underscore attributes), ``dict`` and the ``{% generation %}`` tag.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from xspec.errors import RequestError

if TYPE_CHECKING:
    import jinja2


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

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, "jinja2.ext.loopcontrols"],
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


def render(
    text: str,
    source: str,
    special_tokens: Mapping[str, str],
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    options: Mapping[str, Any],
) -> str:
    """Render as ``apply_chat_template(..., tokenize=False)`` does: special tokens, then
    the request's kwargs over them, then the messages."""
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
        return compile_template(text).render(**context)
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, or the sandbox
        raise RequestError(f"the chat template ({source}) refused these messages: {e}") from None
    except Exception as e:  # the template tripped on the input (a stranger's code)
        raise RequestError(
            f"the chat template ({source}) failed on these messages: {type(e).__name__}: {e}"
        ) from None
