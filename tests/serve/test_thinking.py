"""Thinking mode through a live server with the openai client: the reply's reasoning is
split off (``message.reasoning_content``, streamed as ``delta.reasoning_content``), a
response_format or a tool call applies after ``</think>`` (the content parses and
validates; the calls are parsed from after the reasoning), greedy and at T=0.8, streamed
and not; a reply cut while it thinks is all reasoning; thinking off is unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.schema_cases import REF_FORMAT as FORMAT
from tests.schema_cases import REF_SCHEMA as SCHEMA
from tests.serve.conftest import LiveServer

SERVERS = [
    ("dsv4_tiny", "dspark", {"model.dtype": "float32"}),  # the prompt opens <think>
    ("qwen3_tiny", "none", None),  # the model writes <think>
]
MESSAGES = [{"role": "user", "content": "def parse_record(line):\n"}]
THINKING = {"chat_template_kwargs": {"thinking": True}}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    }
]


def _ids(s: tuple) -> str:
    return f"{s[0]}-{s[1]}"


def _streamed(served: LiveServer, kw: dict[str, Any]) -> tuple[str, str, list, str | None]:
    """(reasoning, content, tool call deltas, finish_reason) of a streamed reply."""
    reasoning, content, calls, reason = "", "", [], None
    for chunk in served.openai().chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            delta = c.delta
            part = getattr(delta, "reasoning_content", None) or ""
            assert "</think>" not in part and not (content and part)  # reasoning comes first
            reasoning += part
            content += delta.content or ""
            calls += delta.tool_calls or []
            reason = c.finish_reason or reason
    return reasoning, content, calls, reason


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=_ids)
def test_a_schema_applies_after_the_reasoning(served: LiveServer) -> None:
    client = served.openai()
    for temperature in (0.0, 0.8):
        kw = {
            "model": served.name, "messages": MESSAGES, "response_format": FORMAT,
            "max_tokens": 200, "temperature": temperature, "seed": 3,
            "extra_body": {**THINKING, "max_reasoning_chars": 40},
        }  # fmt: skip
        c = client.chat.completions.create(**kw).choices[0]
        reasoning = c.message.reasoning_content  # type: ignore[attr-defined]
        assert isinstance(reasoning, str) and len(reasoning) <= 40 and "</think>" not in reasoning
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content or ""), SCHEMA)
        r, content, _, reason = _streamed(served, kw)
        assert (r, content, reason) == (reasoning, c.message.content, "stop"), temperature


@pytest.mark.parametrize("served", SERVERS[:1], indirect=True, ids=_ids)
def test_the_openai_clients_parse_after_the_reasoning(served: LiveServer) -> None:
    from typing import Literal

    from pydantic import BaseModel, Field

    class Ref(BaseModel):
        name: str = Field(pattern="^[a-z_]{1,10}$")
        kind: Literal["function", "class"]

    done = served.openai().chat.completions.parse(
        model=served.name, messages=MESSAGES, response_format=Ref, max_tokens=120,
        temperature=0.8, seed=2, extra_body={**THINKING, "max_reasoning_chars": 24},
    )  # fmt: skip
    message = done.choices[0].message
    assert isinstance(message.parsed, Ref) and len(message.reasoning_content) <= 24  # type: ignore[attr-defined]


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=_ids)
def test_a_reply_cut_while_it_thinks_is_all_reasoning(served: LiveServer) -> None:
    """Without a bound the tiny models never close their reasoning: max_tokens ends it."""
    kw = {
        "model": served.name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
        "response_format": {"type": "json_object"}, "extra_body": THINKING,
    }  # fmt: skip
    c = served.openai().chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    reasoning = c.message.reasoning_content  # type: ignore[attr-defined]
    assert reasoning and "</think>" not in reasoning
    assert _streamed(served, kw) == (reasoning, "", [], "length")


def test_thinking_without_a_grammar_splits_the_same_text() -> None:
    """The DeepSeek-V4 preset's plain prompt is the same with thinking on or off, so the
    greedy reply is too: with it on, it is reasoning (it never writes </think>)."""
    from tests.serve.conftest import start_server

    served = start_server("dsv4_tiny", "mtp", {"model.dtype": "float32"})
    try:
        kw = {"model": served.name, "messages": MESSAGES, "max_tokens": 10, "temperature": 0}
        client = served.openai()
        off = client.chat.completions.create(**kw).choices[0].message
        assert getattr(off, "reasoning_content", None) is None and off.content
        on = client.chat.completions.create(**kw, extra_body=THINKING).choices[0].message
        assert on.reasoning_content == off.content and on.content is None  # type: ignore[attr-defined]
        assert _streamed(served, kw | {"extra_body": THINKING})[:2] == (off.content, "")
    finally:
        served.stop()


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=_ids)
def test_tool_calls_are_parsed_after_the_reasoning(served: LiveServer) -> None:
    client = served.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        for temperature in (0.0, 0.8):
            kw = {
                "model": served.name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": choice,
                "parallel_tool_calls": False, "max_tokens": 300, "temperature": temperature,
                "seed": 1, "extra_body": {**THINKING, "max_reasoning_chars": 30},
            }  # fmt: skip
            c = client.chat.completions.create(**kw).choices[0]
            assert c.finish_reason == "tool_calls", c
            reasoning = c.message.reasoning_content  # type: ignore[attr-defined]
            assert isinstance(reasoning, str) and len(reasoning) <= 30
            (call,) = c.message.tool_calls or []
            args = json.loads(call.function.arguments)
            assert call.function.name == "get_weather" and args["city"] in ("Paris", "Oslo", "Lima")
            r, _, calls, reason = _streamed(served, kw)
            assert (r, reason) == (reasoning, "tool_calls")
            assert [d.function.name for d in calls if d.function.name] == ["get_weather"]
            assert json.loads("".join(d.function.arguments or "" for d in calls)) == args


@pytest.mark.parametrize("served", SERVERS[:1], indirect=True, ids=_ids)
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"max_reasoning_chars": 10}, "thinking"),  # a bound needs a thinking mode
        ({**THINKING, "max_reasoning_chars": -1}, "must be in"),
    ],
)
def test_bad_reasoning_bounds_are_400s(served: LiveServer, extra: dict, needle: str) -> None:
    body = {"model": served.name, "messages": MESSAGES, "max_tokens": 4} | extra
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "max_reasoning_chars", err
