"""Every structured output of a live server parses and validates (``jsonschema``): the
schemas of :mod:`tests.schema_cases` through the ``openai`` client, greedy and at T=0.8
(two seeds; the second seed's completions ask through vLLM's ``structured_outputs``),
streamed and not, on completions and chat, all in flight together on the default server
(``python -m xspec.serve`` with no overrides: dsv4_tiny, DSpark). Each ends with
``finish_reason: "stop"`` well within ``max_tokens``; a cut by ``max_tokens`` ends with
``"length"``; an unsupported schema feature is a 400 naming it. The slow part runs the
same requests on ``spec=none`` and finds the greedy outputs equal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.schema_cases import SCHEMAS, check, response_format
from tests.serve.conftest import LiveServer, start_server

MAX_TOKENS = 256  # the outputs here take 10 to 90 tokens
MODES = {"greedy": (0.0, 0), "t0.8-seed1": (0.8, 1), "t0.8-seed2": (0.8, 2)}
CASES = [(name, mode, stream) for name in SCHEMAS for mode in MODES for stream in (False, True)]
PROMPT = "def parse_record(line):\n"
MESSAGES = [{"role": "user", "content": "Describe a record as JSON."}]

Case = tuple[str, str, bool]
Outputs = dict[Case, tuple[str, str | None]]


def _endpoint(name: str, stream: bool) -> str:
    """Half the schemas send their streamed requests to chat, the other half to
    completions (and the unstreamed ones to the other endpoint)."""
    return "chat" if (list(SCHEMAS).index(name) % 2 == 0) == stream else "completions"


def _request(live: LiveServer, case: Case, max_tokens: int = MAX_TOKENS) -> tuple[str, str | None]:
    """(text, finish_reason) of one request; a stream's chunks joined."""
    name, mode, stream = case
    temperature, seed = MODES[mode]
    client = live.openai(timeout=300)
    kw: dict[str, Any] = dict(
        model=live.name, max_tokens=max_tokens, temperature=temperature, seed=seed
    )
    fmt = response_format(name)
    if _endpoint(name, stream) == "chat":
        if not stream:
            reply = client.chat.completions.create(messages=MESSAGES, response_format=fmt, **kw)
            return reply.choices[0].message.content or "", reply.choices[0].finish_reason
        chunks = client.chat.completions.create(
            messages=MESSAGES, response_format=fmt, stream=True, **kw
        )
        text, finish = "", None
        for c in chunks:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish
    body = (
        {"structured_outputs": {"json": SCHEMAS[name]}} if seed == 2 else {"response_format": fmt}
    )
    if not stream:
        done = client.completions.create(prompt=PROMPT, extra_body=body, **kw)
        return done.choices[0].text, done.choices[0].finish_reason
    text, finish = "", None
    for c in client.completions.create(prompt=PROMPT, extra_body=body, stream=True, **kw):
        if c.choices:
            text += c.choices[0].text
            finish = c.choices[0].finish_reason or finish
    return text, finish


def _run_all(live: LiveServer, cases: list[Case]) -> Outputs:
    with ThreadPoolExecutor(len(cases)) as pool:  # all in flight: the engine batches them
        return dict(zip(cases, pool.map(lambda c: _request(live, c), cases)))


@pytest.fixture(scope="module")
def default_server() -> Iterator[LiveServer]:
    live = start_server("dsv4_tiny", "dspark")  # conf/config.yaml's defaults, no overrides
    yield live
    live.stop()


@pytest.fixture(scope="module")
def outputs(default_server: LiveServer) -> Outputs:
    return _run_all(default_server, CASES)


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{'stream' if c[2] else 'whole'}"
)
def test_every_output_parses_and_validates(outputs: Outputs, case: Case) -> None:
    text, finish = outputs[case]
    check(case[0], text)
    assert finish == "stop", (case, finish, text)


def test_open_schemas_are_written_closed_and_bounded(outputs: Outputs) -> None:
    """A schema that leaves extra keys open gets none; an unbounded number ends."""
    for (name, _, _), (text, _) in outputs.items():
        value = json.loads(text)
        if name in ("unclosed_object", "refs"):
            assert set(value) == set(SCHEMAS[name]["properties"]), text
        if name == "numeric_bounds":
            assert abs(value["score"]) <= 2**53 - 1 and len(text) < 200, text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_cut_by_max_tokens_finishes_with_length(
    default_server: LiveServer, outputs: Outputs, stream: bool
) -> None:
    for case in (("nested", "greedy", stream), ("nested", "t0.8-seed1", stream)):
        text, finish = _request(default_server, case, max_tokens=6)
        assert finish == "length" and text.startswith('{"user":'), (case, text)
        with pytest.raises(ValueError):  # a prefix of a valid output, not a whole one
            json.loads(text)
        if case[1] == "greedy":
            assert outputs[case][0].startswith(text), (outputs[case], text)


@pytest.mark.slow
def test_spec_none_gives_the_same_greedy_outputs(outputs: Outputs) -> None:
    plain = start_server("dsv4_tiny", "none")
    try:
        cases = [c for c in CASES if c[1] == "greedy"]
        got = _run_all(plain, cases)
    finally:
        plain.stop()
    for case in cases:
        check(case[0], got[case][0])
        assert got[case] == outputs[case], case


@pytest.mark.parametrize(
    ("schema", "needle"),
    [
        ({"type": "object", "unevaluatedProperties": False}, 'Unimplemented keys: ["unevaluatedProperties"]'),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf constraints are not supported"),
        ({"type": "string", "format": "credit-card"}, "Unknown format: credit-card"),
        ({"type": "string", "pattern": "(?=a)b"}, "look-around"),
        ({"properties": {"a": {"$ref": "#/$defs/gone"}}}, "Pointer '/$defs/gone' does not exist"),
    ],
)  # fmt: skip
def test_unsupported_schema_features_are_400s_naming_them(
    default_server: LiveServer, schema: dict, needle: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    body = {"model": default_server.name, "messages": MESSAGES, "response_format": fmt}
    r = httpx.post(default_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "response_format", err
