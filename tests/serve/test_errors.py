"""Bad requests get the right status and OpenAI's error body, and the server keeps
serving: malformed JSON, wrong field types, an unknown model, max_tokens past the context,
a negative temperature, unsupported fields, an oversize body, a full queue."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve.conftest import LiveServer, start_server
from xspec.serve.protocol import IGNORED, REFUSED, Refused, extra_problems


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server(
        "qwen3_tiny",
        "none",
        {
            "model.dtype": "float32",
            "server.concurrency": 1,
            "server.max_queue": 0,
            "server.max_body_bytes": 4096,
        },
    )
    yield server
    server.stop()


def post(live: LiveServer, body: object | bytes, path: str = "/v1/completions") -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(
            live.url + path, content=body, headers={"content-type": "application/json"}
        )
    return httpx.post(live.url + path, json=body, timeout=60)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["message"]
    return err


def ok(live: LiveServer) -> None:
    r = post(live, {"model": live.name, "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("body", "status", "words", "param"),
    [
        (b"{not json", 400, "not valid JSON", None),
        (b"", 400, "the body is empty", None),  # OpenAI: 400, not 422
        ({"model": "x", "prompt": "a"}, 404, "does not exist", "model"),
        ({"prompt": "a"}, 422, "model", "model"),
        ({"model": "M", "prompt": {"a": 1}}, 422, "prompt", "prompt"),
        ({"model": "M", "prompt": "a", "max_tokens": "many"}, 422, "max_tokens", "max_tokens"),
        ({"model": "M", "prompt": "a", "max_tokens": 10**6}, 400, "max_tokens 1000000", "max_tokens"),
        ({"model": "M", "prompt": "a", "max_tokens": 0}, 400, "max_tokens must be >= 1", "max_tokens"),
        ({"model": "M", "prompt": "a", "temperature": -1}, 400, "temperature", "temperature"),
        ({"model": "M", "prompt": "a", "top_p": 0}, 400, "top_p", "top_p"),
        ({"model": "M", "prompt": [10**9]}, 400, "vocabulary", "prompt"),
        ({"model": "M", "prompt": ""}, 400, "empty", "prompt"),
        ({"model": "M", "prompt": ["a"] * 65}, 400, "at most 64", "prompt"),
        ({"model": "M", "prompt": ["a", ""]}, 400, "prompt[1]: empty", "prompt"),
        ({"model": "M", "prompt": "a", "stop_token_ids": [-1]}, 400, "stop_token_ids", "stop_token_ids"),
        ({"model": "M", "prompt": "a", "stop_token_ids": [10**9]}, 400, "stop_token_ids outside the vocabulary", "prompt"),
        ({"model": "M", "prompt": "a", "n": 17}, 400, "n must be an integer in [1, 16]", "n"),
        ({"model": "M", "prompt": "a", "logprobs": 21}, 400, "logprobs must be in [0, 20]", "logprobs"),
        ({"model": "M", "prompt": "a", "logprobs": True}, 422, "logprobs", "logprobs"),
        ({"model": "M", "prompt": "a", "presence_penalty": 3}, 400, "presence_penalty must be", "presence_penalty"),
        ({"model": "M", "prompt": "a", "logit_bias": {"5": 101}}, 400, "[-100, 100]", "logit_bias"),
        ({"model": "M", "prompt": "a", "logit_bias": {"x": 1}}, 400, "token ids", "logit_bias"),
        ({"model": "M", "prompt": "a", "logit_bias": {"999999": 1}}, 400, "vocabulary", "logit_bias"),
        ({"model": "M", "prompt": "a", "repetition_penalty": 0}, 400, "repetition_penalty", "repetition_penalty"),
        ({"model": "M", "prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens (5) must be <= max_tokens", "min_tokens"),
        ({"model": "M", "prompt": "a", "logprobs_mode": "logits"}, 400, "logprobs_mode must be one of", "logprobs_mode"),
        ({"model": "M", "prompt": "a", "max_token": 5}, 400, "unrecognized request field 'max_token'", "max_token"),
        ({"model": "M", "prompt": "a", "stream_options": {"include_usage": True}}, 400, "stream: true", "stream_options"),
        ({"model": "M", "prompt": "a", "top_k": -2}, 400, "top_k", "top_k"),
        ({"model": "M", "prompt": "a", "seed": -1}, 400, "seed", "seed"),
        ({"model": "M", "prompt": "a", "stop": [""]}, 400, "stop", "stop"),
    ],
)  # fmt: skip
def test_bad_completion_requests(
    live: LiveServer, body: object, status: int, words: str, param: str | None
) -> None:
    """Each error names the request's own field, in the message and in ``param``."""
    if isinstance(body, dict) and body.get("model") == "M":
        body = {**body, "model": live.name}
    err = error_of(post(live, body), status)
    assert words in err["message"] and "max_new_tokens" not in err["message"], err
    assert err["param"] == param, err
    ok(live)  # the server keeps serving


def test_bad_chat_requests(live: LiveServer) -> None:
    path = "/v1/chat/completions"
    error_of(post(live, {"model": live.name, "messages": []}, path), 422)
    error_of(post(live, {"model": live.name, "messages": [{"content": "hi"}]}, path), 422)
    err = error_of(
        post(live, {"model": live.name, "messages": [{"role": "user", "content": "a"}],
                    "tools": [{"type": "function"}]}, path),
        400,
    )  # fmt: skip
    assert "tools" in err["message"]
    ok(live)


def test_chat_errors_name_the_request_field(live: LiveServer) -> None:
    path, hi = "/v1/chat/completions", [{"role": "user", "content": "a"}]
    body = {"model": live.name, "messages": hi, "max_completion_tokens": 0}
    err = error_of(post(live, body, path), 400)
    assert err["message"] == "max_completion_tokens must be >= 1 (got 0)"
    assert err["param"] == "max_completion_tokens"
    err = error_of(post(live, {"model": live.name, "messages": hi, "max_tokens": 10**6}, path), 400)
    assert "max_tokens 1000000" in err["message"] and err["param"] == "max_tokens"


def test_every_refused_field_is_refused_by_name_unless_neutral(live: LiveServer) -> None:
    """Each field of REFUSED, at a value that is not neutral, is a 400 naming it (they
    were accepted with 200 and ignored: the client believed it got them); all of them at
    once at their neutral values, and the IGNORED ones, are served."""
    for kind, path in (("completions", "/v1/completions"), ("chat", "/v1/chat/completions")):
        base: dict = {"model": live.name, "max_tokens": 2}
        base |= (
            {"messages": [{"role": "user", "content": "a"}]} if kind == "chat" else {"prompt": "a"}
        )
        neutral = {}
        for name, rule in REFUSED[kind].items():
            err = error_of(post(live, base | {name: 12345}, path), 400)
            assert err["param"] == name and err["message"].startswith(f"{name}=12345: "), err
            neutral[name] = rule.neutral[-1] if rule.neutral else None
        r = post(live, base | neutral | {name: "x" for name in IGNORED}, path)
        assert r.status_code == 200, r.text


def test_neutral_values_are_compared_as_json() -> None:
    """0 is not false and 1 is not true (Python's 0 == False would let logprobs=0 in)."""
    rules = {"logprobs": Refused((False,)), "n": Refused((1,)), "p": Refused((0,))}
    assert extra_problems({"logprobs": False, "n": 1, "p": 0.0}, rules) == []
    bad = extra_problems({"logprobs": 0, "n": True, "p": False}, rules)
    assert [name for name, _ in bad] == ["logprobs", "n", "p"]


def test_text_that_is_not_unicode_is_a_400(live: LiveServer) -> None:
    """A lone surrogate (JSON "\\ud800") was a 500 text/plain from the tokenizer."""
    body = {"model": live.name, "prompt": "a\ud800b", "max_tokens": 2}
    err = error_of(post(live, json.dumps(body).encode()), 400)  # the escape, as a client sends
    assert "lone surrogate U+D800" in err["message"] and err["param"] == "prompt"
    chat = {"model": live.name, "messages": [{"role": "user", "content": "a\ud800b"}]}
    err = error_of(post(live, json.dumps(chat).encode(), "/v1/chat/completions"), 400)
    assert "lone surrogate U+D800" in err["message"] and err["param"] == "messages"
    ok(live)


def test_unknown_path_and_oversize_body(live: LiveServer) -> None:
    assert error_of(httpx.get(live.url + "/v1/nothing"), 404)["type"] == "not_found_error"
    big = {"model": live.name, "prompt": "x" * 10_000}
    assert "max_body_bytes" in error_of(post(live, big), 413)["message"]

    def chunks() -> Iterator[bytes]:  # no content-length: counted as it arrives
        yield b'{"model": "m", "prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    r = httpx.post(live.url + "/v1/completions", content=chunks())
    assert "max_body_bytes" in error_of(r, 413)["message"]
    ok(live)


def test_a_full_queue_answers_503_with_retry_after(live: LiveServer) -> None:
    """concurrency 1, max_queue 0: while one request streams, the next gets 503."""
    client = live.openai()
    stream = client.completions.create(
        model=live.name, prompt=[1, 2, 3], max_tokens=400, stream=True, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # it runs
    r = post(live, {"model": live.name, "prompt": "a", "max_tokens": 2})
    err = error_of(r, 503)
    assert err["type"] == "overloaded_error" and r.headers["retry-after"] == "1"
    stream.close()  # the client leaves: its request is aborted, its slot freed
    loop = live.ctx.loop
    for _ in range(200):
        if loop.in_flight == 0:
            break
        time.sleep(0.05)
    assert loop.in_flight == 0 and live.llm._built.engine.pool.reserved == 0
    ok(live)


def test_a_client_that_leaves_a_plain_request_aborts_it(live: LiveServer) -> None:
    """No stream: the handler notices the disconnect (it polls every second) and aborts
    the request, whose slot and memory return."""
    body = {"model": live.name, "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/completions", json=body, timeout=0.5)
    loop = live.ctx.loop
    for _ in range(100):
        if loop.in_flight == 0:
            break
        time.sleep(0.05)
    assert loop.in_flight == 0 and live.llm._built.engine.pool.reserved == 0
    ok(live)


def test_a_request_past_the_timeout_gets_504_and_is_aborted() -> None:
    live = start_server(
        "qwen3_tiny", "none", {"model.dtype": "float32", "server.request_timeout_s": 0.5}
    )
    try:
        body = {"model": live.name, "prompt": [1, 2, 3], "max_tokens": 2000, "ignore_eos": True}
        err = error_of(post(live, body), 504)
        assert err["type"] == "timeout" and "request_timeout_s" in err["message"]
        for _ in range(100):
            if live.ctx.loop.in_flight == 0:
                break
            time.sleep(0.05)
        assert live.ctx.loop.in_flight == 0 and live.llm._built.engine.pool.reserved == 0
        # streamed: the stream ends with a timeout error event and [DONE], and is aborted
        with httpx.stream(
            "POST", live.url + "/v1/completions", json=body | {"stream": True}, timeout=60
        ) as r:
            events = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = json.loads(events[-2])["error"]
        assert err["type"] == "timeout" and err["code"] == 504
        assert len(events) > 3  # text came first
        for _ in range(100):
            if live.ctx.loop.in_flight == 0:
                break
            time.sleep(0.05)
        assert live.ctx.loop.in_flight == 0 and live.llm._built.engine.pool.reserved == 0
    finally:
        live.stop()
