"""``spec.adaptive`` against fixed-gamma DSpark and ``spec=none`` in one process: the
decision's own effect, without the per-process floor of bench_adaptive.py.

    python benchmarks/bench_adaptive_paired.py [--concurrency 1 4 16] [--temperatures 0 0.8]
        [--seeds 8] [--first-seed 200] [--max-new 48] [--gamma 5] [key=value ...]

bench_adaptive.py runs every configuration in its own process, as the issue asks, and
a process's speed differs from another's by a few percent for its whole life, whatever
it runs: at one request, greedy, stepped in turns, fixed gamma with a gamma schedule
that never binds (the same work as fixed gamma) ran at 0.98-1.03x fixed gamma's, repeat
by repeat. That floor is as wide as the margin its bar resolves (0.97). Here one DSpark
engine (one copy of the weights) runs both fixed gamma (no decision object at all) and
adaptive (a fresh :meth:`~xspec.spec.adaptive.Speculation.fresh` decision for every
measurement: a warm-up run of the workload, then the measured run, as a child of
bench_adaptive.py), so their ratio moves only with the decision and its work.
``spec=none`` is a second engine in the same process, with its own copy of the weights:
its ratio to the others keeps part of the floor (a copy placed elsewhere in memory runs a
few percent faster or slower).

Per cell and seed (``sampling.seed``) the three run back to back, in an order reversed
every seed. Printed per cell: the median tok/s of each, adaptive / fixed and adaptive /
best (the better of fixed and none) as the ratio of medians and the mean of the per-seed
ratios, and each one's decode steps and steps without drafts (means).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from bench_adaptive import PROMPTS, overrides_for  # (the script's folder is on sys.path)

ORDER = ("fixed", "adaptive", "none")


def measure(built: Any, decision: Any, seed: int) -> dict[str, float]:
    """Warm-up run then the measured run of the workload with ``decision`` as the
    engine's per-step decision (None: fixed gamma, or spec=none's engine)."""
    from xspec.metrics import SpecDecodeMetrics
    from xspec.run.workloads import load_workload
    from xspec.sampling import SamplingParams

    engine, s, w = built.engine, built.cfg.sampling, built.cfg.workload
    engine.speculation = decision
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=seed)
    requests = load_workload(w, built.tokenizer, built.target.vocab_size, params).requests
    engine.run(requests, w.concurrency)
    engine.metrics = SpecDecodeMetrics()
    gens = engine.run(requests, w.concurrency)
    r = engine.metrics.report()
    return {
        "tok_s": sum(len(g.token_ids) for g in gens) / engine.run_s,
        "steps": r.num_steps,
        "plain": r.num_steps_without_drafts,
    }


def cell(a: argparse.Namespace, t: float, c: int) -> dict[str, list[dict[str, float]]]:
    import xspec

    def build(config: str) -> Any:
        o = overrides_for(config, a, t, c)
        if config == "adaptive":  # the profile bench_adaptive.py's sweep builds (cached)
            o["spec.adaptive.max_requests"] = str(a.max_requests)
        model, method = o.pop("model"), o.pop("spec")
        return xspec.LLM(model=model, spec=method, overrides=o)._built

    dspark, none = build("adaptive"), build("none")
    decision = dspark.engine.speculation
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in ORDER}
    for i, seed in enumerate(range(a.first_seed, a.first_seed + a.seeds)):
        for config in ORDER if i % 2 == 0 else ORDER[::-1]:
            if config == "none":
                runs[config].append(measure(none, None, seed))
            else:
                fresh = decision.fresh() if config == "adaptive" else None
                runs[config].append(measure(dspark, fresh, seed))
    return runs


def report(t: float, c: int, runs: dict[str, list[dict[str, float]]]) -> str:
    tok = {k: [r["tok_s"] for r in v] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in tok.items()}
    best = [max(f, n) for f, n in zip(tok["fixed"], tok["none"])]
    vs_fixed = statistics.mean(x / f for x, f in zip(tok["adaptive"], tok["fixed"]))
    vs_best = statistics.mean(x / b for x, b in zip(tok["adaptive"], best))
    mode = "greedy" if t == 0 else f"T={t:g}"
    steps = ", ".join(
        f"{k} {statistics.mean(r['steps'] for r in v):.1f}/"
        f"{statistics.mean(r['plain'] for r in v):.1f}"
        for k, v in runs.items()
    )
    return (
        f"| {mode} | {c} | {med['none']:.0f} | {med['fixed']:.0f} | {med['adaptive']:.0f} | "
        f"{med['adaptive'] / med['fixed']:.3f} / {vs_fixed:.3f} | "
        f"{med['adaptive'] / max(med['fixed'], med['none']):.3f} / {vs_best:.3f} | {steps} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first-seed", type=int, default=200)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--prompts", type=Path, default=PROMPTS)
    ap.add_argument(
        "--max-requests", type=int, default=32, help="spec.adaptive.max_requests (the profile)"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("overrides", nargs="*", help="key=value, e.g. model=dsv4_tiny")
    a = ap.parse_args()
    a.schedule = None  # (overrides_for reads it for the schedule configuration only)

    import torch

    torch.set_num_threads(a.threads)
    print(
        f"| mode | concurrency | none tok/s | fixed tok/s | adaptive tok/s | adaptive / fixed "
        f"| adaptive / best | steps / without drafts |  ({a.seeds} seeds from {a.first_seed}, "
        f"{a.max_new} new tokens, gamma {a.gamma}; ratios: of medians / mean per seed)\n"
        "|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    for t in a.temperatures:
        for c in a.concurrency:
            print(report(t, c, cell(a, t, c)), flush=True)


if __name__ == "__main__":
    main()
