"""Tool calls: the request's ``tools`` and ``tool_choice`` checked, and a model's output
text read back into OpenAI ``tool_calls``, whole or streamed.

A chat format writes calls in its own syntax (:class:`ToolFormat`):

* ``dsml``: DeepSeek-V4's DSML block, after the answer's text::

      \\n\\n<｜DSML｜tool_calls>
      <｜DSML｜invoke name="get_weather">
      <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
      <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
      </｜DSML｜invoke>
      </｜DSML｜tool_calls>

  (a string parameter is written as is with ``string="true"``, any other value as JSON);
* ``hermes``: Qwen3's (Hermes-style) JSON in tags, one tag per call::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}
      </tool_call>

:meth:`ToolFormat.parse` splits a whole output into its text and its calls;
:class:`ToolCallStream` does the same over streamed text, as OpenAI ``delta`` objects.
Whitespace next to a call is not content. A call that does not parse (a bad tag, JSON
that does not load, a function the request did not offer) is text: it and everything
after it are returned as content, whole or streamed; so is a call cut off by the end of
the output. The calls' grammars are in :mod:`xspec.chat.tool_grammar`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from xspec.errors import RequestError

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128
Event = tuple[str, Any]  # ("content", str) or ("call", ToolCall)


# -- the request -----------------------------------------------------------------------


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` (OpenAI function specs ``{"type": "function", "function":
    {"name", "description"?, "parameters"?}}``), checked; the function objects are kept as
    given (a prompt shows them). RequestError names the entry and the key."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of {type: function, function} objects")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"tools has {len(tools)} entries; at most {MAX_TOOLS}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f'{where} must be an object with "type": "function"')
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{where}.function must be an object with a name")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise RequestError(
                f"{where}.function.name must be 1 to 64 letters, digits, _ or -, got {name!r}"
            )
        if name in seen:
            raise RequestError(f"{where}.function.name {name!r} is given twice")
        seen.add(name)
        if not isinstance(fn.get("parameters", {}), dict):
            raise RequestError(f"{where}.function.parameters must be a JSON Schema object")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string")
        out.append({"type": "function", "function": dict(fn)})  # as given: a prompt shows it
    return out


@dataclass(frozen=True)
class ToolChoice:
    """``none`` (no call), ``auto`` (the model decides), ``required`` (at least one call)
    or ``function`` (a call of ``name``)."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


def check_tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]] | None) -> ToolChoice:
    """OpenAI's ``tool_choice``: ``"none"``, ``"auto"``, ``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``; None means ``auto`` with tools and
    ``none`` without. ``tools``: as :func:`check_tools` returns them."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise RequestError(f'tool_choice is "{tool_choice}" but the request has no tools')
        return ToolChoice(tool_choice)
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not name:
        raise RequestError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise RequestError(
            f"tool_choice names function {name!r}, which is not in tools ({', '.join(names)})"
        )
    return ToolChoice("function", name)


# -- calls -----------------------------------------------------------------------------


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


def call_arguments(call: dict[str, Any], where: str) -> dict[str, Any]:
    """An OpenAI ``tool_calls`` entry's arguments as an object (the JSON text OpenAI sends,
    or an object, as some clients send)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where} must be an object with function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):
            raise RequestError(f"{where}.function.arguments is not JSON text") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object")
    return args


# -- formats ---------------------------------------------------------------------------


class ToolFormat(ABC):
    """How one chat format writes calls. A subclass gives the tag that opens calls
    (``open``) and :meth:`_scan_calls`, which reads the calls from that tag on."""

    name: str
    open: str

    @abstractmethod
    def render_calls(self, tool_calls: Sequence[dict[str, Any]], where: str) -> str:
        """An assistant message's OpenAI ``tool_calls`` as the model writes them."""

    @abstractmethod
    def _scan_calls(self, text: str, start: int, final: bool) -> tuple[list[Event], int, bool]:
        """The calls from ``text[start:]`` (which begins with :attr:`open`): (events,
        where reading stopped, whether the calls end there). Unfinished text stops the
        scan before it unless ``final``; a malformed call is a ``("bad", start)`` event."""

    def parse(
        self,
        text: str,
        tools: Sequence[dict[str, Any]] | None = None,
        new_id: Callable[[], str] = new_call_id,
    ) -> ParsedOutput:
        """``text`` (the output, without reasoning and stop token) as content and calls.
        With ``tools``, a call of a function not among them is text."""
        events, _ = _scan(self, text, True, _names(tools))
        content = "".join(v for kind, v in events if kind == "content")
        calls = [ToolCall(new_id(), c.name, c.arguments) for kind, c in events if kind == "call"]
        return ParsedOutput(content, calls)


def _names(tools: Sequence[dict[str, Any]] | None) -> frozenset[str] | None:
    return None if tools is None else frozenset(t["function"]["name"] for t in tools)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


def _scan(
    fmt: ToolFormat,
    text: str,
    final: bool,
    names: frozenset[str] | None,
    pos: int = 0,
    after_call: bool = False,
) -> tuple[list[Event], tuple[int, bool, int]]:
    """Events of ``text[pos:]`` (``after_call``: a block of calls ends at ``pos``), and where
    a scan of the text grown longer may start again: (position, after_call, the number of
    events before it, which cannot change). Unless ``final``, text that could still change
    what it is (whitespace, a part of a tag, an unfinished call) is left out."""
    events: list[Event] = []
    resume = (pos, after_call, 0)
    while True:
        at = text.find(fmt.open, pos)
        raw = text[pos:] if at < 0 else text[pos:at]
        segment = raw.lstrip() if after_call else raw
        if at < 0:
            if not final:  # whitespace and a started tag wait for what follows
                segment = segment[: len(segment) - _partial_tail(segment, fmt.open)]
                segment = segment.rstrip() if segment.strip() else ""
                if segment:  # text given out is final: start again after it
                    start = pos + (len(raw) - len(raw.lstrip()) if after_call else 0)
                    resume = (start + len(segment), False, len(events) + 1)
            events.append(("content", segment))
            return events, resume
        events.append(("content", segment.rstrip()))
        found, end, closed = fmt._scan_calls(text, at, final)
        for k, (kind, value) in enumerate(found):
            if kind == "bad" or (names is not None and value.name not in names):
                # the rest is text, from the tag when no call of this block was read
                start = at if k == 0 else value if kind == "bad" else value.start
                events.append(("content", text[start:]))
                return events, resume
            events.append((kind, value))
        if not closed:
            if final:
                events.append(("content", text[end:]))
            return events, resume
        pos, after_call = end, True
        resume = (pos, True, len(events))


@dataclass(frozen=True)
class _Call:
    name: str
    arguments: str
    start: int  # where its text begins in the output


def _reject(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _loads(text: str) -> Any:
    """JSON text as Python data; NaN and Infinity (which Python's json reads) refused."""
    return json.loads(text, parse_constant=_reject)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _prefix_of(text: str, i: int, *tags: str) -> bool:
    """``text[i:]`` is a strict beginning of one of ``tags`` (more text may finish it)."""
    rest = text[i:]
    return any(t.startswith(rest) and rest != t for t in tags)


class Dsml(ToolFormat):
    """DeepSeek-V4's DSML (the checkpoint's ``encoding/README.md``)."""

    name = "dsml"
    TOKEN = "｜DSML｜"
    open = f"<{TOKEN}tool_calls>"
    close = f"</{TOKEN}tool_calls>"
    invoke, end_invoke = f"<{TOKEN}invoke", f"</{TOKEN}invoke>"
    param, end_param = f"<{TOKEN}parameter", f"</{TOKEN}parameter>"
    _header = re.compile(rf'<{TOKEN}invoke name="([^"<>]*)">')
    _param = re.compile(rf'<{TOKEN}parameter name="([^"<>]*)" string="(true|false)">', re.S)

    def render_calls(self, tool_calls: Sequence[dict[str, Any]], where: str) -> str:
        invokes = []
        for k, call in enumerate(tool_calls):
            args = call_arguments(call, f"{where}.tool_calls[{k}]")
            params = "".join(
                f'{self.param} name="{key}" string="{str(isinstance(v, str)).lower()}">'
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                f"{self.end_param}\n"
                for key, v in args.items()
            )
            name = call["function"]["name"]
            invokes.append(f'{self.invoke} name="{name}">\n{params or chr(10)}{self.end_invoke}')
        return "\n\n" + self.open + "\n" + "\n".join(invokes) + "\n" + self.close

    def _scan_calls(self, text: str, start: int, final: bool) -> tuple[list[Event], int, bool]:
        events: list[Event] = []
        i = start + len(self.open)
        while True:
            j = _skip_ws(text, i)
            if text.startswith(self.close, j):
                return events, j + len(self.close), True
            if not text.startswith(self.invoke, j):
                if not final and (j == len(text) or _prefix_of(text, j, self.close, self.invoke)):
                    return events, i, False
                events.append(("bad", j))
                return events, len(text), True
            end = text.find(self.end_invoke, j)
            if end < 0:
                if final:
                    events.append(("bad", j))
                    return events, len(text), True
                return events, j, False
            call = self._invoke(text[j:end], j)
            events.append(("call", call) if call is not None else ("bad", j))
            if call is None:
                return events, len(text), True
            i = end + len(self.end_invoke)

    def _invoke(self, body: str, start: int) -> _Call | None:
        head = self._header.match(body)
        if head is None:
            return None
        args: dict[str, Any] = {}
        i = head.end()
        while (i := _skip_ws(body, i)) < len(body):
            m = self._param.match(body, i)
            end = body.find(self.end_param, i)
            if m is None or end < 0 or m.group(1) in args:
                return None
            value = body[m.end() : end]
            if m.group(2) == "false":
                try:
                    args[m.group(1)] = _loads(value)
                except (ValueError, RecursionError):
                    return None
            else:
                args[m.group(1)] = value
            i = end + len(self.end_param)
        return _Call(head.group(1), json.dumps(args, ensure_ascii=False), start)


class Hermes(ToolFormat):
    """Qwen3's calls, ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    open, close = "<tool_call>", "</tool_call>"

    def render_calls(self, tool_calls: Sequence[dict[str, Any]], where: str) -> str:
        parts = []
        for k, call in enumerate(tool_calls):
            args = call_arguments(call, f"{where}.tool_calls[{k}]")
            name = json.dumps(call["function"]["name"], ensure_ascii=False)
            body = f'{{"name": {name}, "arguments": {json.dumps(args, ensure_ascii=False)}}}'
            parts.append(f"{self.open}\n{body}\n{self.close}")
        return "\n".join(parts)

    def _scan_calls(self, text: str, start: int, final: bool) -> tuple[list[Event], int, bool]:
        end = text.find(self.close, start)
        if end < 0:
            if final:
                return [("bad", start)], len(text), True
            return [], start, False
        try:
            body = _loads(text[start + len(self.open) : end])
        except (ValueError, RecursionError):
            return [("bad", start)], len(text), True
        ok = (
            isinstance(body, dict)
            and set(body) <= {"name", "arguments"}
            and isinstance(body.get("name"), str)
            and isinstance(body.get("arguments", {}), dict)
        )
        if not ok:
            return [("bad", start)], len(text), True
        args = json.dumps(body.get("arguments", {}), ensure_ascii=False)
        return [("call", _Call(body["name"], args, start))], end + len(self.close), True


DSML, HERMES = Dsml(), Hermes()
FORMATS: dict[str, ToolFormat] = {DSML.name: DSML, HERMES.name: HERMES}


# -- streaming -------------------------------------------------------------------------


class ToolCallStream:
    """:meth:`ToolFormat.parse` over text that arrives in pieces: :meth:`feed` each piece
    and :meth:`finish` at the end; both return OpenAI ``delta`` objects. Content arrives as
    ``{"content": ...}``, except whitespace and any part of a tag until what follows says
    what it is; a call arrives once it is complete, as two deltas with its ``index``: first
    ``id``, ``type`` and ``function.name`` (with ``arguments: ""``), then
    ``function.arguments``. The deltas put together equal the parse of the whole text."""

    def __init__(
        self,
        fmt: ToolFormat,
        tools: Sequence[dict[str, Any]] | None = None,
        new_id: Callable[[], str] = new_call_id,
    ) -> None:
        self.fmt, self._names, self._new_id = fmt, _names(tools), new_id
        self._text = ""
        self._pos, self._after_call = 0, False  # where the next scan starts
        self._done = 0  # events of that scan fully sent
        self._sent = 0  # characters of the growing content event sent
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        self._text += text
        return self._deltas(final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict[str, Any]]:
        events, (pos, after_call, fixed) = _scan(
            self.fmt, self._text, final, self._names, self._pos, self._after_call
        )
        out: list[dict[str, Any]] = []
        for k in range(self._done, len(events)):
            kind, value = events[k]
            if kind == "content":
                if len(value) > self._sent:
                    out.append({"content": value[self._sent :]})
                if k == len(events) - 1 and not final:  # it may grow
                    self._sent = len(value)
                    break
                self._sent = 0
            else:
                out += self._call_deltas(value)
            self._done = k + 1
        if fixed:  # the next scan starts where this one's events can no longer change
            self._pos, self._after_call = pos, after_call
            if fixed > self._done:  # the growing content is behind the restart
                self._sent = 0
            self._done = max(0, self._done - fixed)
        return out

    def _call_deltas(self, value: _Call) -> list[dict[str, Any]]:
        call = ToolCall(self._new_id(), value.name, value.arguments)
        index = len(self.calls)
        self.calls.append(call)
        head = {"name": call.name, "arguments": ""}
        return [
            {"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": head}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
        ]
