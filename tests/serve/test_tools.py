"""Tool calls through a live server with the openai client: tool_choice required / a named
function give a parsed call (finish_reason tool_calls) whose arguments follow the tool's
schema, streamed deltas add up to the whole reply, tool_choice none is plain text, and bad
tools are 400s naming the field."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.serve.conftest import LiveServer

SERVERS = [("dsv4_tiny", "mtp", {"model.dtype": "float32"})]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"enum": ["Paris", "Oslo", "Lima"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "pattern": "^[a-z]{1,8}[.]py$"}},
                "required": ["path"],
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Oslo this week?"}]


def _check_weather(call) -> None:  # type: ignore[no-untyped-def]
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    args = json.loads(call.function.arguments)
    assert args["city"] in ("Paris", "Oslo", "Lima") and 1 <= args["days"] <= 7


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_required_and_named_tool_choice_give_calls(served: LiveServer) -> None:
    client = served.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        for temperature in (0.0, 0.8):
            r = client.chat.completions.create(
                model=served.name, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                parallel_tool_calls=False, max_tokens=400, temperature=temperature, seed=1,
            )  # fmt: skip
            c = r.choices[0]
            assert c.finish_reason == "tool_calls", c
            assert len(c.message.tool_calls) == 1
            if choice is named:
                _check_weather(c.message.tool_calls[0])
            else:
                assert c.message.tool_calls[0].function.name in ("get_weather", "read_file")
                json.loads(c.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_streamed_tool_calls_add_up_to_the_whole_reply(served: LiveServer) -> None:
    client = served.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {
        "model": served.name, "messages": MESSAGES, "tools": TOOLS, "tool_choice": named,
        "max_tokens": 400, "temperature": 0,
    }  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
            for d in ch.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                if d.function is not None:
                    call["name"] += d.function.name or ""
                    call["arguments"] += d.function.arguments or ""
    assert reasons == ["tool_calls"]
    got = [(c["name"], json.loads(c["arguments"])) for c in calls.values()]
    want = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
    assert got == want and all(c["id"] for c in calls.values())


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_tool_choice_none_is_plain_text(served: LiveServer) -> None:
    client = served.openai()
    kw = {"model": served.name, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
    plain = client.chat.completions.create(**kw).choices[0].message
    none = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none").choices[0]
    assert none.message.content == plain.content and not none.message.tool_calls


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": [{"type": "function"}]}, "tools", "tools"),
        ({"tool_choice": "required"}, "tools", "required"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools", "send one of them"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s(served: LiveServer, extra: dict, param: str, needle: str) -> None:
    body = {"model": served.name, "messages": MESSAGES, "max_tokens": 4} | extra
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_a_tool_call_round_trip(served: LiveServer) -> None:
    """Call, tool result, answer: the assistant's call and the tool's result go back in
    the next request (rendered in the model's format) and the model answers in text."""
    client = served.openai()
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=served.name, messages=MESSAGES, tools=TOOLS, tool_choice=named,
        parallel_tool_calls=False, max_tokens=400, temperature=0,
    ).choices[0].message  # fmt: skip
    call = first.tool_calls[0]
    _check_weather(call)
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "rain"}'},
    ]
    answer = client.chat.completions.create(
        model=served.name, messages=messages, tools=TOOLS, tool_choice="none",
        max_tokens=12, temperature=0,
    ).choices[0]  # fmt: skip
    assert answer.finish_reason in ("stop", "length") and not answer.message.tool_calls
    assert answer.message.content


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_the_openai_clients_parse_with_a_pydantic_model(served: LiveServer) -> None:
    """``client.chat.completions.parse(response_format=Model)``: the client sends the
    model's strict JSON Schema and validates the reply into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Ref(BaseModel):
        name: str = Field(pattern="^[a-z_]{1,10}$")
        kind: Literal["function", "class"]
        tags: list[Literal["io", "math"]] = Field(max_length=2)

    for temperature in (0.0, 0.8):
        done = served.openai().chat.completions.parse(
            model=served.name, messages=[{"role": "user", "content": "Describe parse()."}],
            response_format=Ref, max_tokens=64, temperature=temperature, seed=2,
        )  # fmt: skip
        parsed = done.choices[0].message.parsed
        assert isinstance(parsed, Ref) and parsed.kind in ("function", "class")
