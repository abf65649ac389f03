"""The engine: stop ids (one or several), also inside a multi-token speculative step;
request latencies count from admission, the wait before it is the queue time."""

from __future__ import annotations

import dataclasses

import pytest

import xspec
from xspec.build import stop_ids_of
from xspec.engine.engine import Engine, Generation, Request
from xspec.errors import ConfigError
from xspec.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100))]


def test_stop_ids_of_accepts_ints_lists_and_none() -> None:
    assert stop_ids_of(None) == frozenset()
    assert stop_ids_of(7) == frozenset({7})
    assert stop_ids_of([151645, 151643], 151643, None) == frozenset({151645, 151643})
    assert stop_ids_of(frozenset({1}), (2,)) == frozenset({1, 2})
    with pytest.raises(ConfigError, match="stop / eos token id"):
        stop_ids_of("eos")


@pytest.mark.parametrize("spec", ["none", "oracle"])
def test_any_stop_id_ends_a_request(spec: str) -> None:
    """Two stop ids taken from the free-running outputs: each request ends at the first
    of either (the stop token included), also when it sits mid-block in an oracle step
    that accepted past it. ignore_eos keeps going."""
    llm = xspec.LLM(model="qwen3_tiny", spec=spec, platform="cpu")  # oracle: gamma 3
    built = llm._built
    free = [g.token_ids for g in llm.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)]
    stops = frozenset({free[0][5], free[1][2]})
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=stops)
    gens = engine.run([Request(p, 12, SamplingParams()) for p in PROMPTS], concurrency=2)
    for g, tokens in zip(gens, free):
        end = next(i for i, t in enumerate(tokens) if t in stops) + 1
        assert g.token_ids == tokens[:end]
    kept = engine.run([Request(PROMPTS[0], 12, SamplingParams(), ignore_eos=True)], 1)
    assert kept[0].token_ids == free[0]


def check_serial_timing(gens: list[Generation]) -> None:
    """Requests served one after the other: each is admitted once the previous one has
    finished, so its queue holds the e2e of every request before it and its TTFT none."""
    for k, g in enumerate(gens):
        assert g.error is None and len(g.token_ids) == 6
        assert g.admitted_at <= g.first_token_at <= g.finished_at
        # the figures split the same timestamps: queue + TTFT is the TTFT from the run start
        assert g.queue_s + g.ttft_s == pytest.approx(g.first_token_at, rel=0, abs=1e-12)
        assert g.queue_s + g.latency_s == pytest.approx(g.finished_at, rel=0, abs=1e-12)
        assert g.tpot_s == pytest.approx((g.latency_s - g.ttft_s) / 5, rel=0, abs=1e-12)
        if k == 0:
            continue
        assert g.admitted_at >= gens[k - 1].finished_at  # the previous one left its slot
        assert g.queue_s >= sum(p.latency_s for p in gens[:k]) - 1e-9
        assert g.ttft_s <= g.first_token_at - gens[k - 1].finished_at  # no earlier request


def test_latencies_count_from_admission_at_concurrency_1() -> None:
    """Issue item 16: at concurrency 1 the k-th request waits for the k before it; that
    wait is its queue time, not part of its TTFT, TPOT or e2e."""
    built = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")._built
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=frozenset())
    reqs = [Request(PROMPTS[k % 2], 6, SamplingParams()) for k in range(5)]
    gens = engine.run(reqs, concurrency=1)
    check_serial_timing(gens)
    assert gens[-1].finished_at <= engine.run_s


def test_latencies_count_from_admission_by_the_memory_pool() -> None:
    """With a memory plan for one sequence, the pool admits one request at a time even
    at concurrency 4: the wait for memory is queue time too."""
    built = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")._built
    plan = built.engine.plan
    assert plan is not None
    prompt = PROMPTS[1]
    one = dataclasses.replace(plan, budget=plan.weights + int(1.5 * plan.seq_bytes(len(prompt), 6)))
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=frozenset(), plan=one)
    gens = engine.run([Request(prompt, 6, SamplingParams()) for _ in range(3)], concurrency=4)
    check_serial_timing(gens)


def test_concurrent_requests_are_admitted_at_once() -> None:
    """Two slots, three requests: the first two are admitted together (the same queue
    time, before either prefill), the third when one of them finishes."""
    built = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")._built
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=frozenset())
    a, b, c = engine.run([Request(PROMPTS[k % 2], 6, SamplingParams()) for k in range(3)], 2)
    assert a.admitted_at == b.admitted_at < min(a.first_token_at, b.first_token_at)
    assert c.queue_s >= min(a.finished_at, b.finished_at)
    assert c.ttft_s <= c.first_token_at - min(a.finished_at, b.finished_at)
