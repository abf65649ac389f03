"""A request's ``usage.spec_decode`` counts as the Prometheus counters do: for one request
at a time, its figures equal the counters' increase over that request, also when some of
its steps drafted nothing (a row with one token left drafts none: not a draft)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.serve.conftest import LiveServer
from xspec.acceptance import acceptance_length

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
