"""``n`` choices through the server: one engine group per prompt (the prompt prefilled
once), OpenAI's usage (the prompt counted once, the completions summed), each choice
``LLM.generate(n=...)``'s, and a client that leaves ends every choice."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve.conftest import LiveServer, start_server

FP32 = {"model.dtype": "float32"}
PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server("qwen3_tiny", "none", FP32)
    yield server
    server.stop()


def test_n_choices_prefill_the_prompt_once(live: LiveServer) -> None:
    engine = live.llm.engine
    before = engine.prompt_tokens_computed
    out = live.openai().completions.create(
        model=live.name, prompt=[PROMPT, "hello"], max_tokens=6, n=4, temperature=0.8, seed=3,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    prompts = [live.llm.tokenizer.encode(p) for p in (PROMPT, "hello")]
    assert engine.prompt_tokens_computed - before == sum(len(p) for p in prompts)
    assert [c.index for c in out.choices] == list(range(8))
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)  # once per prompt
    assert out.usage.completion_tokens == 8 * 6
    want = live.llm.generate(prompts[0], 6, temperature=0.8, seed=3, ignore_eos=True, n=4)
    assert [c.text for c in out.choices[:4]] == [g.text for g in want]  # choice j: seed + j


def test_streamed_usage_counts_the_prompt_once(live: LiveServer) -> None:
    chunks = list(
        live.openai().completions.create(
            model=live.name,
            prompt=PROMPT,
            max_tokens=5,
            n=3,
            temperature=0.8,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    usage = chunks[-1].usage
    assert usage is not None
    assert usage.prompt_tokens == len(live.llm.tokenizer.encode(PROMPT))
    assert usage.completion_tokens == 3 * 5


def test_a_client_that_leaves_ends_every_choice(live: LiveServer) -> None:
    body = {
        "model": live.name, "prompt": PROMPT, "max_tokens": 400, "n": 4, "stream": True,
        "temperature": 0.8, "ignore_eos": True,
    }  # fmt: skip
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then the client leaves
    deadline = time.monotonic() + 30
    while live.ctx.loop.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert live.ctx.loop.in_flight == 0 and live.llm.engine.num_running == 0
