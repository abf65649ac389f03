"""``n`` choices of one prompt: TTFT with the prompt prefilled once (one engine group,
``LLM.generate(n=...)``) vs the same ``n`` requests submitted apart (each prefills the
prompt: one batched prefill of ``n`` copies), in one process, alternated.

    python benchmarks/bench_choices.py [--prompt 1024] [--n 4] [--max-new 8] [--reps 3]
        [key=value ...]    # e.g. model=dsv4_tiny spec=dspark engine.prefix_cache=false

Each repeat: a fresh prompt of ``--prompt`` random tokens; the grouped and the apart run
each generate ``--max-new`` tokens per choice (eos ignored, T=0.8, choice i seeded seed +
i). TTFT counts from admission (every choice is admitted at once, so it is the prefill).
Medians over ``--reps`` after one warm-up repeat. Also prints the prompt tokens each run
put through the target (``Engine.prompt_tokens_computed``) and whether the outputs agree.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import xspec
from xspec.engine.engine import Request, seeded
from xspec.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    kv = dict(o.split("=", 1) for o in args.overrides)
    model, spec = kv.pop("model", "dsv4_tiny"), kv.pop("spec", "none")
    llm = xspec.LLM(model=model, spec=spec, platform="cpu", overrides=kv)
    engine, n = llm.engine, args.n
    params = SamplingParams(temperature=0.8, seed=0)
    ttft: dict[str, list[float]] = {"grouped": [], "apart": []}
    computed: dict[str, int] = {}
    for rep in range(args.reps + 1):  # the first is a warm-up
        g = torch.Generator().manual_seed(rep)
        prompt = torch.randint(5, 250, (args.prompt,), generator=g).tolist()
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
        grouped = llm.generate(prompt, args.max_new, temperature=0.8, seed=0, ignore_eos=True, n=n)
        computed["grouped"] = engine.prompt_tokens_computed
        if engine.prefix_cache is not None:
            engine.prefix_cache.clear()
        reqs = [Request(prompt, args.max_new, seeded(params, i), ignore_eos=True) for i in range(n)]
        apart = engine.run(reqs, n)
        computed["apart"] = engine.prompt_tokens_computed
        same = [a.token_ids for a in grouped] == [b.token_ids for b in apart]
        print(f"rep {rep}: outputs grouped == apart: {same}", flush=True)
        if rep:
            ttft["grouped"].append(statistics.median(x.ttft_s for x in grouped))
            ttft["apart"].append(statistics.median(x.ttft_s for x in apart))
    med = {k: statistics.median(v) for k, v in ttft.items()}
    print(f"model={model} spec={spec} prompt={args.prompt} n={n} reps={args.reps} {kv}")
    for k, v in med.items():
        print(f"  TTFT {k:8s} {v * 1e3:8.1f} ms   prompt tokens computed {computed[k]}")
    print(f"  TTFT apart / grouped: {med['apart'] / med['grouped']:.2f}x")


if __name__ == "__main__":
    main()
