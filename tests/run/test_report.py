"""Timing figures of the CLI's main job: warm-up, the TPOT rule, repeats as median ±spread."""

from __future__ import annotations

import io

import pytest

import xspec
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation
from xspec.run.report import (
    Spread,
    format_timings,
    run_workload,
    spread,
    timings,
)


def gen(n_tokens: int, ttft: float, latency: float) -> Generation:
    return Generation([1], list(range(n_tokens)), ttft, latency, 0)


def test_spread_is_median_and_half_the_range() -> None:
    assert spread([3.0, 1.0, 10.0]) == Spread(3.0, 4.5)
    assert spread([2.0, 4.0]) == Spread(3.0, 1.0)
    assert spread([5.0]) == Spread(5.0, 0.0)
    assert spread([None, 4.0, None, 6.0]) == Spread(5.0, 1.0)  # missing figures are skipped
    assert spread([None, None]) is None and spread([]) is None
    assert Spread(12.34, 0.4).format(".1f") == "12.3 ±0.4"


def test_tpot_leaves_out_one_token_requests() -> None:
    """TPOT is a mean over requests with >= 2 output tokens, not a 0 for the others."""
    gens = [gen(1, 0.010, 0.010), gen(5, 0.010, 0.050)]  # the second: 40 ms / 4 tokens
    t = timings(gens)
    assert t.tpot_ms == pytest.approx(10.0) and t.output_tokens == 6
    assert gens[0].tpot_s is None
    only_one = timings([gen(1, 0.01, 0.01), gen(1, 0.02, 0.02)])
    assert only_one.tpot_ms is None
    assert "TPOT mean=n/a" in format_timings([gen(1, 0.01, 0.01)])


def test_queue_wait_is_its_own_figure() -> None:
    """Two requests one after the other: the second waits 70 ms for the first; that is
    its queue time, not part of its TTFT / e2e. The wall time runs to the last token."""
    first = Generation([1], list(range(5)), 0.030, 0.070, 0, admitted_at=0.0)
    second = Generation([1], list(range(5)), 0.090, 0.130, 0, admitted_at=0.070)
    assert second.queue_s == pytest.approx(0.070) and second.ttft_s == pytest.approx(0.020)
    assert second.latency_s == pytest.approx(0.060) and second.tpot_s == pytest.approx(0.010)
    t = timings([first, second])
    assert t.ttft_ms == pytest.approx(25.0) and t.queue_ms == pytest.approx(35.0)
    assert t.e2e_ms == pytest.approx(65.0) and t.tpot_ms == pytest.approx(10.0)
    assert t.wall_s == pytest.approx(0.130) and t.throughput == pytest.approx(10 / 0.130)
    line = format_timings([first, second]).splitlines()[1]
    assert "TTFT mean=25.0 ms" in line and "queue mean=35.0 ms" in line
    assert "e2e mean=65.0 ms" in line


def test_warmup_is_excluded_and_repeats_are_measured() -> None:
    llm = xspec.LLM(model="qwen3_tiny", spec="oracle", platform="cpu")  # gamma 3
    built = llm._built
    calls: list[int] = []
    run = built.engine.run
    built.engine.run = lambda reqs, c: calls.append(len(reqs)) or run(reqs, c)  # type: ignore[method-assign]
    w = WorkloadConfig(
        prompts=["ab", "cde"], num_requests=2, max_new_tokens=9, warmup_requests=1, repeats=3
    )
    out = io.StringIO()
    runs = run_workload(built, w, SamplingConfig(), out)
    assert calls == [1, 2, 2, 2]  # one warm-up request, then three measured runs
    assert len(runs) == 3 and all(len(g.token_ids) == 9 for gens in runs for g in gens)
    rep = built.engine.metrics.report()  # reset after the warm-up: measured runs only
    assert rep.num_committed_tokens == 3 * 2 * (9 - 1)
    assert rep.num_steps == 3 * 2  # 8 tokens after prefill = two full oracle blocks of 4
    assert "[repeat 3/3]" in out.getvalue()


def test_progress_bar_counts_decoded_tokens_only_on_a_terminal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import tqdm

    from xspec.run import report

    updates: list[int] = []

    class Bar:
        def __init__(self, total: int, **kwargs: object) -> None:
            self.total = total

        def __enter__(self) -> Bar:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def update(self, n: int) -> None:
            updates.append(n)

    monkeypatch.setattr(tqdm, "tqdm", Bar)
    built = xspec.LLM(model="qwen3_tiny", spec="oracle", platform="cpu")._built  # gamma 3
    w = WorkloadConfig(prompts=["ab"], num_requests=2, max_new_tokens=9, print_outputs=False)

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    run_workload(built, w, SamplingConfig(), io.StringIO())  # not a terminal: no bar
    assert updates == [] and type(built.engine.metrics) is report.SpecDecodeMetrics
    run_workload(built, w, SamplingConfig(), Tty())
    assert sum(updates) == 2 * 8  # decode tokens: 9 per request, the first from prefill
    assert built.engine.metrics.report().num_committed_tokens == 2 * 8


def test_latency_means_leave_out_failed_requests() -> None:
    """A request rejected at admission (no tokens, TTFT 0) must not pull the means down."""
    from xspec.run.results import run_figures

    good = gen(5, ttft=0.2, latency=0.6)
    rejected = Generation([1], [], 0.0, 0.0, 0, error="request 1: can never fit")
    t = timings([good, rejected])
    assert t.ttft_ms == pytest.approx(200.0) and t.tpot_ms == pytest.approx(100.0)
    figures = run_figures([good, rejected])
    assert figures["ttft_ms_mean"] == pytest.approx(200.0)
    assert figures["e2e_ms_mean"] == pytest.approx(600.0) and figures["errors"] == 1


def test_the_engine_starts_its_counters_afresh_itself() -> None:
    """The warm-up and the progress bar reset the spec-decode counters through the engine
    (``Engine.reset_metrics``), which returns what it had counted."""
    from xspec.engine.engine import Request
    from xspec.metrics import SpecDecodeMetrics
    from xspec.sampling import SamplingParams

    engine = xspec.LLM(model="qwen3_tiny", spec="oracle", platform="cpu").engine
    engine.run([Request([1, 2, 3], 4, SamplingParams())], 1)
    counted, mine = engine.metrics, SpecDecodeMetrics()
    assert engine.reset_metrics(mine) is counted and engine.metrics is mine
    assert counted.report().num_steps > 0 and mine.report().num_steps == 0
    assert engine.reset_metrics() is mine and engine.metrics is not mine
