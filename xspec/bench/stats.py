"""Figures of a serving benchmark: percentiles, goodput, speculative acceptance and the
result dict, whose keys follow ``vllm bench serve --save-result`` so the JSON files of
both tools can be read by the same scripts.

Times are kept in seconds per request (:class:`RequestOutcome`) and reported in
milliseconds (``*_ms`` keys), as vLLM does. A figure with no sample (every output one
token long, so no TPOT) is ``None`` (JSON ``null``), never a made-up zero.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from xspec.acceptance import acceptance_length

# the figures a percentile table is built for: key stem -> (long name, short name)
METRICS: dict[str, tuple[str, str]] = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency (per chunk)", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class SpecCounts:
    """Speculative decoding counts of one response (or their sum over many).

    ``drafts``: verify steps that checked a draft; ``draft_tokens``: tokens proposed;
    ``accepted``: proposed tokens the target kept. ``draft_tokens`` is ``None`` when the
    server reports only steps (SGLang's ``spec_verify_ct``)."""

    drafts: int = 0
    draft_tokens: int | None = 0
    accepted: int = 0

    def __add__(self, other: SpecCounts) -> SpecCounts:
        tokens = None
        if self.draft_tokens is not None and other.draft_tokens is not None:
            tokens = self.draft_tokens + other.draft_tokens
        return SpecCounts(self.drafts + other.drafts, tokens, self.accepted + other.accepted)


@dataclass
class RequestOutcome:
    """What one request measured. ``ttft``/``e2el`` in seconds from the moment it was sent;
    ``itl``: the gaps between consecutive content chunks (a speculative server may send
    several tokens in one chunk, so these are per chunk, not per token)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float | None = None
    e2el: float | None = None
    itl: list[float] = field(default_factory=list)
    spec: SpecCounts | None = None
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first: (e2el - TTFT) / (tokens - 1)."""
        if not self.success or self.output_tokens < 2:
            return None
        assert self.e2el is not None and self.ttft is not None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks (numpy's
    default, which vLLM uses)."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = q / 100 * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_interval(
    rows: Sequence[Any],
    statistic: Callable[[Sequence[Any]], float],
    level: float = 0.9,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """The percentile bootstrap interval of ``statistic`` at ``level`` (0.9: the 5th and
    95th percentiles of the resampled statistic): ``rows`` drawn with replacement,
    ``resamples`` times, each row whole (a row: whatever was measured together, such as
    every configuration of one repeat, so their pairing survives the resampling). Seeded:
    the same rows give the same interval."""
    if not rows:
        raise ValueError("bootstrap interval of no rows")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    rng = random.Random(seed)
    n = len(rows)
    stats = [statistic([rows[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples)]
    tail = (1 - level) / 2 * 100
    return percentile(stats, tail), percentile(stats, 100 - tail)


def describe(values_s: Sequence[float], stem: str, percentiles: Sequence[float]) -> dict:
    """mean/median/std and the requested percentiles of ``values_s`` (seconds), in ms."""
    pct_keys = [f"p{q:g}_{stem}_ms" for q in percentiles]
    if not values_s:
        keys = [f"mean_{stem}_ms", f"median_{stem}_ms", f"std_{stem}_ms", *pct_keys]
        return dict.fromkeys(keys)
    ms = [v * 1000 for v in values_s]
    mean = sum(ms) / len(ms)
    out = {
        f"mean_{stem}_ms": mean,
        f"median_{stem}_ms": percentile(ms, 50),
        f"std_{stem}_ms": math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms)),  # ddof 0
    }
    out.update({k: percentile(ms, q) for k, q in zip(pct_keys, percentiles)})
    return out


def meets_slos(outcome: RequestOutcome, slos_ms: dict[str, float]) -> bool:
    """A successful request is good when each given SLO holds (TPOT only where defined)."""
    if not outcome.success:
        return False
    values = {"ttft": outcome.ttft, "tpot": outcome.tpot, "e2el": outcome.e2el}
    for name, limit in slos_ms.items():
        v = values[name]
        if v is not None and v * 1000 > limit:
            return False
    return True


def acceptance(counts: SpecCounts | None) -> dict[str, Any]:
    """Acceptance rate (accepted / proposed) and acceptance length (tokens a verify step
    commits: accepted + 1 per step, the vLLM/SGLang definition); ``None`` when unknown."""
    rate = length = None
    if counts is not None and counts.drafts > 0:
        length = acceptance_length(counts.accepted, counts.drafts)  # as /metrics defines it
        if counts.draft_tokens:
            rate = counts.accepted / counts.draft_tokens
    return {
        "spec_acceptance_rate": rate,
        "spec_acceptance_length": length,
        "spec_num_drafts": counts.drafts if counts else None,
        "spec_num_draft_tokens": counts.draft_tokens if counts else None,
        "spec_num_accepted_tokens": counts.accepted if counts else None,
    }


def summarize(
    outcomes: Sequence[RequestOutcome],
    duration: float,
    slos_ms: dict[str, float],
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    """The figures of one run (``duration``: seconds from the first send to the last byte)."""
    ok = [o for o in outcomes if o.success]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    good = sum(meets_slos(o, slos_ms) for o in ok) if slos_ms else None
    # acceptance only when every successful response carried the counts
    spec = None
    if ok and all(o.spec is not None for o in ok):
        spec = sum((o.spec for o in ok if o.spec is not None), SpecCounts())
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": None if good is None else per_s(good),
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
    }
    result["goodput"] = result["request_goodput"]
    samples = {
        "ttft": [o.ttft for o in ok if o.ttft is not None],
        "tpot": [t for o in ok if (t := o.tpot) is not None],
        "itl": [g for o in ok for g in o.itl],
        "e2el": [o.e2el for o in ok if o.e2el is not None],
    }
    for stem, values in samples.items():
        result.update(describe(values, stem, percentiles))
    result.update(acceptance(spec))
    result.update(
        {
            "input_lens": [o.prompt_len for o in outcomes],
            "output_lens": [o.output_tokens for o in outcomes],
            "ttfts": [o.ttft for o in outcomes],
            "itls": [o.itl for o in outcomes],
            "errors": [o.error for o in outcomes],
        }
    )
    return result


def format_report(result: dict[str, Any], percentiles: Sequence[float] = (50, 90, 99)) -> str:
    """The human table printed after a run (the layout of ``vllm bench serve``)."""

    def num(v: Any, fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    rows: list[str] = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, v: Any, fmt: str = ".2f") -> None:
        rows.append(f"{name:<40}{v if isinstance(v, str) else num(v, fmt)}")

    row("Successful requests:", result["completed"], "d")
    row("Failed requests:", result["failed"], "d")
    row("Maximum request concurrency:", result.get("max_concurrency") or "none", "d")
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"], "d")
    row("Total generated tokens:", result["total_output_tokens"], "d")
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    row("Spec acceptance rate:", result.get("spec_acceptance_rate"), ".3f")
    row("Spec acceptance length:", result.get("spec_acceptance_length"), ".3f")
    for stem, (long, short) in METRICS.items():
        rows.append("{s:{c}^50}".format(s=long, c="-"))
        row(f"Mean {short} (ms):", result.get(f"mean_{stem}_ms"))
        row(f"Median {short} (ms):", result.get(f"median_{stem}_ms"))
        for q in (q for q in percentiles if q != 50):  # p50 is the median above
            row(f"P{q:g} {short} (ms):", result.get(f"p{q:g}_{stem}_ms"))
    rows.append("=" * 50)
    first_error = next((e for e in result.get("errors", []) if e), None)
    if first_error:
        rows.append(f"first error: {first_error}")
    return "\n".join(rows)
