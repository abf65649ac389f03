"""What logprobs and the logits processors cost under speculation: tokens per decode step
and TPOT of the same workload with ``logprobs``, with penalties (presence, frequency,
repetition, logit_bias, min_tokens) and with both, against neither, in one process.

    python benchmarks/bench_sampling.py [--spec mtp dspark] [--concurrency 4] [--requests 8]
        [--max-new 64] [--reps 3] [--temperature 0] [key=value ...]   # e.g. model=dsv4_tiny

Each spec method is built once; the settings of a repeat run back to back in a rotated
order (a slow spell of a shared machine falls on all of them), every request generating
``--max-new`` tokens (EOS ignored). Printed per method and setting: median TPOT (ms),
tokens per decode step (committed tokens after the first / decode steps, per request
summed), and both as ratios to the plain setting. Penalties change the text, so they
change acceptance: the tokens-per-step ratio is that effect, the TPOT ratio the sum of it
and of the processors' own time.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import xspec

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self",
    "The quick brown fox",
]
PENALTIES: dict[str, Any] = dict(
    presence_penalty=0.3,
    frequency_penalty=0.3,
    repetition_penalty=1.1,
    logit_bias={32: 1.0},
    min_tokens=8,
)
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": PENALTIES,
    "both": {**PENALTIES, "logprobs": 5},
}


def run(llm: xspec.LLM, args: argparse.Namespace, kw: dict[str, Any]) -> tuple[float, float]:
    """One run of the workload: (median TPOT in s, tokens per decode step)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    gens = llm.generate(
        prompts,
        args.max_new,
        temperature=args.temperature,
        ignore_eos=True,
        concurrency=args.concurrency,
        **kw,
    )
    tpot = statistics.median(g.tpot_s for g in gens if g.tpot_s is not None)
    per_step = sum(len(g.token_ids) - 1 for g in gens) / sum(g.num_steps for g in gens)
    return tpot, per_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", nargs="+", default=["mtp", "dspark"])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    args, overrides = ap.parse_known_args()
    cfg = dict(o.split("=", 1) for o in overrides)
    model = cfg.pop("model", "dsv4_tiny")
    platform = cfg.pop("platform", "auto")
    print(f"model={model} T={args.temperature} concurrency={args.concurrency} "
          f"requests={args.requests} max_new={args.max_new} reps={args.reps}")  # fmt: skip
    print(
        f"{'spec':8} {'setting':12} {'TPOT ms':>8} {'tok/step':>8} {'TPOT x':>7} {'tok/step x':>10}"
    )
    for spec in args.spec:
        llm = xspec.LLM(model=model, spec=spec, platform=platform, overrides=cfg)
        run(llm, args, {})  # warm-up
        results: dict[str, list[tuple[float, float]]] = {name: [] for name in SETTINGS}
        names = list(SETTINGS)
        for rep in range(args.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                results[name].append(run(llm, args, SETTINGS[name]))
        base_t = statistics.median(t for t, _ in results["plain"])
        base_s = statistics.median(s for _, s in results["plain"])
        for name, runs in results.items():
            t = statistics.median(x for x, _ in runs)
            s = statistics.median(y for _, y in runs)
            print(
                f"{spec:8} {name:12} {t * 1e3:8.2f} {s:8.2f} {t / base_t:7.3f} {s / base_s:10.3f}"
            )


if __name__ == "__main__":
    main()
