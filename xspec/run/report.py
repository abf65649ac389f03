"""The CLI's main job: run a workload and print outputs, timings and acceptance.

Timing rules (what the figures mean):

* warm-up: ``workload.warmup_requests`` short requests run first, unmeasured; the
  acceptance metrics are reset after them;
* TTFT, e2e and TPOT count from a request's admission (a free ``workload.concurrency``
  slot and its memory), the wait before it is its ``queue`` time (docs/metrics.md);
* TTFT: mean over requests; TPOT: mean over requests with at least two output tokens
  (the common serving-benchmark rule: a one-token request has no time *per output
  token*, it is left out rather than counted as 0); no such request -> n/a;
* ``workload.repeats = N``: the measured workload runs N times in the same process; each
  figure is reported as ``median ±s`` with ``s`` = half the min-max range of the N runs
  (:func:`spread`); ratios between runs use the medians.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from xspec.build import Built
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation, Request
from xspec.metrics import SpecDecodeMetrics
from xspec.run.fit import loaded_fit
from xspec.run.workloads import load_workload, shapes

WARMUP_MAX_NEW_TOKENS = 8  # enough for a few speculative steps, short enough to be cheap


@dataclass(frozen=True)
class Spread:
    """A figure over repeated runs: the median and half the min-max range."""

    median: float
    half_range: float

    def format(self, spec: str) -> str:
        return f"{self.median:{spec}} ±{self.half_range:{spec}}"


def spread(values: Sequence[float | None]) -> Spread | None:
    """``median ±(max - min) / 2`` of the values that exist; None when there are none."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return Spread(statistics.median(present), (max(present) - min(present)) / 2)


@dataclass(frozen=True)
class RunTimings:
    """One measured run of the workload."""

    output_tokens: int
    wall_s: float
    ttft_ms: float
    tpot_ms: float | None  # None: no request had two or more output tokens
    e2e_ms: float  # admission to the last token
    queue_ms: float  # arrival (the start of the run) to admission

    @property
    def throughput(self) -> float | None:
        """Output tokens per second; None (n/a) when no token was generated."""
        return self.output_tokens / self.wall_s if self.output_tokens and self.wall_s > 0 else None


def timings(gens: list[Generation]) -> RunTimings:
    ok = served(gens)
    tpots = [g.tpot_s for g in ok if g.tpot_s is not None]
    return RunTimings(
        output_tokens=sum(len(g.token_ids) for g in gens),
        wall_s=max(g.finished_at for g in gens),
        ttft_ms=statistics.mean(g.ttft_s for g in ok) * 1e3,
        tpot_ms=statistics.mean(tpots) * 1e3 if tpots else None,
        e2e_ms=statistics.mean(g.latency_s for g in ok) * 1e3,
        queue_ms=statistics.mean(g.queue_s for g in ok) * 1e3,
    )


def served(gens: list[Generation]) -> list[Generation]:
    """The requests latency figures average over: those that did not fail (a rejected or
    failed request has no meaningful TTFT); all of them if every one failed."""
    return [g for g in gens if g.error is None] or gens


def run_workload(
    built: Built,
    w: WorkloadConfig,
    s: SamplingConfig,
    out: TextIO | None = None,  # None: sys.stdout at call time
    model_option: str | None = None,  # the model=<option> the user picked (e.g. dsv4_tiny)
    on_run: Callable[[list[Generation]], None] = lambda gens: None,  # each measured run
) -> list[list[Generation]]:
    """Warm up, then run the workload ``w.repeats`` times; the generations of each run.
    Under torchrun only rank 0 prints (the other ranks return their own generations)."""
    out = out if out is not None else sys.stdout
    params = s.to_params()
    fit = loaded_fit(built)  # a request the context cannot hold is a user error, not a drop
    work = load_workload(w, built.tokenizer, built.target.vocab_size, params, fit)
    texts, requests = work.texts, work.requests
    warmup(built, requests, w)
    runs = []
    main = built.parallel.topology.is_main
    with progress_bar(built, requests, w.repeats, enabled=out.isatty() and main):
        for _ in range(w.repeats):
            if built.engine.prefix_cache is not None:  # each repeat starts cold, as the first
                built.engine.prefix_cache.clear()
            runs.append(built.engine.run(requests, w.concurrency))
            on_run(runs[-1])
    if not main:  # rank 0 reports every replica's requests
        return runs
    for gens in runs:
        for g in gens:
            g.text = (
                g.text if w.stop else built.tokenizer.decode(g.token_ids)
            )  # stop: cut by the engine
    cfg = built.cfg
    source = cfg.model.path or f"preset {cfg.model.preset}"
    print(
        f"xspec: model={model_option or cfg.model.arch} ({cfg.model.arch}, {source}) "
        f"spec={cfg.spec.method} "
        f"gamma={built.drafter.gamma} platform={built.platform.name} device={built.platform.device()}"
        f" ({built.platform.step_options().summary()})",
        file=out,
    )
    if w.print_outputs:
        for i, (t, g) in enumerate(zip(texts, runs[0])):
            print(f"[{i}] {t!r} -> {g.text!r}", file=out)
    for gens in runs:
        for g in gens:
            if g.error is not None:
                print(f"xspec: {g.error}", file=sys.stderr)  # the request stopped; the others ran
    for k, gens in enumerate(runs):
        prefix = f"[repeat {k + 1}/{len(runs)}] " if len(runs) > 1 else ""
        print(prefix + format_timings(gens), file=out)
    if built.drafter.gamma > 0:
        print(built.engine.metrics.report().format(), file=out)
    if (line := step_time_summary(built)) is not None:
        print(line, file=out)
    if (cache := built.engine.prefix_cache) is not None:
        m = built.engine.metrics
        print(
            f"prefix cache: {m.prefix_hits} of {m.prefix_queries} prompt tokens restored "
            f"(hit rate {m.prefix_hit_rate or 0:.1%}), {len(cache)} blocks held "
            f"({cache.nbytes / 2**20:.1f} MiB), {cache.stats.evicted} evicted",
            file=out,
        )
    return runs


class _ProgressMetrics(SpecDecodeMetrics):
    """The engine's metrics, also advancing a progress bar by each step's committed tokens."""

    def __init__(self, bar: Any) -> None:
        super().__init__()
        self.bar = bar

    def observe_step(self, *args: Any, **kwargs: Any) -> None:
        before = self._num_committed
        super().observe_step(*args, **kwargs)
        self.bar.update(self._num_committed - before)


@contextlib.contextmanager
def progress_bar(
    built: Built, requests: list[Request], repeats: int, *, enabled: bool
) -> Iterator[None]:
    """A tqdm bar (on stderr) over the decode tokens of the measured runs; off unless
    stdout is a terminal. It counts committed tokens through the metrics object, so
    the engine needs no hook."""
    if not enabled:
        yield
        return
    from tqdm import tqdm

    total = repeats * sum(r.max_new_tokens - 1 for r in requests)  # the first comes from prefill
    with tqdm(total=total, unit="tok", desc="decoding", leave=False, file=sys.stderr) as bar:
        built.engine.reset_metrics(_ProgressMetrics(bar))
        yield


def warmup(built: Built, requests: list[Request], w: WorkloadConfig) -> None:
    """``w.warmup_requests`` short generations (not measured), then fresh metrics."""
    if w.warmup_requests == 0:
        return
    short = [
        Request(
            requests[i % len(requests)].prompt_ids,
            min(w.max_new_tokens, WARMUP_MAX_NEW_TOKENS),
            requests[i % len(requests)].params,
            ignore_eos=True,
        )
        for i in range(w.warmup_requests)
    ]
    built.engine.run(short, min(w.concurrency, len(short)))
    built.engine.reset_metrics()


def failed_requests(runs: list[list[Generation]]) -> str | None:
    """One line when requests of the measured runs failed (None when none did): how
    many, and that the figures cover only the others, or that every request failed and
    the run measured nothing (the CLI then exits 1)."""
    gens = [g for run in runs for g in run]
    failed = sum(g.error is not None for g in gens)
    if not failed:
        return None
    if failed == len(gens):
        return (
            f"xspec: error: every one of the {failed} requests failed (the errors are above and "
            "in results.json), so this run measured nothing; exit code 1"
        )
    return (
        f"xspec: warning: {failed} of {len(gens)} requests failed (the errors are above and in "
        f"results.json); the timings are over the {len(gens) - failed} that did not"
    )


def format_timings(gens: list[Generation]) -> str:
    if all(g.error is not None for g in gens):  # nothing was served: no latency to average
        return (
            f"requests={len(gens)} output_tokens={sum(len(g.token_ids) for g in gens)}\n"
            "TTFT, TPOT and throughput n/a: every request failed (the errors are above)"
        )
    t = timings(gens)
    tpot = f"{t.tpot_ms:.2f} ms" if t.tpot_ms is not None else "n/a (no request with 2+ tokens)"
    return (
        f"requests={len(gens)} output_tokens={t.output_tokens} wall={t.wall_s:.3f}s\n"
        f"TTFT mean={t.ttft_ms:.1f} ms  TPOT mean={tpot}  e2e mean={t.e2e_ms:.1f} ms  "
        f"queue mean={t.queue_ms:.1f} ms  throughput={_per_s(t.throughput)}"
    )


def _per_s(throughput: float | None) -> str:
    return f"{throughput:.1f} tok/s" if throughput is not None else "n/a (no output tokens)"


def plan_summary(built: Built) -> str:
    """The start-up memory block, at the workload's longest request (prompt +
    max_new_tokens): text prompts, the prompts file's lines, or synthetic lengths."""
    w = built.cfg.workload
    lengths = [(r.prompt_len or 1, r.max_new_tokens) for r in shapes(w, built.tokenizer.encode)]
    prompt_len, max_new_tokens = max(lengths, key=lambda n: (sum(n), n[0]), default=(1, 1))
    assert built.engine.plan is not None
    text = built.engine.plan.describe(prompt_len, max_new_tokens, w.concurrency)
    text += "\n" + prefix_cache_line(built)
    topo = built.parallel.topology
    if topo.world > 1 and built.expert_bytes:
        mib = [f"{b / 2**20:.1f}" for b in built.expert_bytes]
        text += (
            f"\nparallel: {topo.world} ranks, dp={topo.dp} ep={topo.ep}; routed experts per "
            f"rank {', '.join(mib)} MiB (the plan above is rank 0's)"
        )
    if built.profile is not None:
        text += "\n" + built.profile.describe() + "\n" + adaptive_summary(built)
    return text


def prefix_cache_line(built: Built) -> str:
    """The plan's line about the prefix cache: its share, its block, a block's bytes."""
    cache, plan = built.engine.prefix_cache, built.engine.plan
    if cache is None:
        return "  prefix cache: off"
    assert plan is not None
    return (
        f"  prefix cache: up to {cache.capacity / 2**20:.1f} MiB of it, blocks of "
        f"{cache.block} tokens (at most {plan.block_bytes(cache.block) / 2**20:.2f} MiB each); "
        "it gives way to the requests' reservations"
    )


def adaptive_summary(built: Built) -> str:
    """One line: which confidences the adaptive scheduler reads (and for which regimes)."""
    path = built.drafter.calibration_file
    cal = built.drafter.calibration
    if path is None or cal is None:
        return (
            "adaptive verification: confidences are UNCALIBRATED (no calibration file; fit "
            "one with python -m xspec.train calibrate)"
        )
    regimes = "; ".join(f.fitted_regime() for f in cal.fits())
    return f"adaptive verification: confidences calibrated by {path} (fits: {regimes})"


def step_time_summary(built: Built) -> str | None:
    """After a run with ``spec.adaptive``: the step-cost model's predicted vs measured
    decode-step time, from what the depth policy reports (None without it)."""
    figures = built.engine.policy.summary() or {}
    t = figures.get("step_time")
    if not t or not t["steps"]:
        return None
    relative = ", ".join(f"{k}: {v:.2f}" for k, v in t["relative_cost_drafting"].items())
    noise = ", ".join(f"{k}: {v:.2f}" for k, v in t["step_noise"].items())
    return (
        f"step-cost model: {t['steps']} decode steps, predicted {t['predicted_ms_mean']:.2f} ms "
        f"vs measured {t['measured_ms_mean']:.2f} ms per step (mean abs error "
        f"{t['abs_error_ms_mean']:.2f} ms; measured/profiled lately {t['speed']:.2f}; a "
        f"drafting step's cost relative to a plain one's beyond the profile, per batch size: "
        f"{relative or 'not measured'}; step-to-step noise (log sd) per batch size: "
        f"{noise or 'not measured'}; a switch's cost, of the step switched to: plain "
        f"{t['switch_cost']['plain']:.2f}, drafting {t['switch_cost']['drafting']:.2f}; "
        f"realised/expected tokens of drafting steps "
        f"{figures['yield_check']['yield_factor']:.2f})"
    )
