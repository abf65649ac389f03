"""The CLI's main job: run a workload and print outputs, timings and acceptance."""

from __future__ import annotations

import statistics
import sys
from typing import TextIO

from xspec.build import Built
from xspec.config import SamplingConfig, WorkloadConfig
from xspec.engine.engine import Generation, Request, seeded
from xspec.errors import ConfigError
from xspec.sampling import SamplingParams


def run_workload(
    built: Built, w: WorkloadConfig, s: SamplingConfig, out: TextIO = sys.stdout
) -> list[Generation]:
    if not w.prompts:
        raise ConfigError(
            "workload.prompts is empty; give at least one prompt, e.g. 'workload.prompts=[Hello]'"
        )
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
