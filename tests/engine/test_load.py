"""Bounded in-process load: many requests, more concurrency than the memory plan holds.

Every request completes; the pool's peak reservation and the peak of the bytes the
states really allocate stay within the plan; greedy outputs equal concurrency-1 runs.
"""

from __future__ import annotations

import dataclasses
import random

import xspec
from xspec.engine.engine import Engine, Request
from xspec.sampling import SamplingParams

MAX_PROMPT, MAX_NEW = 12, 8


def load(num_requests: int, concurrency: int, fits: int) -> None:
    b = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")._built
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 500) for _ in range(rng.randrange(4, MAX_PROMPT + 1))] for _ in range(8)
    ]
    picks = [
        (rng.randrange(len(prompts)), rng.randrange(2, MAX_NEW + 1)) for _ in range(num_requests)
    ]
    # concurrency-1 references, one per distinct prompt (greedy: a shorter limit is a prefix)
    ref = [b.engine.run([Request(p, MAX_NEW, SamplingParams())], 1)[0].token_ids for p in prompts]
    plan = b.engine.plan
    per_seq = plan.seq_bytes(MAX_PROMPT, MAX_NEW)
    plan = dataclasses.replace(plan, budget=plan.weights + fits * per_seq + per_seq // 2)
    engine = Engine(
        b.target, b.drafter, b.capture, stop_ids=b.engine.stop_ids, plan=plan, measure_memory=True
    )
    gens = engine.run([Request(prompts[i], m, SamplingParams()) for i, m in picks], concurrency)
    assert all(g.error is None for g in gens)
    assert [g.token_ids for g in gens] == [ref[i][:m] for i, m in picks]
    assert plan.available - per_seq < engine.pool.peak <= plan.available  # the pool was the limit
    assert engine.peak_allocated <= engine.pool.peak
    assert engine.pool.reserved == 0


def test_load_small() -> None:
    load(num_requests=60, concurrency=16, fits=4)


def test_load_500_requests_concurrency_64() -> None:  # ~8 s on 2 cores: always run
    load(num_requests=500, concurrency=64, fits=16)
