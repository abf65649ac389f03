"""The prefix cache: a hit is the cold run bit for bit (logits, drafts step by step,
greedy and seeded outputs) for every model x drafter pair, on partial hits mid-block,
exactly at a boundary, covering all of a prompt but its last token, after evictions and
among other prefills; the cache's own bookkeeping (keys, lineage, LRU,
pins); a planted stale drafter state is caught; the configuration's refusals."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import xspec
from tests.test_cli import run_cli
from xspec.build import prefix_cache_of
from xspec.engine.engine import Engine, Generation, Request
from xspec.engine.prefix_cache import PrefixCache
from xspec.errors import ConfigError
from xspec.models.base import ForwardBatch
from xspec.sampling import SamplingParams
from xspec.spec.block_prefill import HeldRow

BLOCK = 128  # DeepSeek-V4's granularity (its compression ratios 4 and 128)
PAIRS = [
    ("dsv4_tiny", "none"),
    ("dsv4_tiny", "mtp"),
    ("dsv4_tiny", "dspark"),
    ("qwen3_tiny", "none"),
    ("qwen3_tiny", "dspark"),
    ("qwen3_tiny", "dflash"),
]


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, 250, (n,), generator=g).tolist()


_LLMS: dict[tuple[str, str], xspec.LLM] = {}


def llm_of(model: str, spec: str) -> xspec.LLM:
    if (model, spec) not in _LLMS:
        _LLMS[(model, spec)] = xspec.LLM(model=model, spec=spec, platform="cpu")
    return _LLMS[(model, spec)]


class Recorder:
    """The drafter's proposals, step by step, of the engine it is installed in."""

    def __init__(self, drafter: Any) -> None:
        self.drafter, self.calls = drafter, []  # type: ignore[var-annotated]

    def __enter__(self) -> Recorder:
        inner = type(self.drafter).propose

        def propose(states: Any, requests: Any, num_tokens: int) -> Any:
            out = inner(self.drafter, states, requests, num_tokens)
            self.calls.append(out.tokens.tolist())
            return out

        self.drafter.propose = propose
        return self

    def __exit__(self, *exc: object) -> None:
        del self.drafter.propose


def engine(llm: xspec.LLM, capacity: float = math.inf) -> Engine:
    b = llm._built
    return Engine(
        b.target,
        b.drafter,
        b.capture,
        stop_ids=frozenset(),
        prefix_cache=PrefixCache(BLOCK, capacity),
    )


def run(e: Engine, prompt: list[int], params: SamplingParams) -> tuple[Generation, list]:
    with Recorder(e.drafter) as rec:
        (gen,) = e.run([Request(prompt, 10, params, ignore_eos=True)], concurrency=1)
    assert gen.error is None
    return gen, rec.calls


REGIMES = [SamplingParams(), SamplingParams(temperature=0.9, top_p=0.95, seed=7)]


def cases() -> Iterator[tuple[str, list[int], list[int], int]]:
    """(name, the prompt that fills the cache, the prompt looked up, tokens it hits)."""
    base = ids(3 * BLOCK + 40, 1)
    yield "mid-block", base[: 2 * BLOCK + 50], base[: 2 * BLOCK + 30] + ids(25, 2), 2 * BLOCK
    yield "at a boundary", base[: 2 * BLOCK] + ids(9, 3), base[: 2 * BLOCK] + ids(12, 4), 2 * BLOCK
    yield "all but the last token", base[: 2 * BLOCK + 1], base[: 2 * BLOCK + 1], 2 * BLOCK


@pytest.mark.slow
@pytest.mark.parametrize(("model", "spec"), PAIRS)
def test_a_hit_is_the_cold_run(model: str, spec: str) -> None:
    """For each case and sampling regime: the lookup restores the expected prefix, and
    its tokens and every step's drafts equal a cold engine's (at the boundary case the
    two prompts differ from the boundary's token on: MTP's held-back row)."""
    llm = llm_of(model, spec)
    for name, fill, lookup, hit in cases():
        for params in REGIMES:
            warm = engine(llm)
            run(warm, fill, params)
            got, got_drafts = run(warm, lookup, params)
            cold, cold_drafts = run(engine(llm), lookup, params)
            assert got.cached_tokens == hit, name
            assert cold.cached_tokens == 0
            assert got.token_ids == cold.token_ids, name
            assert got_drafts == cold_drafts, name
            assert got.spec == cold.spec


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", "w8a8"])
def test_a_hit_is_the_cold_run_on_a_quantized_checkpoint(
    fmt: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same on FP8 / W8A8 copies of the tiny DeepSeek-V4 (weights stay quantized in
    memory), with its MTP drafter."""
    from xspec.models.deepseek_v4.convert import quantize_fp8, quantize_w8a8
    from xspec.models.deepseek_v4.tiny import generate_tiny

    root = tmp_path_factory.mktemp(f"prefix_{fmt}")
    generate_tiny(root / "float")
    (quantize_fp8 if fmt == "fp8" else quantize_w8a8)(root / "float", root / fmt)
    overrides = {"model.path": str(root / fmt), "model.dtype": "float32", "model.tokenizer": "byte"}
    llm = xspec.LLM(model="dsv4_flash", spec="mtp", platform="cpu", overrides=overrides)
    _, fill, lookup, hit = next(cases())
    for params in REGIMES:
        warm = engine(llm)
        run(warm, fill, params)
        got, got_drafts = run(warm, lookup, params)
        cold, cold_drafts = run(engine(llm), lookup, params)
        assert got.cached_tokens == hit
        assert (got.token_ids, got_drafts) == (cold.token_ids, cold_drafts)


@pytest.mark.parametrize("model", ["dsv4_tiny", "qwen3_tiny"])
def test_restored_state_gives_the_same_logits(model: str) -> None:
    """Model level: a state restored from block snapshots scores the rest of a prompt
    with logits equal bit for bit to the state they were taken of."""
    target = llm_of(model, "none")._built.target
    prompt = torch.tensor(ids(3 * BLOCK + 37, 5))
    cold = target.new_state()
    snaps = []
    for lo in range(0, 3 * BLOCK, BLOCK):
        target.forward(ForwardBatch(prompt[lo : lo + BLOCK], [BLOCK], [cold]))
        snaps.append(target.snapshot(cold, lo))
    hit = target.new_state()
    target.restore(hit, snaps[:2])
    target.forward(ForwardBatch(prompt[2 * BLOCK : 3 * BLOCK], [BLOCK], [hit]))
    rest = prompt[3 * BLOCK :]
    a = target.forward(ForwardBatch(rest, [len(rest)], [cold])).logits
    b = target.forward(ForwardBatch(rest, [len(rest)], [hit])).logits
    assert torch.equal(a, b)


@pytest.mark.slow
def test_a_stale_dspark_window_is_caught() -> None:
    """The comparison sees the drafter's state: a hit whose DSpark context rings are
    another prompt's (the target state right) drafts otherwise than the cold run."""
    llm = llm_of("dsv4_tiny", "dspark")
    prompt = ids(2 * BLOCK + 20, 8)
    _, cold_drafts = run(engine(llm), prompt, SamplingParams())
    warm = engine(llm)
    run(warm, prompt[: 2 * BLOCK + 5], SamplingParams())
    other = engine(llm)
    run(other, ids(2 * BLOCK + 5, 9), SamplingParams())
    stale = {e.end: e.draft for e in other.prefix_cache._entries.values()}  # type: ignore[union-attr]
    for entry in warm.prefix_cache._entries.values():  # type: ignore[union-attr]
        entry.draft = stale[entry.end]
    got, got_drafts = run(warm, prompt, SamplingParams())
    assert got.cached_tokens == 2 * BLOCK
    assert got_drafts != cold_drafts


def test_off_is_todays_prefill() -> None:
    """``engine.prefix_cache=false`` builds no cache and prefills whole, as before."""
    off = xspec.LLM(
        model="qwen3_tiny", spec="none", platform="cpu", overrides={"engine.prefix_cache": False}
    )
    assert off._built.engine.prefix_cache is None
    on = llm_of("qwen3_tiny", "none")._built.engine
    assert on.prefix_cache is not None and on.prefix_cache.block == 256


@pytest.mark.slow
def test_evictions_keep_hits_exact_and_every_request_completes() -> None:
    """A cache of three blocks under five distinct two-block prefixes: it evicts (least
    recently used leaves first), every request completes, what is still cached hits and
    equals the cold run."""
    llm = llm_of("qwen3_tiny", "none")
    e = engine(llm)
    run(e, ids(2 * BLOCK + 3, 20), SamplingParams())
    one = e.prefix_cache.nbytes // 2  # type: ignore[union-attr]
    small = engine(llm, capacity=3 * one)
    prompts = [ids(2 * BLOCK + 3, 20 + k) for k in range(5)]
    gens = small.run([Request(p, 4, SamplingParams(), ignore_eos=True) for p in prompts], 2)
    assert all(g.error is None and len(g.token_ids) == 4 for g in gens)
    cache = small.prefix_cache
    assert cache is not None and cache.stats.evicted > 0 and cache.nbytes <= 3 * one
    again, _ = run(small, [*prompts[-1][:-1], 99], SamplingParams())
    cold, _ = run(engine(llm), [*prompts[-1][:-1], 99], SamplingParams())
    assert again.cached_tokens > 0 and again.token_ids == cold.token_ids


@pytest.mark.slow
def test_batched_prefills_with_hits_and_misses() -> None:
    """Several newcomers in one prefill, some hitting at different depths, some cold,
    with ``max_prefill_tokens`` splitting them: each equals its run alone."""
    llm = llm_of("qwen3_tiny", "none")
    base = ids(3 * BLOCK, 30)
    e = engine(llm)
    run(e, [*base, 1, 2], SamplingParams())
    prompts = [base[: BLOCK + 9], [*base, 1, 7], ids(BLOCK + 70, 31), base[: 2 * BLOCK + 1]]
    gens = e.run([Request(p, 6, SamplingParams(), ignore_eos=True) for p in prompts], 4)
    assert [g.cached_tokens for g in gens] == [BLOCK, 3 * BLOCK, 0, 2 * BLOCK]
    for p, g in zip(prompts, gens):
        alone, _ = run(engine(llm), p, SamplingParams())
        assert g.token_ids[:6] == alone.token_ids[:6]


# ---- the cache's bookkeeping --------------------------------------------------------------


HELD = HeldRow(torch.zeros(0), None)  # 0 bytes


class Snap:
    def __init__(self, end: int, n: int = 100) -> None:
        self.end, self.n = end, n

    def nbytes(self) -> int:
        return self.n


def fill(cache: PrefixCache, prompt: list[int], upto: int) -> list:
    parent, out = None, []
    for end in range(cache.block, upto + 1, cache.block):
        parent = cache.insert(parent, prompt, end, Snap(end), None, HELD, room=math.inf)
        assert parent is not None
        out.append(parent)
    cache.release(out)
    return out


def test_match_takes_the_longest_prefix_short_of_the_last_token() -> None:
    cache = PrefixCache(4, math.inf)
    p = list(range(20))
    fill(cache, p, 12)
    assert cache.match(p).tokens == 12
    assert cache.match(p[:13]).tokens == 12  # all but the last token
    assert cache.match(p[:12]).tokens == 8  # never the whole prompt
    assert cache.match(p[:6] + [99] * 10).tokens == 4
    assert cache.match(p[:8] + [99] * 4).tokens == 8  # the token after 8 differs
    assert cache.match([99, *p[1:]]).tokens == 0


def test_eviction_is_lru_leaves_first_and_spares_pins() -> None:
    cache = PrefixCache(4, math.inf)
    a, b = list(range(12)), list(range(100, 112))
    fill(cache, a, 8)
    fill(cache, b, 8)
    pinned = cache.match(a)  # a's chain is the most recent, and pinned
    assert cache.evict(100) == 100 and cache.match(b).tokens == 4  # b's leaf went first
    cache.release(cache.match(b).entries * 2)
    assert cache.evict(math.inf) == 100  # b's root; a's pinned chain stays
    assert len(cache) == 2
    cache.release(pinned.entries)
    cache.clear()
    assert len(cache) == 0 and cache.nbytes == 0


def test_insert_respects_capacity_and_room() -> None:
    cache = PrefixCache(4, 250)
    p = list(range(30))
    e1 = cache.insert(None, p, 4, Snap(4), None, HELD, room=math.inf)
    e2 = cache.insert(e1, p, 8, Snap(8), None, HELD, room=math.inf)
    assert e2 is not None and cache.insert(e2, p, 12, Snap(12), None, HELD, room=math.inf) is None
    cache.release([e1, e2])  # unpinned: the leaf gives way to a new prompt's block
    assert cache.insert(None, [7] * 8, 4, Snap(4), None, HELD, room=math.inf) is not None
    assert cache.nbytes == 200 and cache.stats.evicted == 1
    assert (
        cache.insert(None, [8] * 8, 4, Snap(4), None, HELD, room=0) is None or cache.nbytes <= 200
    )


def test_a_cache_that_cannot_hold_one_block_is_refused() -> None:
    plan = llm_of("qwen3_tiny", "none")._built.engine.plan
    assert plan is not None

    class Section:
        prefix_cache, prefix_block, prefix_cache_gib = True, 256, 1e-9

    with pytest.raises(ConfigError, match="cannot hold one block of 256 tokens"):
        prefix_cache_of(Section(), plan, 1)
    Section.prefix_cache_gib, Section.prefix_block = 1.0, 100
    with pytest.raises(ConfigError, match="multiple of 128"):
        prefix_cache_of(Section(), plan, 128)


def test_cli_refuses_a_tiny_cache_with_exit_2_and_prints_its_share(xspec_cache: Path) -> None:
    r = run_cli(
        "model=qwen3_tiny", "spec=none", "platform=cpu", "engine.prefix_cache_gib=1e-9",
        cache=xspec_cache,
    )  # fmt: skip
    assert r.returncode == 2 and "cannot hold one block" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    r = run_cli(
        "model=qwen3_tiny", "spec=none", "platform=cpu", "workload.num_requests=1",
        "workload.max_new_tokens=2", "workload.warmup_requests=0", cache=xspec_cache,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "prefix cache: up to" in r.stdout


def test_metrics_count_prompt_tokens_looked_up_and_restored() -> None:
    """Prometheus ``xspec_prefix_cache_queries_total`` / ``..._hits_total`` in prompt
    tokens, as the engine's metrics report them."""
    e = engine(llm_of("qwen3_tiny", "none"))
    prompt = ids(BLOCK + 10, 40)
    run(e, prompt, SamplingParams())
    run(e, prompt, SamplingParams())
    m = e.metrics
    assert (m.prefix_queries, m.prefix_hits) == (2 * len(prompt), BLOCK)
    assert m.prefix_hit_rate == BLOCK / (2 * len(prompt))
    text = m.exposition()
    assert f"xspec_prefix_cache_queries_total {2 * len(prompt)}.0" in text
    assert f"xspec_prefix_cache_hits_total {BLOCK}.0" in text


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
def test_load_with_more_prefixes_than_fit_keeps_memory_flat() -> None:
    """Forty distinct two-block prompts through a cache of four blocks, ten at a time: it
    evicts, every request completes, the cache never holds more than its capacity, and
    the process's resident memory after the first rounds stays flat."""
    llm = llm_of("qwen3_tiny", "none")
    probe = engine(llm)
    run(probe, ids(2 * BLOCK + 3, 60), SamplingParams())
    block_bytes = probe.prefix_cache.nbytes // 2  # type: ignore[union-attr]
    e = engine(llm, capacity=4 * block_bytes)
    cache = e.prefix_cache
    assert cache is not None
    rss = []
    for r in range(4):
        prompts = [ids(2 * BLOCK + 3, 100 + 10 * r + k) for k in range(10)]
        gens = e.run([Request(p, 3, SamplingParams(), ignore_eos=True) for p in prompts], 4)
        assert all(g.error is None and len(g.token_ids) == 3 for g in gens)
        assert cache.nbytes <= 4 * block_bytes and len(cache) <= 4
        rss.append(_rss_mib())
    assert cache.stats.evicted >= 30
    assert rss[-1] - rss[1] < 32, rss  # MiB: no growth with the number of prefixes seen


def test_every_repeat_of_a_cli_run_starts_cold(tmp_path: Path, xspec_cache: Path) -> None:
    """``workload.repeats``: the cache is cleared before each measured run, so the
    repeats measure the same thing (here: synthetic prompts that share nothing)."""
    out = tmp_path / "run"
    r = run_cli(
        "model=qwen3_tiny", "spec=none", "platform=cpu", "workload=synthetic",
        "workload.input_len=300", "workload.output_len=2", "workload.num_requests=2",
        "workload.repeats=2", f"hydra.run.dir={out}", cache=xspec_cache,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    figures = json.loads((out / "results.json").read_text())["prefix_cache"]
    assert figures["hits"] == 0 and figures["queries"] == 1200 and figures["evicted"] == 0
    assert "prefix cache: 0 of 1200 prompt tokens restored" in r.stdout
