"""Structured output through a live server: the openai client's response_format and
vLLM's structured_outputs (and guided_*) constrain completions and chat, streamed and
not, with DSpark drafting; each output equals the Python API's for the same grammar, and
bad grammars are 400s naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.schema_cases import REF_FORMAT as FORMAT
from tests.serve.conftest import LiveServer

SERVERS = [("dsv4_tiny", "dspark", {"model.dtype": "float32"})]


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_response_format_constrains_chat_and_completions(served: LiveServer) -> None:
    client = served.openai()
    offline = served.llm.generate("def parse(", 48, response_format=FORMAT)[0].text
    done = client.completions.create(
        model=served.name, prompt="def parse(", max_tokens=48, temperature=0,
        extra_body={"response_format": FORMAT},
    )  # fmt: skip
    assert done.choices[0].text == offline and done.choices[0].finish_reason == "stop"
    obj = json.loads(offline)
    assert list(obj) == ["name", "kind", "line"] and obj["kind"] in ("function", "class")
    chat = client.chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": "Describe parse()."}],
        max_tokens=48, temperature=0, response_format=FORMAT,
    )  # fmt: skip
    reply = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and list(json.loads(reply)) == list(obj)
    pieces = client.chat.completions.create(
        model=served.name, messages=[{"role": "user", "content": "Describe parse()."}],
        max_tokens=48, temperature=0, response_format=FORMAT, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == reply


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_structured_outputs_and_guided_fields(served: LiveServer) -> None:
    client = served.openai()
    for extra, check in (
        ({"structured_outputs": {"regex": r"[a-z]{2,6}\(\)"}}, r"[a-z]{2,6}\(\)"),
        ({"guided_regex": r"[a-z]{2,6}\(\)"}, r"[a-z]{2,6}\(\)"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "yes|no"),
        ({"guided_choice": ["yes", "no"]}, "yes|no"),
    ):
        for temperature in (0.0, 0.8):
            out = client.completions.create(
                model=served.name, prompt="x = ", max_tokens=16, temperature=temperature,
                seed=3, extra_body=extra,
            )  # fmt: skip
            assert re.fullmatch(check, out.choices[0].text), (extra, out.choices[0].text)


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
@pytest.mark.parametrize(
    ("extra", "param", "needle"),
    [
        ({"structured_outputs": {"regex": "[0-9"}}, "structured_outputs", "unclosed character class"),
        ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type='yaml'"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "not both"),
        ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs", "not both"),
        ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "prompt", "ignore_eos cannot go with structured output"),
        ({"guided_whitespace_pattern": " *", "guided_json": {}}, "guided_whitespace_pattern", "JSON layout is fixed"),
    ],
)  # fmt: skip
def test_bad_grammars_are_400s(served: LiveServer, extra: dict, param: str, needle: str) -> None:
    body = {"model": served.name, "prompt": "x", "max_tokens": 4} | extra
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == param, err
