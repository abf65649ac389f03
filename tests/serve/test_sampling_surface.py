"""The sampling surface through the real ``openai`` client against a live ``spec=mtp``
server: logprobs (completions' legacy shape and chat's ``content``, streamed and not),
``echo`` with the prompt's logprobs (lm-evaluation-harness's loglikelihood request, its
exact shape, equal to ``xspec.LLM.score``), ``n`` choices, and the penalties."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

import xspec
from tests.serve.conftest import LiveServer, start_server

FP32 = {"model.dtype": "float32"}
TOL = 2e-5  # the forward's row-count invariance (tests/spec/test_logprobs.py)
PROMPT = "def fibonacci(n):\n"
N = 16


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server("dsv4_tiny", "mtp", FP32)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference() -> xspec.LLM:
    """``spec=none`` on the same weights, outside the server."""
    return xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu", overrides=FP32)


def test_completion_logprobs_streamed_and_not(live: LiveServer, reference: xspec.LLM) -> None:
    client = live.openai()
    kw: dict[str, Any] = dict(model=live.name, prompt=PROMPT, max_tokens=N, temperature=0)
    whole = client.completions.create(logprobs=3, **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    want = reference.generate(PROMPT, N, logprobs=3)[0]
    assert want.logprobs is not None and len(lp.token_logprobs) == len(want.token_ids)
    for got, exp, top in zip(lp.token_logprobs, want.logprobs, lp.top_logprobs):
        assert abs(got - exp.logprob) <= TOL
        assert 3 <= len(top) <= 4 and max(top.values()) == pytest.approx(exp.top[0][1], abs=TOL)
    assert "".join(lp.tokens) == whole.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(logprobs=3, stream=True, **kw):
        c = chunk.choices[0]
        if c.logprobs is not None:
            for key in streamed:
                streamed[key] += getattr(c.logprobs, key)
    assert streamed == {k: getattr(lp, k) for k in streamed}


def test_chat_logprobs_streamed_and_not(live: LiveServer) -> None:
    client = live.openai()
    kw: dict[str, Any] = dict(
        model=live.name,
        messages=[{"role": "user", "content": "Count to five."}],
        max_tokens=N,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and "".join(e.token for e in content) == whole.choices[0].message.content
    for e in content:
        assert bytes(e.bytes or []) == e.token.encode() and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.logprob - TOL
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def lm_eval_loglikelihood(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``LocalCompletionsAPI.parse_logprobs``, as it reads a body."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        greedy = all(t == max(d.values()) for t, d in zip(token_logprobs, top))
        res.append((sum(token_logprobs), greedy))
    return res


def test_lm_eval_loglikelihood_request_equals_score(live: LiveServer, reference: xspec.LLM) -> None:
    """Its request as it sends it (``LocalCompletionsAPI._create_payload``, tokenized, a
    batch of one): echo + logprobs 1 + max_tokens 1; the continuation's logprobs sum to
    what ``LLM.score`` gives, bit for bit (one prefill alone, as score's forward)."""
    context = reference.tokenizer.encode("The capital of France is")
    continuation = reference.tokenizer.encode(" Paris.")
    ids = context + continuation
    payload = {
        "model": live.name,
        "prompt": [ids],
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": 1234,
        "echo": True,
    }
    r = httpx.post(live.url + "/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    ((total, greedy),) = lm_eval_loglikelihood(body, [len(context)])
    lp = torch.log_softmax(reference.score(ids), dim=-1)
    want = [lp[i - 1, ids[i]].item() for i in range(len(context), len(ids))]
    assert total == sum(want)
    argmax = all(lp[i - 1].argmax().item() == ids[i] for i in range(len(context), len(ids)))
    assert greedy == argmax
    lps = body["choices"][0]["logprobs"]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    assert len(lps["tokens"]) == len(ids) + 1  # the prompt, then the generated token
    # score only: max_tokens 0 returns the prompt and its logprobs, nothing generated
    r = httpx.post(live.url + "/v1/completions", json={**payload, "max_tokens": 0}, timeout=120)
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["token_logprobs"][1:] == [
        lp[i - 1, ids[i]].item() for i in range(1, len(ids))
    ]
    assert choice["text"] == reference.tokenizer.decode(ids)
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_returns_the_prompt(live: LiveServer) -> None:
    client = live.openai()
    out = client.completions.create(model=live.name, prompt=PROMPT, max_tokens=4, echo=True)
    assert out.choices[0].text.startswith(PROMPT) and len(out.choices[0].text) > len(PROMPT)
    chunks = client.completions.create(
        model=live.name, prompt=PROMPT, max_tokens=4, echo=True, stream=True, temperature=0
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices).startswith(PROMPT)


def test_n_choices(live: LiveServer) -> None:
    client = live.openai()
    kw: dict[str, Any] = dict(model=live.name, prompt=PROMPT, max_tokens=12, n=4)
    sampled = client.completions.create(
        temperature=0.8, seed=3, extra_body={"ignore_eos": True}, **kw
    )
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    assert len({c.text for c in sampled.choices}) == 4
    assert sampled.usage is not None
    assert sampled.usage.completion_tokens == 4 * 12 and sampled.usage.prompt_tokens > 0
    greedy = client.completions.create(temperature=0, **kw)
    assert len({c.text for c in greedy.choices}) == 1
    again = client.completions.create(
        temperature=0.8, seed=3, extra_body={"ignore_eos": True}, **kw
    )
    assert [c.text for c in again.choices] == [c.text for c in sampled.choices]  # seed + i
    texts = ["", "", "", ""]
    for chunk in client.chat.completions.create(
        model=live.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        n=4,
        temperature=0.8,
        seed=3,
        stream=True,
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert len(set(texts)) == 4


def test_penalties_reach_the_engine(live: LiveServer, reference: xspec.LLM) -> None:
    client = live.openai()
    kw: dict[str, Any] = dict(
        frequency_penalty=0.8, presence_penalty=0.4, logit_bias={"32": 3.0}, min_tokens=5
    )
    out = client.completions.create(
        model=live.name,
        prompt=PROMPT,
        max_tokens=N,
        temperature=0,
        frequency_penalty=0.8,
        presence_penalty=0.4,
        logit_bias={"32": 3},
        extra_body={"min_tokens": 5, "repetition_penalty": 1.2},
    )
    want = reference.generate(PROMPT, N, repetition_penalty=1.2, **{**kw, "logit_bias": {32: 3.0}})
    plain = reference.generate(PROMPT, N)
    assert out.choices[0].text == want[0].text != plain[0].text


def test_processed_logprobs_of_a_sampled_request(live: LiveServer) -> None:
    out = live.openai().completions.create(
        model=live.name,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.7,
        logprobs=2,
        extra_body={"top_k": 2, "logprobs_mode": "processed"},
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.top_logprobs
    for top in lp.top_logprobs:
        assert abs(sum(math.exp(v) for v in top.values()) - 1) < 1e-4  # top_k 2: all the mass
