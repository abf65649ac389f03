"""results.json content, the combined table with speedups vs spec=none, the plot."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

import xspec
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation
from xspec.run.report import run_workload
from xspec.run.results import (
    job_results,
    plot,
    run_figures,
    summary_markdown,
    summary_rows,
    write_summary,
)


def gen(n_prompt: int, n_out: int, ttft: float, latency: float) -> Generation:
    return Generation(list(range(n_prompt)), list(range(n_out)), ttft, latency, 0)


def test_run_figures_are_means_over_requests() -> None:
    f = run_figures([gen(4, 1, 0.010, 0.010), gen(8, 5, 0.020, 0.060)])
    assert f["input_tokens_mean"] == 6 and f["output_tokens_mean"] == 3
    assert f["ttft_ms_mean"] == pytest.approx(15.0)
    assert f["tpot_ms_mean"] == pytest.approx(10.0)  # only the 5-token request: 40 ms / 4
    assert f["e2e_ms_mean"] == pytest.approx(35.0)
    assert f["output_tok_s"] == pytest.approx(6 / 0.060)
    assert f["queue_ms_mean"] == 0.0  # both admitted at the start


def test_run_figures_count_latencies_from_admission() -> None:
    """The second request waits 60 ms for the first: queue time, not TTFT / e2e; the
    wall time (and so tok/s) still runs from the start to the last token."""
    first = gen(4, 5, 0.020, 0.060)
    second = Generation([1, 2], list(range(5)), 0.080, 0.120, 0, admitted_at=0.060)
    f = run_figures([first, second])
    assert f["queue_ms_mean"] == pytest.approx(30.0) and f["ttft_ms_mean"] == pytest.approx(20.0)
    assert f["e2e_ms_mean"] == pytest.approx(60.0) and f["tpot_ms_mean"] == pytest.approx(10.0)
    assert f["wall_s"] == pytest.approx(0.120) and f["output_tok_s"] == pytest.approx(10 / 0.120)


@pytest.fixture(scope="module")
def oracle_job() -> dict:
    built = xspec.LLM(model="qwen3_tiny", spec="oracle", platform="cpu")._built  # gamma 3
    w = WorkloadConfig(prompts=["ab", "cde"], num_requests=2, max_new_tokens=9, repeats=3)
    runs = run_workload(built, w, SamplingConfig(), io.StringIO())
    return json.loads(json.dumps(job_results(built, w, runs, "qwen3_tiny")))  # plain JSON types


def test_results_schema(oracle_job: dict) -> None:
    j = oracle_job
    assert (j["model"], j["spec"], j["platform"], j["gamma"]) == ("qwen3_tiny", "oracle", "cpu", 3)
    assert (j["concurrency"], j["num_requests"], j["num_repeats"]) == (4, 2, 3)
    assert j["output_tokens_mean"] == 9 and j["input_tokens_mean"] == 2.5
    for key in ("ttft_ms_mean", "tpot_ms_mean", "e2e_ms_mean", "queue_ms_mean", "output_tok_s"):
        assert j[key] == sorted(r[key] for r in j["repeats"])[1]  # the median of 3 repeats
        assert j["half_range"][key] >= 0
    acc = j["acceptance"]
    assert acc["aggregate"] == 1.0 and acc["per_position"] == [1.0, 1.0, 1.0]
    assert (acc["full_block"], acc["zero_accept"]) == (1.0, 0.0)
    # every step verifies 3 drafts and keeps them all: 3 accepted + the bonus per row-step
    assert (acc["acceptance_length"], acc["mean_accepted_length"]) == (4.0, 3.0)
    assert j["spec_decode"]["acceptance_length"] == 4.0
    assert summary_rows([j])[0]["acceptance_length"] == 4.0
    assert "calibration" not in acc  # the oracle has no confidence head
    assert j["mean_committed_per_step"] == 4.0
    assert j["spec_decode"]["num_committed_tokens"] == 3 * 2 * 8  # the exported counters
    assert len(j["requests"]) == 6 and [r["repeat"] for r in j["requests"]] == [0, 0, 1, 1, 2, 2]
    r = j["requests"][0]
    assert r["prompt_tokens"] == 2 and len(r["output_token_ids"]) == 9 and r["error"] is None
    assert 0 < r["ttft_ms"] <= r["e2e_ms"] and r["tpot_ms"] > 0 and r["queue_ms"] >= 0


def test_results_carry_the_queue_wait_at_concurrency_1() -> None:
    """Serial requests in results.json: each one's queue_ms holds the e2e_ms of those
    before it; the job's queue_ms_mean is their mean."""
    built = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")._built
    w = WorkloadConfig(prompts=["ab", "cde"], num_requests=3, max_new_tokens=5, concurrency=1)
    runs = run_workload(built, w, SamplingConfig(), io.StringIO())
    j = json.loads(json.dumps(job_results(built, w, runs, "qwen3_tiny")))
    reqs = j["requests"]
    for k, r in enumerate(reqs):
        assert r["queue_ms"] >= sum(p["e2e_ms"] for p in reqs[:k]) - 1e-6
        if k:  # admitted once the previous one finished (queue + e2e: its finish time)
            assert r["queue_ms"] >= reqs[k - 1]["queue_ms"] + reqs[k - 1]["e2e_ms"] - 1e-6
    assert j["queue_ms_mean"] == pytest.approx(sum(r["queue_ms"] for r in reqs) / 3)


def job(spec: str, concurrency: int, tpot: float, tok_s: float) -> dict:
    return {
        "model": "m", "spec": spec, "platform": "cpu", "gamma": 0 if spec == "none" else 2,
        "concurrency": concurrency, "num_requests": 4, "num_repeats": 1,
        "input_tokens_mean": 5.0, "output_tokens_mean": 8.0, "ttft_ms_mean": 3.0,
        "tpot_ms_mean": tpot, "e2e_ms_mean": 20.0, "queue_ms_mean": 7.0, "output_tok_s": tok_s,
        "half_range": {}, "mean_committed_per_step": 1.0 if spec == "none" else 2.0,
        "acceptance": None if spec == "none" else {"aggregate": 0.5, "per_position": [0.6, 0.4]},
    }  # fmt: skip


def test_speedups_are_vs_spec_none_at_the_same_concurrency() -> None:
    jobs = [job("none", 1, 10.0, 100.0), job("mtp", 1, 5.0, 150.0), job("none", 8, 20.0, 400.0),
            job("mtp", 8, 16.0, 500.0), job("mtp", 2, 4.0, 10.0)]  # fmt: skip
    rows = summary_rows(jobs)
    assert [r["speedup_tpot"] for r in rows] == [1.0, 2.0, 1.0, 1.25, None]  # no none at c=2
    assert [r["speedup_tok_s"] for r in rows] == [1.0, 1.5, 1.0, 1.25, None]
    table = summary_markdown(rows).splitlines()
    assert "speedup TPOT" in table[2] and "speedup tok/s" in table[2] and "queue ms" in table[2]
    assert "| 3.0 | 7.0 |" in table[4]  # TTFT ms, then queue ms
    assert rows[0]["queue_ms_mean"] == 7.0
    assert table[5].endswith("| 2.000 | 1.500 |") and table[8].endswith("| n/a | n/a |")


def test_summary_files_and_plot(tmp_path: Path) -> None:
    jobs = [job("none", 1, 10.0, 100.0), job("mtp", 1, 5.0, 150.0)]
    table = write_summary(jobs, tmp_path)
    assert (tmp_path / "summary.md").read_text().strip() == table
    assert json.loads((tmp_path / "summary.json").read_text())[1]["speedup_tpot"] == 2.0
    assert plot(jobs, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_hint_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert plot([job("none", 1, 10.0, 100.0)], tmp_path / "p.png") is False
    assert not (tmp_path / "p.png").exists()
