"""A step that raises fails its own requests only; an engine that cannot run a fresh
generation any more stops its loop. The fault is planted for real: an entry of a hash
layer's routing table (``ffn.gate.tid2eid``, a loaded checkpoint's buffer) set past the
expert count, so every forward that holds that token raises inside the MoE, as a
checkpoint with such a table did before tables were range-checked at load."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

import xspec
from xspec.engine.engine import CANARY_PROMPT, Delta, Engine, EngineUnusable, Request
from xspec.engine.loop import EngineLoop
from xspec.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], [60, 61, 62, 63], [200, 3, 11, 12]]
N = 12


@pytest.fixture(scope="module")
def llm() -> xspec.LLM:
    return xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")


@pytest.fixture(scope="module")
def reference(llm: xspec.LLM) -> list[list[int]]:
    return [g.token_ids for g in llm.generate(PROMPTS, max_new_tokens=N, ignore_eos=True)]


def greedy(prompt: list[int]) -> Request:
    return Request(prompt, N, SamplingParams(), ignore_eos=True)


@pytest.fixture
def poison(llm: xspec.LLM) -> Iterator[object]:
    """``poison(token)``: layer 0 routes ``token`` to expert 1000 (of 8) until the test
    ends."""
    table = llm._built.target.layers[0].ffn.gate.tid2eid
    saved = table.clone()

    def plant(token: int) -> None:
        table[token, 0] = 1000

    yield plant
    table.copy_(saved)


def test_a_failed_decode_step_fails_its_requests_only(
    llm: xspec.LLM, reference: list[list[int]], poison
) -> None:
    """Requests 0 and 1 decode together; request 0 commits the poisoned token, so the
    next decode step raises: both end with an error and the tokens they had, request 2
    (waiting: concurrency 2) runs afterwards to its exact output, and the pool is empty."""
    ref = reference
    clean = set(PROMPTS[0] + PROMPTS[1] + PROMPTS[2] + ref[2]) | set(CANARY_PROMPT)
    k = next(j for j in range(2, N - 1) if ref[0][j] not in clean | set(ref[0][:j] + ref[1]))
    poison(ref[0][k])  # request 0's token k: the anchor of the step after it is committed
    engine: Engine = llm._built.engine
    gens = engine.run([greedy(p) for p in PROMPTS], concurrency=2)
    for g in gens[:2]:
        assert g.finish_reason == "error" and g.error is not None
        assert "raised RuntimeError" in g.error and "out of bounds" in g.error
    assert gens[0].token_ids == ref[0][: k + 1]
    assert gens[1].token_ids == ref[1][: k + 1]  # they stepped together
    assert gens[2].error is None and gens[2].token_ids == ref[2]
    assert not engine.busy and engine.pool.reserved == 0


def test_a_failed_prefill_leaves_the_running_requests_untouched(
    llm: xspec.LLM, reference: list[list[int]], poison
) -> None:
    """A request whose prompt holds the poisoned token arrives while another decodes:
    its prefill fails alone, the running one goes on to its exact output."""
    bad = next(t for t in range(10, 500) if t not in set(PROMPTS[0] + reference[0]))
    poison(bad)
    engine: Engine = llm._built.engine
    engine.reset_clock()
    engine.concurrency = 2
    engine.add("good", greedy(PROMPTS[0]))
    ended: dict[object, Delta] = {}
    tokens: list[int] = []
    steps = 0
    while engine.busy:
        if steps == 2:  # "good" was prefilled and decoded once
            engine.add("bad", greedy([5, bad, 42]))
        for d in engine.step():
            tokens += d.token_ids if d.rid == "good" else []
            if d.finished:
                ended[d.rid] = d
        steps += 1
    assert ended["bad"].generation.finish_reason == "error"
    assert ended["bad"].generation.token_ids == []
    assert ended["good"].generation.error is None and tokens == reference[0]
    assert engine.pool.reserved == 0


def test_an_unusable_engine_stops_its_loop(llm: xspec.LLM, poison) -> None:
    """When the canary generation fails as well (its own prompt holds the poisoned
    token), the step raises EngineUnusable: the loop stops with ``failure`` set (the
    server's /health answers 503 from it) and every open request ends with an error;
    the engine is left idle, so a repaired one serves again."""
    poison(CANARY_PROMPT[0])
    engine: Engine = llm._built.engine
    with pytest.raises(EngineUnusable, match="fresh 4-token generation raised"):
        engine.run([greedy([9, CANARY_PROMPT[0], 7])], concurrency=1)
    assert not engine.busy and engine.pool.reserved == 0
    loop = EngineLoop(engine, concurrency=2, max_queue=2)
    ended: list[Delta] = []
    done = threading.Event()

    def collect(d: Delta) -> None:
        if d.finished:
            ended.append(d)
            if len(ended) == 2:
                done.set()

    loop.start()
    try:
        loop.submit(greedy(PROMPTS[1]), collect)
        loop.submit(greedy([9, CANARY_PROMPT[0], 7]), collect)
        assert done.wait(60)
        loop.join(30)
        assert not loop.running and loop.failure is not None
        assert "EngineUnusable" in loop.failure
        assert all(d.generation.finish_reason == "error" for d in ended)
    finally:
        loop.close()
    assert not engine.busy and engine.pool.reserved == 0
