"""Grammars that make the model's output a tool call in its chat format.

:func:`tool_grammar` writes a Lark grammar (llguidance's dialect, which embeds a JSON Schema
with ``%json {...}``) for a request's ``tool_choice``:

* ``required``: the output is one or more calls (exactly one without
  ``parallel_tool_calls``) of the request's functions, and nothing else;
* a named function: calls of that function only;
* ``auto``: free text that never opens a call, or free text followed by well-formed calls;
* ``none``: no grammar (None).

A call's arguments follow its function's ``parameters`` schema, with no property it does
not declare unless it sets ``additionalProperties`` (JSON Schema's default admits any key,
and a weak model fills a call with them; no schema: ``{}``). In Qwen3's ``hermes``
format they are one JSON object (``%json`` of the whole schema). DeepSeek-V4's ``dsml``
writes one parameter at a time, so the grammar lists the schema's ``properties`` in their
order (those not ``required`` may be left out; no others are admitted): a plain string
(``{"type": "string"}`` with no other constraint) or a string ``enum`` is written as is,
``string="true"``; any other value as JSON (``%json`` of its schema), ``string="false"``.
JSON is written in :data:`xspec.grammar.JSON_LAYOUT` (``json.dumps``' spacing).

:func:`plan_tools` reads a request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``
once into a :class:`ToolPlan`: the tools its prompt shows, its grammar, its output parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from xspec.chat import ChatTemplate, tool_format
from xspec.chat.tools import (
    DSML,
    HERMES,
    Dsml,
    ParsedOutput,
    ToolCallStream,
    ToolChoice,
    ToolFormat,
    check_tool_choice,
    check_tools,
    new_call_id,
)
from xspec.errors import RequestError
from xspec.grammar import JSON_LAYOUT, GrammarSpec, Reasoning
from xspec.json_schema import compact_schema

# keys a DSML parameters schema may hold at its top (others cannot be split into parameters)
DSML_TOP_KEYS = {"type", "properties", "required", "additionalProperties", "description",
                 "title", "$defs", "definitions", "$schema", "$id"}  # fmt: skip
COMBINERS = {"anyOf", "oneOf", "allOf", "$ref"}  # a schema whose keys come from elsewhere
# keys that leave a string parameter plain (written as is)
PLAIN_STRING_KEYS = {"type", "description", "title", "default", "examples"}


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools, read once: ``tools`` go to
    :func:`~xspec.chat.chat_prompt`, ``grammar`` (None: unconstrained) to the engine's
    request, and the output text (without reasoning and stop token) to :meth:`parse` or,
    streamed, to :meth:`stream`. ``finish_reason`` is ``"tool_calls"`` when calls came."""

    format: ToolFormat
    tools: list[dict[str, Any]]
    choice: ToolChoice
    grammar: GrammarSpec | None

    def parse(self, text: str, new_id: Callable[[], str] = new_call_id) -> ParsedOutput:
        return self.format.parse(text, self.tools, new_id)

    def stream(self, new_id: Callable[[], str] = new_call_id) -> ToolCallStream:
        return ToolCallStream(self.format, self.tools, new_id)


def plan_tools(
    template: ChatTemplate,
    tools: Any,
    tool_choice: Any = None,
    parallel_tool_calls: Any = None,
    *,
    reasoning: bool = False,
    constrain_auto: bool = True,
) -> ToolPlan | None:
    """The request's OpenAI ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` for a
    model with ``template``; None when the request has no tools or ``tool_choice`` is
    ``"none"`` (a plain chat request: the prompt shows no tools, the output is text).
    ``reasoning``: the output opens with the model's reasoning (thinking mode; see
    :func:`tool_grammar`). ``constrain_auto``: ``auto`` gets its grammar (well-formed calls;
    text costs a mask per token) rather than none. RequestError names the field."""
    if tools is None:
        check_tool_choice(tool_choice, None)  # "required" or a name without tools is an error
        return None
    checked = check_tools(tools)
    choice = check_tool_choice(tool_choice, checked)
    if choice.mode == "none":
        return None
    if parallel_tool_calls not in (None, True, False):
        raise RequestError(
            f"parallel_tool_calls must be true or false, got {parallel_tool_calls!r}"
        )
    fmt = tool_format(template)
    if fmt is None:
        raise RequestError(
            f"tools: this model's chat format ({template.source}) has no tool-call format "
            "(xspec reads DeepSeek-V4's DSML and Qwen3's <tool_call>); send the request "
            "without tools"
        )
    grammar = None
    if choice.mode != "auto" or constrain_auto:
        parallel = parallel_tool_calls is not False
        grammar = tool_grammar(fmt, checked, choice, parallel=parallel, reasoning=reasoning)
    return ToolPlan(fmt, checked, choice, grammar)


def _lit(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _json(schema: Any, defs: dict[str, Any]) -> str:
    """``%json`` of ``schema`` in xspec's JSON layout, closed and bounded as a
    response's schema (:func:`xspec.json_schema.compact_schema`), the root's definitions
    carried."""
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    body = compact_schema({**defs, **schema})
    return "%json " + json.dumps({**body, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def _excluding(tag: str) -> str:
    """A Lark terminal body: any text that does not contain ``tag``."""
    return f"(/(?s:.*)/ & ~/(?s:.*){_regex(tag)}(?s:.*)/)"


def _regex(text: str) -> str:
    """``text`` as a literal inside ``/.../``."""
    return "".join("\\" + c if c in r"\/.^$*+?()[]{}|-" else c for c in text)


def _tool(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"] for t in tools if t["function"]["name"] == name)


def tool_grammar(
    fmt: ToolFormat,
    tools: Sequence[dict[str, Any]],
    choice: ToolChoice,
    *,
    parallel: bool = True,
    reasoning: bool = False,
) -> GrammarSpec | None:
    """The constraint of ``choice`` over ``tools`` (:func:`~xspec.chat.tools.check_tools`)
    in ``fmt``; None for ``none``. ``parallel``: more than one call may be written
    (OpenAI's ``parallel_tool_calls``, default true). ``reasoning``: the output first holds
    the model's reasoning, up to ``</think>`` (thinking mode; DeepSeek-V4's prompt opened
    ``<think>``, Qwen3's model writes it). RequestError when a function's parameters
    cannot be written in the format."""
    if choice.mode == "none":
        return None
    names = [choice.name] if choice.mode == "function" else [t["function"]["name"] for t in tools]
    rules = ["%llguidance {}"]
    tool_names = [t["function"]["name"] for t in tools]
    for k, name in enumerate(names):
        fn = _tool(tools, str(name))
        where = f"tools[{tool_names.index(name)}].function.parameters"
        if fmt is DSML:
            rules += _dsml_call(f"call_{k}", str(name), fn.get("parameters", {}), where)
        else:  # the call after its opening tag
            head = _lit(f'\n{{"name": "{name}", "arguments": ')
            rules.append(
                f"call_{k}: {head} {_json(_closed(fn.get('parameters', {})), {})} "
                f"{_lit('}' + chr(10) + HERMES.close)}"
            )
    rules.append("call: " + " | ".join(f"call_{k}" for k in range(len(names))))
    if fmt is DSML:  # each invoke ends with its newline (no literal is another's prefix)
        rules.append(f"dsml_text[lazy]: /(?s:.*){_regex(DSML.end_param)}/")
        open_, sep, end = "\n\n" + DSML.open + "\n", "", " " + _lit(DSML.close)
    else:
        open_, sep, end = HERMES.open, "\n" + HERMES.open, ""
    more = f"({_lit(sep)} call)*" if sep else "call*"
    body = f"call {more}{end}" if parallel else f"call{end}"
    if choice.mode == "auto":
        rules.append(f"PLAIN: {_excluding(fmt.open)}")
        rules.append(f"HEAD: {_excluding(fmt.open)} {_lit(open_)}")
        main = f"PLAIN | HEAD {body}"
    else:
        main = f"{_lit(open_)} {body}"
    if reasoning:  # DeepSeek-V4's prompt opened <think>; Qwen3 writes it
        rules.append(f"THOUGHT: {Reasoning(opened=fmt is DSML).lark()}")
        main = f"THOUGHT ({main})"
    rules.insert(1, f"start: {main}")
    return GrammarSpec.grammar("\n".join(rules), "tool call grammar")


def _closed(params: Any) -> Any:
    """The arguments admit only the declared properties unless the schema says otherwise
    (JSON Schema's default admits any other key: a weak model fills the call with them)."""
    if (
        isinstance(params, dict)
        and "additionalProperties" not in params
        and params.get("type", "object") == "object"
        and not params.keys() & COMBINERS
    ):
        return {"type": "object", **params, "additionalProperties": False}
    return params


def _dsml_call(rule: str, name: str, params: Any, where: str) -> list[str]:
    """The rules of one DSML invoke of ``name``."""
    if not isinstance(params, dict) or not set(params) <= DSML_TOP_KEYS:
        extra = sorted(set(params) - DSML_TOP_KEYS) if isinstance(params, dict) else []
        raise RequestError(
            f"{where}: DeepSeek-V4 calls write arguments one parameter at a time, so the schema "
            f"must be an object with properties (it has {', '.join(extra) or 'no object'})"
        )
    if params.get("type", "object") != "object":
        raise RequestError(f"{where}: the type must be object, got {params.get('type')!r}")
    props, required = params.get("properties", {}), params.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        raise RequestError(f"{where}: properties must be an object and required a list")
    if missing := sorted(set(required) - set(props)):
        raise RequestError(f"{where}: required names {missing[0]!r}, which is not a property")
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, parts = [], []
    for j, (key, schema) in enumerate(props.items()):
        if not key or any(c in key for c in '"<>\n'):
            raise RequestError(f"{where}.properties: {key!r} cannot be a DSML parameter name")
        raw = isinstance(schema, dict) and _plain_string(schema)
        head = _lit(f'{Dsml.param} name="{key}" string="{"true" if raw else "false"}">')
        if raw and "enum" in schema:
            value = "(" + " | ".join(_lit(v + DSML.end_param) for v in schema["enum"]) + ")"
        elif raw:
            value = "dsml_text"  # ends with the closing tag
        else:
            value = f"{_json(schema, defs)} {_lit(DSML.end_param)}"
        rules.append(f'{rule}_p{j}: {head} {value} "\\n"')
        parts.append(f"{rule}_p{j}" + ("" if key in required else "?"))
    head, end = _lit(f'{Dsml.invoke} name="{name}">\n'), _lit(DSML.end_invoke + "\n")
    if not parts:  # the reference writes an empty line
        head, end = _lit(f'{Dsml.invoke} name="{name}">\n\n{DSML.end_invoke}\n'), ""
    rules.append(f"{rule}: {head} {' '.join(parts)} {end}")
    return rules


def _plain_string(schema: dict[str, Any]) -> bool:
    """A string parameter DSML writes as is: a bare string, or an enum of strings."""
    if schema.get("type") == "string" and set(schema) <= PLAIN_STRING_KEYS:
        return True
    enum = schema.get("enum")
    return (
        isinstance(enum, list)
        and bool(enum)
        and all(isinstance(v, str) and DSML.end_param not in v for v in enum)
        and set(schema) <= PLAIN_STRING_KEYS | {"enum"}
        and schema.get("type", "string") == "string"
    )
