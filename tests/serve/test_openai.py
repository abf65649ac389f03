"""Completions and chat, streamed and not, through the real ``openai`` client against a
live server: greedy outputs equal ``LLM.generate`` token for token (text and count), for
``spec=none``, ``mtp`` and ``dspark`` on the embedded default."""

from __future__ import annotations

import threading

import pytest

from tests.serve.conftest import LiveServer
from xspec.engine.engine import Delta, Generation, Request
from xspec.sampling import SamplingParams

FP32 = {"model.dtype": "float32"}
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self"]
N = 24
SERVERS = [("dsv4_tiny", spec, FP32) for spec in ("none", "mtp", "dspark")]


def expected(live: LiveServer, prompt: str | list[int]) -> tuple[str, int]:
    """LLM.generate's greedy text and token count (the loop thread runs, so through it)."""
    llm = live.llm
    ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    gen = _through_loop(live, ids)
    return llm.tokenizer.decode(gen.token_ids), len(gen.token_ids)


def _through_loop(live: LiveServer, ids: list[int]) -> Generation:
    done, box = threading.Event(), []

    def take(d: Delta) -> None:
        if d.finished:
            box.append(d.generation)
            done.set()

    live.ctx.loop.submit(Request(ids, N, SamplingParams()), take)
    assert done.wait(120)
    return box[0]


@pytest.fixture(scope="module")
def reference(served: LiveServer) -> dict[str, tuple[str, int]]:
    """Greedy outputs of LLM.generate on a fresh copy of the same model (not the served
    engine: a second engine of the same weights, built the same way)."""
    import xspec

    llm = xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu", overrides=FP32)
    out = {}
    for p in PROMPTS:
        g = llm.generate(p, max_new_tokens=N)[0]
        out[p] = (g.text, len(g.token_ids))
    return out


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_completions_equal_generate(served: LiveServer, reference: dict) -> None:
    client = served.openai()
    for p in PROMPTS:
        want_text, want_n = reference[p]
        r = client.completions.create(model=served.name, prompt=p, max_tokens=N, temperature=0)
        assert r.choices[0].text == want_text
        assert r.usage.completion_tokens == want_n and r.choices[0].finish_reason == "length"
        assert r.usage.prompt_tokens == len(served.llm.tokenizer.encode(p))
        pieces, usage = [], None
        stream = client.completions.create(
            model=served.name,
            prompt=p,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        reasons = []
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                pieces.append(c.text)
                reasons.append(c.finish_reason)
        assert "".join(pieces) == want_text
        assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
        assert usage is not None and usage.completion_tokens == want_n


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_token_id_prompts_and_spec_usage(served: LiveServer) -> None:
    ids = served.llm.tokenizer.encode(PROMPTS[0])
    want_text, want_n = expected(served, ids)
    r = served.openai().completions.create(
        model=served.name, prompt=ids, max_tokens=N, temperature=0
    )
    assert r.choices[0].text == want_text and r.usage.completion_tokens == want_n
    spec = r.usage.model_extra["spec_decode"]
    if served.ctx.spec == "none":
        assert spec["num_draft_tokens"] == 0 and spec["acceptance_length"] == 1.0
    else:  # vLLM's definition: accepted drafts + 1 bonus per drafting step
        assert spec["num_draft_tokens"] > 0
        drafts = spec["num_drafts"]
        assert spec["acceptance_length"] == pytest.approx(
            (spec["num_accepted_tokens"] + drafts) / drafts
        )
        # each decode step commits its accepted drafts + 1; the prefill commits the first
        # token, and a step that drafted nothing is no draft (tests/serve/test_spec_usage.py)
        assert spec["num_accepted_tokens"] + drafts <= want_n - 1


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_chat_equals_generate_on_the_rendered_prompt(served: LiveServer) -> None:
    messages = [{"role": "user", "content": "def add(a, b):"}]
    want_text, want_n = expected(served, served.ctx.chat_ids(messages, {}))
    client = served.openai()
    r = client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=N, temperature=0
    )
    assert r.choices[0].message.content == want_text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == want_n
    pieces = []
    for chunk in client.chat.completions.create(
        model=served.name, messages=messages, max_tokens=N, temperature=0, stream=True
    ):
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
    assert "".join(pieces) == want_text


@pytest.mark.parametrize("served", SERVERS[:1], indirect=True, ids=lambda s: s[1])
def test_stop_strings_are_never_streamed(served: LiveServer) -> None:
    """The text before the stop string, streamed or not, and nothing of the stop."""
    text, _ = expected(served, served.llm.tokenizer.encode(PROMPTS[1]))
    stop = text[5:8]
    assert stop and stop in text
    client = served.openai()
    r = client.completions.create(
        model=served.name, prompt=PROMPTS[1], max_tokens=N, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == text[: text.index(stop)] and r.choices[0].finish_reason == "stop"
    pieces = [
        c.text
        for chunk in client.completions.create(
            model=served.name,
            prompt=PROMPTS[1],
            max_tokens=N,
            temperature=0,
            stop=stop,
            stream=True,
        )
        for c in chunk.choices
    ]
    assert "".join(pieces) == r.choices[0].text


@pytest.mark.parametrize("served", SERVERS[:1], indirect=True, ids=lambda s: s[1])
def test_models_health_and_metrics(served: LiveServer) -> None:
    import httpx

    models = served.openai().models.list()
    assert [m.id for m in models.data] == [served.name]
    assert httpx.get(served.url + "/health").status_code == 200
    served.openai().completions.create(model=served.name, prompt="x = 1", max_tokens=3)
    text = httpx.get(served.url + "/metrics").text
    assert 'xspec_request_e2e_seconds_count{model="dsv4_tiny",spec="none"}' in text


@pytest.mark.parametrize("served", SERVERS[:1], indirect=True, ids=lambda s: s[1])
def test_usage_reports_the_prompt_tokens_served_from_the_prefix_cache(served: LiveServer) -> None:
    """``usage.prompt_tokens_details.cached_tokens``: 0 cold, the cached blocks (256 tokens
    each by default) when the same prompt comes again, with the same completion."""
    client = served.openai()
    prompt = [(7 * k) % 200 + 5 for k in range(300)]
    first = client.completions.create(model=served.name, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=served.name, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None and again.usage is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    assert again.usage.prompt_tokens_details.cached_tokens == 256  # type: ignore[union-attr]
    assert again.choices[0].text == first.choices[0].text
