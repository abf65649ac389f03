"""n choices of one prompt (an ``Engine.add`` group): the prompt is prefilled once and
its states copied, and each choice equals its own request with seed + i, bit for bit
(tokens, logprobs, speculative counters), for every drafter kind, with the prefix cache
on and off; admission is all of a group or none; an abort ends one choice."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import xspec
from xspec.engine.engine import Engine, Generation, Request
from xspec.engine.prefix_cache import PrefixCache
from xspec.sampling import SamplingParams

BLOCK = 128  # DeepSeek-V4's prefix granularity
FP32 = {"model.dtype": "float32"}
PAIRS = [
    ("dsv4_tiny", "none"),
    ("dsv4_tiny", "mtp"),
    ("dsv4_tiny", "dspark"),
    ("qwen3_tiny", "dspark"),
]
REGIMES = [
    SamplingParams(logprobs=2),
    SamplingParams(temperature=0.9, top_p=0.95, seed=11, logprobs=2),
]
N = 3

_LLMS: dict[tuple[str, str], xspec.LLM] = {}


def llm_of(model: str, spec: str) -> xspec.LLM:
    if (model, spec) not in _LLMS:
        _LLMS[(model, spec)] = xspec.LLM(model=model, spec=spec, platform="cpu", overrides=FP32)
    return _LLMS[(model, spec)]


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


def engine(llm: xspec.LLM, cache: bool) -> Engine:
    b = llm.built
    return Engine(
        b.target,
        b.drafter,
        b.capture,
        stop_ids=frozenset(),
        plan=b.engine.plan,
        prefix_cache=PrefixCache(BLOCK, math.inf) if cache else None,
    )


def choice(params: SamplingParams, i: int) -> SamplingParams:
    return params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)


def run_group(e: Engine, prompt: list[int], params: SamplingParams, n: int) -> list[Generation]:
    e.reset_clock()
    e.concurrency = n
    gens = [
        e.add(i, Request(prompt, 8, choice(params, i), ignore_eos=True), group="g")
        for i in range(n)
    ]
    for _ in e.drain():
        pass
    return gens


def run_alone(e: Engine, prompt: list[int], params: SamplingParams) -> Generation:
    (gen,) = e.run([Request(prompt, 8, params, ignore_eos=True)], concurrency=1)
    return gen


def same(a: Generation, b: Generation) -> bool:
    return (a.token_ids, a.logprobs, a.spec, a.error) == (b.token_ids, b.logprobs, b.spec, None)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "spec"), PAIRS)
@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_each_choice_is_its_own_request(model: str, spec: str, cache: bool) -> None:
    """A prompt across a cache block boundary and one shorter than a block: each of n
    choices equals, bit for bit (tokens, logprobs, drafts accepted), request i with seed
    + i among n separate requests that each prefill the prompt alone and then decode
    together (the same decode batches: only the prefill is shared); the target ran the
    prompt once instead of n times. Greedy, each also equals its request run alone (at
    T > 0 a decode batch of n may round otherwise than a batch of one, grouped or not:
    see the batch-invariant test below)."""
    llm = llm_of(model, spec)
    for prompt in (ids(BLOCK + 45, 1), ids(37, 2)):
        for params in REGIMES:
            grouped = engine(llm, cache)
            gens = run_group(grouped, prompt, params, N)
            assert grouped.prompt_tokens_computed == len(prompt)
            apart = engine(llm, cache)
            apart.max_prefill_tokens = 1  # one prefill per iteration, then they decode together
            reqs = [Request(prompt, 8, choice(params, i), ignore_eos=True) for i in range(N)]
            for i, (gen, own) in enumerate(zip(gens, apart.run(reqs, N))):
                assert same(gen, own), (len(prompt), params.seed, i)
            # apart, the prefix cache serves the others the whole blocks the first cached
            hit = (len(prompt) - 1) // BLOCK * BLOCK if cache else 0
            assert apart.prompt_tokens_computed == len(prompt) + (N - 1) * (len(prompt) - hit)
            if params.temperature == 0:
                alone = run_alone(engine(llm, cache), prompt, params)
                assert all(g.token_ids == alone.token_ids for g in gens)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "mtp", "dspark"])
@pytest.mark.parametrize("cache", [False, True], ids=["cache-off", "cache-on"])
def test_each_choice_is_its_request_alone_when_batch_invariant(spec: str, cache: bool) -> None:
    """With ``platform.batch_invariant=true`` (the target's rows do not depend on their
    batch) each choice equals its request run alone, bit for bit: greedy for every
    drafter, and seeded at T > 0 for ``spec=none`` (a drafter's own forwards still
    depend on their batch: its q, hence which drafts a sampled request accepts)."""
    llm = xspec.LLM(
        model="dsv4_tiny", spec=spec, platform="cpu",
        overrides={**FP32, "platform.batch_invariant": True},
    )  # fmt: skip
    prompt = ids(BLOCK + 45, 1)
    for params in REGIMES if spec == "none" else REGIMES[:1]:
        gens = run_group(engine(llm, cache), prompt, params, N)
        for i, gen in enumerate(gens):
            alone = run_alone(engine(llm, cache), prompt, choice(params, i))
            assert same(gen, alone), (params.seed, i)


def test_the_prompt_is_prefilled_once_and_choices_differ() -> None:
    """n = 4 at T > 0: one prefill of the prompt (the engine's counter and its prefill
    iterations), 4 distinct samples, each its own seeded request's; ungrouped, 4 prefills."""
    llm = llm_of("qwen3_tiny", "none")
    prompt = ids(40, 3)
    params = SamplingParams(temperature=1.0, seed=5)
    e = engine(llm, cache=False)
    gens = run_group(e, prompt, params, 4)
    assert e.prompt_tokens_computed == len(prompt) and e.prefills == 1
    assert len({tuple(g.token_ids) for g in gens}) == 4
    for i, g in enumerate(gens):
        assert g.token_ids == run_alone(engine(llm, False), prompt, choice(params, i)).token_ids
    apart = engine(llm, cache=False)
    apart.run([Request(prompt, 8, choice(params, i), ignore_eos=True) for i in range(4)], 4)
    assert apart.prompt_tokens_computed == 4 * len(prompt)


def test_a_hit_is_shared_and_counted_once() -> None:
    """With the prefix cache, the group's first choice looks the prompt up (one lookup
    in the counters) and the others copy its restored-and-prefilled states."""
    llm = llm_of("qwen3_tiny", "none")
    prompt = ids(BLOCK + 30, 4)
    e = engine(llm, cache=True)
    run_alone(e, prompt, SamplingParams())
    e.prefix_cache.reset_stats()  # type: ignore[union-attr]
    gens = run_group(e, prompt, SamplingParams(), 3)
    stats = e.prefix_cache.stats  # type: ignore[union-attr]
    assert (stats.queries, stats.hits) == (len(prompt), BLOCK)
    assert e.prompt_tokens_computed == len(prompt) - BLOCK
    assert [g.cached_tokens for g in gens] == [BLOCK, 0, 0]
    cold = run_alone(engine(llm, True), prompt, SamplingParams())
    assert all(g.token_ids == cold.token_ids for g in gens)


def test_a_group_is_admitted_whole_or_waits() -> None:
    """A group of 3 behind a running request, with 3 slots: it waits until all three
    fit (no half-admitted group), then runs with one prefill."""
    llm = llm_of("qwen3_tiny", "none")
    e = engine(llm, cache=False)
    e.reset_clock()
    e.concurrency = 3
    first = e.add("solo", Request(ids(10, 5), 4, SamplingParams(), ignore_eos=True))
    e.step()  # the solo request is running: 2 slots left
    gens = [
        e.add(i, Request(ids(12, 6), 4, SamplingParams(), ignore_eos=True), group=7)
        for i in range(3)
    ]
    while not first.finished:
        e.step()
        assert e.num_running in (0, 1), "a half-admitted group"
    for _ in e.drain():
        pass
    assert all(len(g.token_ids) == 4 for g in gens)
    assert e.prompt_tokens_computed == 10 + 12


def test_a_group_larger_than_the_concurrency_runs_in_pieces() -> None:
    llm = llm_of("qwen3_tiny", "none")
    e = engine(llm, cache=False)
    gens = run_group(e, ids(12, 7), SamplingParams(), 5)
    e2 = engine(llm, cache=False)
    e2.reset_clock()
    e2.concurrency = 2
    gens2 = [
        e2.add(i, Request(ids(12, 7), 6, SamplingParams(), ignore_eos=True), group="g")
        for i in range(5)
    ]
    for _ in e2.drain():
        pass
    assert all(g.error is None and len(g.token_ids) == 6 for g in gens2)
    assert e2.prompt_tokens_computed == 3 * 12  # pieces of 2, 2 and 1
    assert gens[0].token_ids[:6] == gens2[0].token_ids


def test_an_abort_ends_one_choice_and_group_checks() -> None:
    llm = llm_of("qwen3_tiny", "none")
    e = engine(llm, cache=False)
    e.reset_clock()
    e.concurrency = 3
    prompt = ids(12, 8)
    gens = [
        e.add(i, Request(prompt, 6, SamplingParams(), ignore_eos=True), group="g") for i in range(3)
    ]
    with pytest.raises(xspec.errors.RequestError, match="another prompt"):
        e.add(9, Request(ids(5, 9), 6, SamplingParams()), group="g")
    e.abort(1)  # waiting: the other two are still one group
    for _ in e.drain():
        pass
    assert gens[1].finish_reason == "abort" and gens[1].token_ids == []
    assert gens[0].token_ids == gens[2].token_ids and len(gens[0].token_ids) == 6
    assert e.prompt_tokens_computed == len(prompt)
