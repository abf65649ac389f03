"""The CLI's main job: run a workload and print outputs, timings and acceptance.

Timing rules (what the figures mean):

* warm-up: ``workload.warmup_requests`` short requests run first, unmeasured; the
  acceptance metrics are reset after them;
* TTFT: mean over requests; TPOT: mean over requests with at least two output tokens
  (the common serving-benchmark rule: a one-token request has no time *per output
  token*, it is left out rather than counted as 0); no such request -> n/a;
* ``workload.repeats = N``: the measured workload runs N times in the same process; each
  figure is reported as ``median ±s`` with ``s`` = half the min-max range of the N runs
  (:func:`spread`); ratios between runs use the medians.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

from xspec.build import Built
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation, Request, seeded
from xspec.errors import ConfigError
from xspec.metrics import SpecDecodeMetrics
from xspec.sampling import SamplingParams

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

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s


def timings(gens: list[Generation]) -> RunTimings:
    tpots = [g.tpot_s for g in gens if g.tpot_s is not None]
    return RunTimings(
        output_tokens=sum(len(g.token_ids) for g in gens),
        wall_s=max(g.latency_s for g in gens),
        ttft_ms=statistics.mean(g.ttft_s for g in gens) * 1e3,
        tpot_ms=statistics.mean(tpots) * 1e3 if tpots else None,
    )


@dataclass(frozen=True)
class RunSummary:
    """One job's headline numbers over its repeats (a row of the comparison table)."""

    label: str
    runs: list[RunTimings]
    acceptance: float | None  # over every measured run
    tokens_per_step: float

    @property
    def throughput(self) -> Spread:
        return spread([r.throughput for r in self.runs])  # type: ignore[return-value]

    @property
    def ttft_ms(self) -> Spread:
        return spread([r.ttft_ms for r in self.runs])  # type: ignore[return-value]

    @property
    def tpot_ms(self) -> Spread | None:
        return spread([r.tpot_ms for r in self.runs])


def summarize(label: str, built: Built, runs: list[list[Generation]]) -> RunSummary:
    rep = built.engine.metrics.report()
    return RunSummary(
        label=label,
        runs=[timings(gens) for gens in runs],
        acceptance=rep.acceptance_rate if built.drafter.gamma > 0 else None,
        tokens_per_step=rep.mean_tokens_per_step,
    )


def _cell(value: Spread | None, spec: str, width: int) -> str:
    return f"{value.format(spec) if value is not None else 'n/a':>{width}}"


def comparison_table(rows: list[RunSummary]) -> str:
    """Runs side by side; ratios relative to the first run (measured in the same process)."""
    repeats = sorted({len(r.runs) for r in rows})
    note = (
        f"figures: median ±half the min-max range over {'/'.join(map(str, repeats))} repeat(s); "
        "TPOT over requests with >= 2 output tokens; ratio of medians"
    )
    head = (
        f"{'run':<40} {'tok/s':>14} {'TTFT ms':>14} {'TPOT ms':>14} {'accept':>7} "
        f"{'tok/step':>8} {'TPOT vs first':>13}"
    )
    lines = [note, head, "-" * len(head)]
    first = rows[0].tpot_ms
    for r in rows:
        acc = f"{r.acceptance:.3f}" if r.acceptance is not None else "-"
        tpot = r.tpot_ms
        ratio = (
            f"{tpot.median / first.median:.3f}"
            if tpot is not None and first is not None and first.median
            else "n/a"
        )
        lines.append(
            f"{r.label:<40} {_cell(r.throughput, '.1f', 14)} {_cell(r.ttft_ms, '.1f', 14)} "
            f"{_cell(tpot, '.2f', 14)} {acc:>7} {r.tokens_per_step:>8.3f} {ratio:>13}"
        )
    return "\n".join(lines)


def workload_problems(w: WorkloadConfig) -> list[str]:
    """What the CLI's main job cannot run with (checked before any job starts)."""
    problems = []
    if not w.prompts:
        problems.append(
            "workload.prompts is empty; give at least one prompt, e.g. 'workload.prompts=[Hello]'"
        )
    return problems


def run_workload(
    built: Built,
    w: WorkloadConfig,
    s: SamplingConfig,
    out: TextIO = sys.stdout,
    model_option: str | None = None,  # the model=<option> the user picked (e.g. dsv4_tiny)
) -> list[list[Generation]]:
    """Warm up, then run the workload ``w.repeats`` times; the generations of each run."""
    if problems := workload_problems(w):
        raise ConfigError("cannot run the workload:", problems=problems)
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    texts = [w.prompts[i % len(w.prompts)] for i in range(w.num_requests)]
    requests = [
        Request(
            built.tokenizer.encode(t),
            w.max_new_tokens,
            seeded(params, i),
            w.ignore_eos,
            list(w.stop),
        )
        for i, t in enumerate(texts)
    ]
    warmup(built, requests, w)
    runs = [built.engine.run(requests, w.concurrency) for _ in range(w.repeats)]
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
        f"gamma={built.drafter.gamma} platform={built.platform.name} device={built.platform.device()}",
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
    return runs


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
    built.engine.metrics = SpecDecodeMetrics()


def format_timings(gens: list[Generation]) -> str:
    t = timings(gens)
    tpot = f"{t.tpot_ms:.2f} ms" if t.tpot_ms is not None else "n/a (no request with 2+ tokens)"
    return (
        f"requests={len(gens)} output_tokens={t.output_tokens} wall={t.wall_s:.3f}s\n"
        f"TTFT mean={t.ttft_ms:.1f} ms  TPOT mean={tpot}  throughput={t.throughput:.1f} tok/s"
    )
