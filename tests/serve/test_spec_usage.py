"""A request's ``usage.spec_decode`` counts as the Prometheus counters do: for one request
at a time, its figures equal the counters' increase over that request, also when some of
its steps drafted nothing (a row with one token left drafts none: not a draft)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from tests.serve.conftest import LiveServer
from xspec.acceptance import acceptance_length
from xspec.bench.__main__ import main as bench_main

SERVERS = [("dsv4_tiny", spec, {"model.dtype": "float32"}) for spec in ("mtp", "dspark")]
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def scrape(live: LiveServer) -> dict[str, float]:
    """The speculative counters of /metrics, and the request-steps that drafted nothing."""
    text = httpx.get(live.url + "/metrics").text
    out = {}
    for name in COUNTERS:
        m = re.search(rf"^xspec_spec_decode_{name}_total (\S+)$", text, re.M)
        assert m, name
        out[name] = float(m.group(1))
    m = re.search(r'^xspec_spec_decode_speculation_depth_total\{depth="0"\} (\S+)$', text, re.M)
    out["depth0"] = float(m.group(1)) if m else 0.0
    return out


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_usage_equals_the_metrics_delta_of_the_request(served: LiveServer) -> None:
    client = served.openai()
    undrafted = 0
    for max_tokens in (7, 8, 9, 10, 11, 12, 13):
        before = scrape(served)
        r = client.completions.create(
            model=served.name, prompt="def fibonacci(n):\n", max_tokens=max_tokens,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        after = scrape(served)
        usage = r.usage.model_extra["spec_decode"]
        delta = {k: after[k] - before[k] for k in after}
        assert {k: usage[k] for k in COUNTERS} == {k: delta[k] for k in COUNTERS}, max_tokens
        assert usage["acceptance_length"] == acceptance_length(
            int(delta["num_accepted_tokens"]), int(delta["num_drafts"])
        )
        undrafted += int(delta["depth0"])
    assert undrafted > 0  # the case that was miscounted: steps that drafted nothing


@pytest.mark.parametrize("served", SERVERS[1:], indirect=True, ids=lambda s: s[1])
def test_bench_serve_acceptance_equals_metrics(served: LiveServer, tmp_path: Path) -> None:
    """``python -m xspec.bench serve`` sums the usage blocks: its acceptance over a run
    equals the counters' increase over that run; its prompts are --input-len tokens."""
    out = tmp_path / "r.json"
    before = scrape(served)
    argv = ["serve", "--base-url", served.url, "--num-prompts", "6", "--input-len", "24",
            "--output-len", "12", "--ignore-eos", "--max-concurrency", "3",
            "--result-file", str(out)]  # fmt: skip
    assert bench_main(argv) == 0
    after = scrape(served)
    r = json.loads(out.read_text())
    delta = {k: int(after[k] - before[k]) for k in COUNTERS}
    assert (r["spec_num_drafts"], r["spec_num_draft_tokens"], r["spec_num_accepted_tokens"]) == (
        delta["num_drafts"],
        delta["num_draft_tokens"],
        delta["num_accepted_tokens"],
    )
    want = acceptance_length(delta["num_accepted_tokens"], delta["num_drafts"])
    assert r["spec_acceptance_length"] == want
    assert all(n in (23, 24) for n in r["input_lens"]) and 24 in r["input_lens"]
