"""metrics.port: Prometheus text over HTTP on loopback, the same numbers as results.json."""

from __future__ import annotations

import io
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

import xspec
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.errors import ConfigError
from xspec.run.exporter import MetricsExporter
from xspec.run.report import run_workload
from xspec.run.results import job_results


@pytest.fixture
def exporter() -> Iterator[MetricsExporter]:
    exp = MetricsExporter("127.0.0.1", 0)  # any free port
    yield exp
    exp.close()


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """One bounded GET; {sample name: {sorted labels: value}}."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode("utf-8")
    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_scrape_serves_spec_counters_and_request_histograms(exporter: MetricsExporter) -> None:
    assert exporter.host == "127.0.0.1" and exporter.port > 0
    built = xspec.LLM(model="qwen3_tiny", spec="oracle", platform="cpu")._built  # gamma 3
    exporter.follow(built.engine)
    w = WorkloadConfig(prompts=["ab", "cde"], num_requests=2, max_new_tokens=9, repeats=2)
    runs = run_workload(
        built, w, SamplingConfig(), io.StringIO(),
        on_run=lambda gens: exporter.observe(gens, "qwen3_tiny", "oracle"),
    )  # fmt: skip
    m = scrape(exporter.url)
    result = job_results(built, w, runs, "qwen3_tiny")
    counters = result["spec_decode"]
    assert m["xspec_spec_decode_num_committed_tokens_total"][()] == counters["num_committed_tokens"]
    assert m["xspec_spec_decode_num_draft_tokens_total"][()] == counters["num_draft_tokens"] > 0
    assert (
        m["xspec_spec_decode_num_accepted_tokens_per_pos_total"][(("position", "2"),)]
        == (counters["accepted_per_position"][2])
    )
    job = (("model", "qwen3_tiny"), ("spec", "oracle"))
    assert m["xspec_request_ttft_seconds_count"][job] == 4  # 2 requests x 2 repeats
    ttfts = [r["ttft_ms"] / 1e3 for r in result["requests"]]
    assert m["xspec_request_ttft_seconds_sum"][job] == pytest.approx(sum(ttfts))
    assert m["xspec_request_e2e_seconds_count"][job] == 4
    queues = [r["queue_ms"] / 1e3 for r in result["requests"]]
    assert m["xspec_request_queue_seconds_count"][job] == 4
    assert m["xspec_request_queue_seconds_sum"][job] == pytest.approx(sum(queues))
    assert m["xspec_request_tpot_seconds_count"][job] == 4
    assert m["xspec_request_output_tokens_sum"][job] == 4 * 9
    assert m["xspec_request_prompt_tokens_sum"][job] == 2 * (2 + 3)


def test_port_in_use_is_a_clear_error(exporter: MetricsExporter) -> None:
    with pytest.raises(ConfigError, match=rf"metrics.port={exporter.port}: .* already in use"):
        MetricsExporter("127.0.0.1", exporter.port)


def test_cli_port_in_use_exits_2_before_any_job(tmp_path, xspec_cache) -> None:
    from tests.test_cli import RUN, run_cli

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(*RUN, f"metrics.port={port}", cache=xspec_cache, cwd=tmp_path)
    assert r.returncode == 2, r.stderr + r.stdout
    assert "Traceback" not in r.stderr and "already in use" in r.stderr
    assert "TTFT" not in r.stdout and not (tmp_path / "outputs").exists()
