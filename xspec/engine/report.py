"""The CLI's main job: run a workload and print outputs, timings and acceptance."""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from typing import TextIO

from xspec.build import Built
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation, Request, seeded
from xspec.errors import ConfigError
from xspec.sampling import SamplingParams


@dataclass(frozen=True)
class RunSummary:
    """One run's headline numbers (a row of the multirun comparison table)."""

    label: str
    output_tokens: int
    wall_s: float
    ttft_ms: float
    tpot_ms: float
    acceptance: float | None
    tokens_per_step: float

    @property
    def throughput(self) -> float:
        return self.output_tokens / self.wall_s


def summarize(label: str, built: Built, gens: list[Generation]) -> RunSummary:
    rep = built.engine.metrics.report()
    return RunSummary(
        label=label,
        output_tokens=sum(len(g.token_ids) for g in gens),
        wall_s=max(g.latency_s for g in gens),
        ttft_ms=statistics.mean(g.ttft_s for g in gens) * 1e3,
        tpot_ms=statistics.mean(g.tpot_s for g in gens) * 1e3,
        acceptance=rep.acceptance_rate if built.drafter.gamma > 0 else None,
        tokens_per_step=rep.mean_tokens_per_step,
    )


def comparison_table(rows: list[RunSummary]) -> str:
    """Runs side by side; ratios relative to the first run (measured in the same process)."""
    head = f"{'run':<40} {'tok/s':>8} {'TTFT ms':>8} {'TPOT ms':>8} {'accept':>7} {'tok/step':>8} {'TPOT vs first':>13}"
    lines = [head, "-" * len(head)]
    for r in rows:
        acc = f"{r.acceptance:.3f}" if r.acceptance is not None else "-"
        ratio = r.tpot_ms / rows[0].tpot_ms if rows[0].tpot_ms else float("nan")
        lines.append(
            f"{r.label:<40} {r.throughput:>8.1f} {r.ttft_ms:>8.1f} {r.tpot_ms:>8.2f} {acc:>7} "
            f"{r.tokens_per_step:>8.3f} {ratio:>13.3f}"
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
    built: Built, w: WorkloadConfig, s: SamplingConfig, out: TextIO = sys.stdout
) -> list[Generation]:
    if problems := workload_problems(w):
        raise ConfigError("cannot run the workload:", problems=problems)
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    texts = [w.prompts[i % len(w.prompts)] for i in range(w.num_requests)]
    requests = [
        Request(built.tokenizer.encode(t), w.max_new_tokens, seeded(params, i), w.ignore_eos)
        for i, t in enumerate(texts)
    ]
    gens = built.engine.run(requests, w.concurrency)
    for g in gens:
        g.text = built.tokenizer.decode(g.token_ids)
    cfg = built.cfg
    print(
        f"xspec: model={cfg.model.arch} ({cfg.model.path or cfg.model.preset}) spec={cfg.spec.method} "
        f"gamma={built.drafter.gamma} platform={built.platform.name} device={built.platform.device()}",
        file=out,
    )
    if w.print_outputs:
        for i, (t, g) in enumerate(zip(texts, gens)):
            print(f"[{i}] {t!r} -> {g.text!r}", file=out)
    print(format_timings(gens), file=out)
    if built.drafter.gamma > 0:
        print(built.engine.metrics.report().format(), file=out)
    return gens


def format_timings(gens: list[Generation]) -> str:
    tokens = sum(len(g.token_ids) for g in gens)
    wall = max(g.latency_s for g in gens)
    ttft = statistics.mean(g.ttft_s for g in gens) * 1e3
    tpot = statistics.mean(g.tpot_s for g in gens) * 1e3
    return (
        f"requests={len(gens)} output_tokens={tokens} wall={wall:.3f}s\n"
        f"TTFT mean={ttft:.1f} ms  TPOT mean={tpot:.2f} ms  throughput={tokens / wall:.1f} tok/s"
    )
