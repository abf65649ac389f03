"""Engine throughput and scheduler overhead on dsv4_tiny (baseline, spec=none).

    python benchmarks/bench_engine.py [--requests 16] [--max-new 32] [--concurrency 1 8] [--reps 3] [--stop]

The same requests (short random prompts, ``--max-new`` tokens each, eos ignored) run at
each concurrency, round-robin over ``--reps`` repeats (medians reported):

* output throughput: generated tokens / wall time of ``Engine.run``; the ratio to the
  first concurrency is the batching speed-up (the issue's target: >= 4x at 8 vs 1);
* scheduler overhead: time in ``Engine.run`` outside ``prefill`` / ``decode_step``
  (admission, the pool, stop checks, bookkeeping) as a fraction of the time inside the
  steps (target: <= 10%), and per engine iteration (one prefill or decode_step call).

Ratios are measured side by side in one run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import xspec
from xspec.engine.engine import Request
from xspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--spec", default="none")
    ap.add_argument(
        "--stop", action="store_true", help="give every request a stop string (never met)"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    engine = xspec.LLM(model="dsv4_tiny", spec=a.spec, platform="cpu").engine
    gen = torch.Generator().manual_seed(0)
    requests = [
        Request(
            torch.randint(3, 500, (a.prompt,), generator=gen).tolist(),
            a.max_new,
            SamplingParams(),
            ignore_eos=True,
            stop=["\x00never"] if a.stop else [],
        )
        for _ in range(a.requests)
    ]
    engine.run(requests[:2], 2)  # warm-up
    tput: dict[int, list[float]] = {c: [] for c in a.concurrency}
    over: dict[int, list[float]] = {c: [] for c in a.concurrency}
    per_iter: dict[int, list[float]] = {c: [] for c in a.concurrency}
    for _ in range(a.reps):
        for c in a.concurrency:
            gens = engine.run(requests, c)
            tokens = sum(len(g.token_ids) for g in gens)
            tput[c].append(tokens / engine.run_s)
            outside = engine.run_s - engine.step_s  # bookkeeping outside the steps
            over[c].append(outside / engine.step_s)
            per_iter[c].append(outside / engine.iterations)
    base = statistics.median(tput[a.concurrency[0]])
    print(
        f"dsv4_tiny spec={a.spec}: {a.requests} requests x {a.max_new} new tokens, prompt "
        f"{a.prompt}{', a stop string each' if a.stop else ''}"
    )
    print(
        f"{'concurrency':>11} {'tok/s':>9} {'vs c=' + str(a.concurrency[0]):>8} {'overhead/step time':>19} {'per iteration':>14}"
    )
    for c in a.concurrency:
        t = statistics.median(tput[c])
        o = statistics.median(over[c])
        p = statistics.median(per_iter[c])
        print(f"{c:>11} {t:>9.1f} {t / base:>7.2f}x {o:>19.2%} {p * 1e3:>12.3f}ms")


if __name__ == "__main__":
    main()
