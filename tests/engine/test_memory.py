"""The memory planner: arithmetic, analytic bytes == allocated bytes at full length,
the pool (reservation on admission, release on completion), rejection of a request that
can never fit among good ones, and a budget too small for one sequence."""

from __future__ import annotations

import dataclasses
from functools import cache

import pytest

import xspec
from xspec.engine.engine import Engine, Request
from xspec.engine.memory import (
    MemoryPlan,
    ReservationPool,
    allocated_bytes,
    resolve_budget,
    verify_workspace,
)
from xspec.errors import ConfigError, MemoryBudgetError
from xspec.models.base import KvBytes
from xspec.models.deepseek_v4.dspark import HOLD_ROWS, PENDING_ROWS, DSparkCache
from xspec.sampling import SamplingParams
from xspec.spec.step import decode_step, prefill

# a run with steps in which requests do not draft (a gamma schedule with a 0)
SKIPS = {"spec.num_speculative_tokens": 5, "spec.gamma_schedule": [[1, 5], [3, 0]]}


@cache
def llm(model: str, spec: str, skips: bool = False) -> xspec.LLM:
    """``skips``: with :data:`SKIPS` (steps in which requests do not draft)."""
    return xspec.LLM(model=model, spec=spec, platform="cpu", overrides=SKIPS if skips else {})


def plan_of(**kw: object) -> MemoryPlan:
    base = dict(
        budget=10_000,
        weights=1_000,
        target=KvBytes(100, 10.0),
        draft=KvBytes(40, 0.5),
        workspace=60,
        gamma=3,
        max_context=64,
    )
    return MemoryPlan(**{**base, **kw})  # type: ignore[arg-type]


def test_plan_arithmetic_target_plus_draft() -> None:
    p = plan_of()
    assert p.available == 9_000
    assert p.seq_tokens(10, 7) == 20  # prompt + new + gamma
    # fixed 100 + 40, per token (10 + 0.5) * 20, workspace 60
    assert p.seq_kv_bytes(10, 7) == 100 + 200 + 40 + 10
    assert p.seq_bytes(10, 7) == 350 + 60
    assert p.max_seqs(10, 7) == 9_000 // 410
    assert p.problem(10, 7) is None
    assert "model context of 64" in (p.problem(50, 20) or "")
    assert "engine.memory_budget" in (plan_of(budget=1_400).problem(10, 7) or "")
    assert verify_workspace(100, 8, 3) == 4 * (3 * 100 + 16 * 8) * 4 + 3 * 100 * 4
    assert "memory plan: budget" in p.describe(10, 7, 4)


def test_budget_resolution() -> None:
    assert resolve_budget(5_000.0, 10**9, 10, 0.5) == 5_000  # > 1: bytes
    assert resolve_budget(0.25, 1_000, 200, 0.5) == 300  # fraction of free + weights
    assert resolve_budget(None, 1_000, 200, 0.5) == 600  # the platform's default
    with pytest.raises(ConfigError, match="must be > 0"):
        resolve_budget(0.0, 1_000, 0, 0.5)


def test_pool_reserves_and_releases() -> None:
    pool = ReservationPool(100)
    assert pool.try_reserve(0, 60) and not pool.try_reserve(1, 50)
    pool.release(0)
    assert pool.try_reserve(1, 50) and pool.reserved == 50 and pool.peak == 60


def test_dspark_reserves_only_window_rings_mtp_its_layer() -> None:
    """The DeepSeek-V4 DSpark draft keeps one [window, head_dim] ring per stage, the
    captures it holds back until it drafts (a window's and a buffer's), and nothing per
    token; MTP keeps its SWA ring (+ rollback rows); Qwen3 drafts grow."""
    dspark = llm("dsv4_tiny_random", "dspark")._built
    args, stages = dspark.target.args, len(dspark.drafter.model.stages)
    es = dspark.target.dtype.itemsize
    rings = stages * args.sliding_window * args.head_dim * es
    row = stages * args.hidden_size * es  # one capture held back, K*d
    assert dspark.drafter.kv_bytes() == KvBytes(rings + PENDING_ROWS * row)  # fixed gamma
    plain = llm("dsv4_tiny_random", "dspark", skips=True)._built  # up to a window more
    window = HOLD_ROWS + args.sliding_window
    assert plain.drafter.kv_bytes() == KvBytes(rings + window * row)
    mtp = llm("dsv4_tiny_random", "mtp")._built
    assert mtp.drafter.kv_bytes().fixed >= args.sliding_window * args.head_dim * es
    assert mtp.engine.plan.target == mtp.target.kv_bytes()
    assert mtp.target.kv_bytes().per_token > 0  # C4 / C128 entries and indexer keys
    assert llm("qwen3_tiny", "dflash")._built.drafter.kv_bytes().per_token > 0
    assert llm("dsv4_tiny_random", "none")._built.drafter.kv_bytes() == KvBytes()


@pytest.mark.parametrize(
    ("model", "spec", "skips"),
    [
        ("dsv4_tiny_random", "mtp", False),
        ("dsv4_tiny_random", "dspark", False),
        ("dsv4_tiny_random", "dspark", True),
        ("qwen3_tiny", "dflash", False),
    ],
)
def test_planned_bytes_equal_allocated_at_full_length(model: str, spec: str, skips: bool) -> None:
    """Three sequences run to their full length: the tensors their target and draft
    states hold add up to the plan's per-sequence figure within 2% (never above it). A
    DSpark state of a run with steps without drafts at its most: holding back its rows
    since it stopped drafting."""
    b = llm(model, spec, skips)._built
    plan, engine = b.engine.plan, b.engine
    reqs = [
        Request(list(range(3, 3 + n)), m, SamplingParams())
        for n, m in ((20, 40), (9, 30), (31, 25))
    ]
    seqs = [engine._start(r) for r in reqs]
    prefill(b.target, b.drafter, seqs, b.capture, 2048)
    while any(s.remaining > 0 for s in seqs):
        decode_step(
            b.target, b.drafter, [s for s in seqs if s.remaining > 0], b.capture, engine.metrics
        )
    for r, s in zip(reqs, seqs):
        if skips:  # its most: it stopped drafting, a backlog of its held rows
            assert isinstance(s.draft_state, DSparkCache)
            s.draft_state.defer(s.draft_state.held[:1])
        got = allocated_bytes(s.target_state) + allocated_bytes(s.draft_state)
        want = plan.seq_kv_bytes(len(r.prompt_ids), r.max_new_tokens)
        assert got <= want
        assert got == pytest.approx(want, rel=0.02), (got, want)


def budget_for(plan: MemoryPlan, seqs: float, prompt: int, new: int) -> MemoryPlan:
    return dataclasses.replace(plan, budget=plan.weights + int(seqs * plan.seq_bytes(prompt, new)))


def test_pool_admits_as_others_finish_and_frees_everything() -> None:
    """A budget for 2 sequences, 5 requests at concurrency 5: at most 2 run at once,
    each completion admits the next, all finish with the unconstrained output."""
    b = llm("dsv4_tiny_random", "mtp")._built
    prompts = [list(range(5 + i, 20 + i)) for i in range(5)]
    want = [
        g.token_ids for g in b.engine.run([Request(p, 6, SamplingParams()) for p in prompts], 5)
    ]
    plan = budget_for(b.engine.plan, 2.5, 15, 6)
    engine = Engine(
        b.target, b.drafter, b.capture, stop_ids=frozenset(), plan=plan, measure_memory=True
    )
    gens = engine.run([Request(p, 6, SamplingParams()) for p in prompts], 5)
    assert [g.token_ids for g in gens] == want and all(g.error is None for g in gens)
    assert engine.pool.peak == 2 * plan.seq_bytes(15, 6)  # two at a time, never three
    assert engine.pool.reserved == 0 and not engine.pool.held  # all released
    assert 0 < engine.peak_allocated <= engine.pool.peak


def test_impossible_request_rejected_alone() -> None:
    """Beyond the model context, or beyond the memory plan: that request gets an error
    and no tokens; the others complete as if it had not been there."""
    b = llm("dsv4_tiny_random", "mtp")._built
    good = [list(range(5, 20)), list(range(30, 41))]
    want = [g.token_ids for g in b.engine.run([Request(p, 6, SamplingParams()) for p in good], 2)]
    plan = budget_for(b.engine.plan, 1.5, 15, 6)
    engine = Engine(b.target, b.drafter, b.capture, stop_ids=frozenset(), plan=plan)
    too_long = Request([7] * (b.target.max_context + 1), 4, SamplingParams())
    too_big = Request(list(range(5, 20)), 3000, SamplingParams())  # fits the context, not the plan
    gens = engine.run(
        [
            Request(good[0], 6, SamplingParams()),
            too_long,
            too_big,
            Request(good[1], 6, SamplingParams()),
        ],
        4,
    )
    assert [gens[0].token_ids, gens[3].token_ids] == want
    assert (
        gens[1].token_ids == []
        and "request 1" in gens[1].error
        and "model context" in gens[1].error
    )
    assert gens[2].token_ids == [] and "engine.memory_budget" in gens[2].error


def test_api_too_long_prompt_is_a_per_request_error() -> None:
    out = llm("qwen3_tiny", "none").generate([[1] * 5000, [1, 2, 3]], max_new_tokens=3)
    assert "exceeds the model context" in out[0].error and out[0].token_ids == []
    assert out[1].error is None and len(out[1].token_ids) == 3


def test_budget_too_small_for_one_sequence() -> None:
    with pytest.raises(
        MemoryBudgetError, match=r"1000 bytes available but at least \d+ are needed"
    ):
        xspec.LLM(
            model="qwen3_tiny",
            spec="none",
            platform="cpu",
            overrides={"engine.memory_budget": 1000},
        )


@pytest.mark.parametrize("value", [0, -5])
def test_non_positive_budget_is_a_config_error(value: float) -> None:
    with pytest.raises(ConfigError, match=r"engine\.memory_budget must be > 0"):
        xspec.LLM(
            model="qwen3_tiny",
            spec="none",
            platform="cpu",
            overrides={"engine.memory_budget": value},
        )


def test_default_budget_is_half_the_free_ram_on_cpu() -> None:
    """Null engine.memory_budget: half of (free RAM + the loaded weights); the weights
    are the parameter and buffer bytes."""
    b = llm("qwen3_tiny", "none")._built
    plan = b.engine.plan
    tensors = [*b.target.parameters(), *b.target.buffers()]
    assert plan.weights == sum(t.numel() * t.element_size() for t in tensors)
    free = b.platform.memory_available()
    assert plan.budget == pytest.approx(0.5 * (free + plan.weights), rel=0.05)
