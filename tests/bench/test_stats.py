"""Benchmark figures on fixed numbers: percentiles, TPOT, goodput, acceptance, schedule."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
from pathlib import Path

import numpy as np
import pytest

from xspec.bench.dataset import LocalTokens, synthetic
from xspec.bench.serve import arrival_schedule, spec_counts
from xspec.bench.stats import (
    RequestOutcome,
    SpecCounts,
    bootstrap_interval,
    describe,
    percentile,
    summarize,
)

TINY = Path(__file__).resolve().parents[2] / "xspec" / "assets" / "dsv4_tiny"


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.5
    assert percentile([0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100], 90) == 90
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 10, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), abs=1e-15)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_describe_reports_milliseconds() -> None:
    d = describe([0.1, 0.2, 0.3, 0.4], "ttft", (50, 99))
    assert d["mean_ttft_ms"] == pytest.approx(250.0)
    assert d["median_ttft_ms"] == pytest.approx(250.0)
    assert d["p50_ttft_ms"] == d["median_ttft_ms"]
    assert d["std_ttft_ms"] == pytest.approx(math.sqrt(12500.0))  # population std, as numpy
    assert d["p99_ttft_ms"] == pytest.approx(397.0)
    assert describe([], "tpot", (99,)) == dict.fromkeys(
        ["mean_tpot_ms", "median_tpot_ms", "std_tpot_ms", "p99_tpot_ms"]
    )


def _ok(ttft: float, e2el: float, tokens: int, spec: SpecCounts | None = None) -> RequestOutcome:
    gaps = [(e2el - ttft) / (tokens - 1)] * (tokens - 1) if tokens > 1 else []
    return RequestOutcome(10, True, tokens, ttft, e2el, gaps, spec)


def test_tpot_excludes_the_first_token() -> None:
    assert _ok(0.1, 0.5, 5).tpot == pytest.approx(0.1)
    assert _ok(0.1, 0.1, 1).tpot is None  # one token: no TPOT
    assert RequestOutcome(10, error="x").tpot is None


def test_summary_counts_goodput_and_acceptance() -> None:
    outcomes = [
        _ok(0.05, 0.45, 5, SpecCounts(10, 30, 15)),  # TTFT 50 ms, TPOT 100 ms
        _ok(0.20, 0.28, 5, SpecCounts(5, 15, 0)),  # TTFT 200 ms: misses the TTFT SLO
        _ok(0.01, 0.05, 5, SpecCounts(1, 3, 3)),  # TTFT 10 ms, TPOT 10 ms
        RequestOutcome(99, error="HTTP 500: boom"),
    ]
    r = summarize(outcomes, 2.0, {"ttft": 100, "tpot": 150})
    assert (r["completed"], r["failed"]) == (3, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 15)
    assert r["request_throughput"] == 1.5 and r["output_throughput"] == 7.5
    assert r["total_token_throughput"] == 22.5
    assert r["request_goodput"] == r["goodput"] == 1.0  # 2 good requests in 2 s
    assert summarize(outcomes, 2.0, {"e2el": 100})["goodput"] == 0.5
    assert summarize(outcomes, 2.0, {})["goodput"] is None  # no SLOs given
    assert r["spec_acceptance_rate"] == pytest.approx(18 / 48)
    assert r["spec_acceptance_length"] == pytest.approx(1 + 18 / 16)
    assert (r["spec_num_drafts"], r["spec_num_draft_tokens"]) == (16, 48)
    assert r["median_tpot_ms"] == pytest.approx(20.0)  # TPOTs 100, 20, 10 ms
    assert len(r["itls"]) == 4 and r["itls"][3] == [] and r["errors"][3] == "HTTP 500: boom"
    assert r["ttfts"] == [0.05, 0.20, 0.01, None]
    # one response without counts: acceptance unknown, not a partial figure
    r = summarize([*outcomes[:2], _ok(0.01, 0.05, 5)], 1.0, {})
    assert r["spec_acceptance_rate"] is None and r["spec_acceptance_length"] is None


def test_spec_counts_shapes() -> None:
    counts = {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 8}
    assert spec_counts({"completion_tokens": 12, "spec_decode": counts}) == SpecCounts(4, 12, 8)
    assert spec_counts({"speculative_decoding": counts}) == SpecCounts(4, 12, 8)
    assert spec_counts({"completion_tokens": 12, **counts}) == SpecCounts(4, 12, 8)
    # SGLang: verify steps only, each committing accepted + 1 tokens
    assert spec_counts({"completion_tokens": 12, "spec_verify_ct": 4}) == SpecCounts(4, None, 8)
    assert spec_counts({"completion_tokens": 12, "prompt_tokens": 3}) is None
    r = summarize([_ok(0.1, 0.2, 12, SpecCounts(4, None, 8))], 1.0, {})
    assert r["spec_acceptance_length"] == 3.0 and r["spec_acceptance_rate"] is None


def test_poisson_schedule_is_seeded_exponential_gaps() -> None:
    rng = random.Random(7)
    expected, t = [], 0.0
    for _ in range(5):
        expected.append(t)
        t += -math.log(1.0 - rng.random()) / 4.0
    assert arrival_schedule(5, 4.0, 1.0, seed=7) == expected
    assert arrival_schedule(5, 4.0, 1.0, seed=7) == arrival_schedule(5, 4.0, 1.0, seed=7)
    assert arrival_schedule(5, 4.0, 1.0, seed=8) != expected
    assert arrival_schedule(3, float("inf"), 1.0, seed=7) == [0.0, 0.0, 0.0]
    long = arrival_schedule(20001, 4.0, 1.0, seed=0)
    assert long[-1] / 20000 == pytest.approx(0.25, rel=0.02)  # mean gap 1/rate
    bursty = arrival_schedule(20001, 4.0, 0.5, seed=0)  # gamma shape 0.5: same mean
    assert bursty[-1] / 20000 == pytest.approx(0.25, rel=0.05)
    gaps = np.diff(bursty)
    assert gaps.std() > np.diff(long).std()  # burstier: more spread


def test_synthetic_prompts_are_seeded_and_counted_in_tokens() -> None:
    """--input-len counts tokens as the server does (BOS included), not words: the tiny
    model's tokenizer splits most words in several tokens."""
    tok = LocalTokens(TINY)

    def make(seed: int) -> list:
        return asyncio.run(synthetic(3, 40, 16, seed, tok))

    a = make(0)
    assert a == make(0) and a != make(1)
    for r in a:
        ids = asyncio.run(tok.encode(r.prompt, True))
        assert r.prompt_len == len(ids) and 39 <= len(ids) <= 40 and r.max_tokens == 16
    assert any(len(r.prompt.split()) < 39 for r in a)  # words are not tokens here


def _ratio_of_medians(rows: list[tuple[float, float]]) -> float:
    return statistics.median(b for _, b in rows) / statistics.median(a for a, _ in rows)


def test_bootstrap_interval_keeps_rows_whole() -> None:
    """A row is resampled whole: b = 1.05 a in every row (a slow or fast repeat moves
    both) gives exactly 1.05, where resampling a and b apart would spread it."""
    rng = random.Random(1)
    rows = [(a, 1.05 * a) for a in (rng.uniform(50, 150) for _ in range(8))]
    lo, hi = bootstrap_interval(rows, _ratio_of_medians)
    assert lo == pytest.approx(1.05) and hi == pytest.approx(1.05)


def test_bootstrap_interval_covers_the_statistic_and_narrows_with_more_rows() -> None:
    rng = random.Random(2)
    few = [rng.gauss(10.0, 1.0) for _ in range(8)]
    many = few + [rng.gauss(10.0, 1.0) for _ in range(192)]
    lo8, hi8 = bootstrap_interval(few, statistics.median)
    lo200, hi200 = bootstrap_interval(many, statistics.median)
    assert lo8 <= statistics.median(few) <= hi8
    assert lo200 < 10.0 < hi200
    assert hi200 - lo200 < (hi8 - lo8) / 2
    wide = bootstrap_interval(few, statistics.median, level=0.99)
    assert wide[0] <= lo8 and wide[1] >= hi8  # a higher level, a wider interval


def test_bootstrap_interval_is_seeded_and_checks_its_input() -> None:
    rng = random.Random(3)
    rows = [rng.gauss(0.0, 1.0) for _ in range(20)]
    assert bootstrap_interval(rows, statistics.mean) == bootstrap_interval(rows, statistics.mean)
    assert bootstrap_interval(rows, statistics.mean, seed=1) != bootstrap_interval(
        rows, statistics.mean, seed=2
    )
    with pytest.raises(ValueError, match="no rows"):
        bootstrap_interval([], statistics.mean)
    with pytest.raises(ValueError, match="level"):
        bootstrap_interval(rows, statistics.mean, level=1.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval(rows, statistics.mean, resamples=0)
