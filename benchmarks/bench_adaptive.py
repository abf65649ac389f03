"""Adaptive verification (``spec.adaptive=true``) against fixed gamma, side by side.

    python benchmarks/bench_adaptive.py [--concurrency 1 8 32] [--requests 64] [--max-new 64]
        [--gamma 5] [--reps 3] [key=value ...]      # e.g. model=dsv4_tiny spec=dspark

One build (``spec.adaptive=true`` plus the overrides, default ``model=dsv4_tiny
spec=dspark``); the same engine runs each configuration with the scheduler on
(adaptive) and off (every request verifies its gamma drafts), interleaved: per repeat
and concurrency, fixed and adaptive alternate which goes first. The requests are the
workload's (``workload.*`` overrides; eos ignored so both modes generate the same
number of tokens). Medians over ``--reps``:

* output throughput (generated tokens / wall time of ``Engine.run``) and its ratio
  adaptive / fixed (the issue's target: never below 0.97, above 1 at high concurrency);
* target rows per request-step (anchor + verified drafts), wasted target rows per decode
  step (verified drafts that were rejected), acceptance, committed tokens per
  request-step; for adaptive the predicted vs realised acceptance of what it verified.

The step-cost profile is measured (or reused) at build time and is not in any figure.
Greedy outputs of both modes are compared with each other (they must be equal).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

import xspec
from xspec.engine.step_cost import describe
from xspec.metrics import SpecDecodeMetrics
from xspec.run.report import adaptive_summary
from xspec.run.workloads import load_workload
from xspec.sampling import SamplingParams

MODES = ("fixed", "adaptive")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. model=dsv4_tiny spec=dspark")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    overrides = {"model": "dsv4_tiny", "spec": "dspark"}
    overrides |= dict(o.split("=", 1) for o in a.overrides)
    model, spec = overrides.pop("model"), overrides.pop("spec")
    overrides |= {
        "spec.num_speculative_tokens": str(a.gamma),
        "spec.adaptive.enabled": "true",
        "spec.adaptive.max_requests": str(max(a.concurrency)),
        "workload.num_requests": str(a.requests),
        "workload.max_new_tokens": str(a.max_new),
        "workload.ignore_eos": "true",
    }
    llm = xspec.LLM(model=model, spec=spec, overrides=overrides)
    built, engine = llm._built, llm._built.engine
    assert built.profile is not None
    print(describe(built.profile))
    print(adaptive_summary(built))
    s, w = built.cfg.sampling, built.cfg.workload
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    requests = load_workload(w, built.tokenizer, built.target.vocab_size, params).requests
    schedule = {"fixed": None, "adaptive": engine.schedule}
    engine.run(requests[:2], 2)  # warm-up
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {}
    outputs: dict[tuple[int, str], list[list[int]]] = {}
    for rep in range(a.reps):
        for c in a.concurrency:
            for mode in MODES if rep % 2 == 0 else MODES[::-1]:
                engine.schedule = schedule[mode]
                engine.metrics = SpecDecodeMetrics()
                gens = engine.run(requests, c)
                r = engine.metrics.report()
                tokens = sum(len(g.token_ids) for g in gens)
                rows.setdefault((c, mode), []).append(
                    {
                        "tok_s": tokens / engine.run_s,
                        "target_rows": r.mean_target_rows,
                        "wasted_per_step": r.num_wasted_target_rows / max(r.num_steps, 1),
                        "acceptance": r.acceptance_rate,
                        "tok_step": r.mean_tokens_per_step,
                        "predicted": r.predicted_acceptance_rate,
                    }
                )
                outputs[(c, mode)] = [g.token_ids for g in gens]
    report(built, a, rows, outputs, params)


def report(
    built: Any,
    a: argparse.Namespace,
    rows: dict[tuple[int, str], list[dict[str, Any]]],
    outputs: dict[tuple[int, str], list[list[int]]],
    params: SamplingParams,
) -> None:
    def med(c: int, mode: str, key: str) -> float:
        values = [r[key] for r in rows[(c, mode)] if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    cfg = built.cfg
    print(
        f"\n{cfg.model.arch} ({cfg.model.path or 'preset ' + str(cfg.model.preset)}) "
        f"spec={cfg.spec.method} gamma={built.drafter.gamma} platform={built.platform.name}: "
        f"{a.requests} requests x {a.max_new} new tokens, medians of {a.reps} interleaved reps"
    )
    head = (
        f"{'conc':>4} {'fixed tok/s':>11} {'adapt tok/s':>11} {'ratio':>6} "
        f"{'rows/req-step':>15} {'wasted/step':>13} {'acceptance':>13} {'tok/req-step':>13} "
        f"{'adapt pred/real':>15}"
    )
    print(head)
    for c in a.concurrency:
        f, ad = med(c, "fixed", "tok_s"), med(c, "adaptive", "tok_s")

        def pair(key: str, spec: str, c: int = c) -> str:
            return f"{med(c, 'fixed', key):{spec}}/{med(c, 'adaptive', key):{spec}}"

        print(
            f"{c:>4} {f:>11.1f} {ad:>11.1f} {ad / f:>5.3f}x {pair('target_rows', '.2f'):>15} "
            f"{pair('wasted_per_step', '.2f'):>13} {pair('acceptance', '.3f'):>13} "
            f"{pair('tok_step', '.2f'):>13} "
            f"{med(c, 'adaptive', 'predicted'):.3f}/{med(c, 'adaptive', 'acceptance'):.3f}"
        )
    print("pairs are fixed/adaptive")
    if params.greedy:
        same = all(outputs[(c, "fixed")] == outputs[(c, "adaptive")] for c in a.concurrency)
        print(f"greedy outputs fixed == adaptive: {same}")


if __name__ == "__main__":
    main()
