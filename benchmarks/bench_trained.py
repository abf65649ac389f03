"""Speculation on the trained tiny model: spec=none / mtp / dspark side by side.

    python benchmarks/bench_trained.py [--prompts 8] [--max-new 96] [--concurrency 1 8] [--reps 3] [--hf]

Held-out prompts (Python standard library files the model never trained on) run at each
concurrency and sampling setting (greedy; temperature 0.8), every method round-robin
over ``--reps`` repeats so machine noise hits them alike (medians reported):

* committed tokens per step, acceptance rate, per-position survival (DSpark, MTP);
* TPOT (mean time per output token after the first) and its speed-up over spec=none;
* ``--hf``: transformers' own ``generate`` on the same weights (greedy, batch = the
  concurrency), the same prompts and token budget, for the speed-up against it.

Nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import xspec
from xspec.train import corpus

METHODS = ("none", "mtp", "dspark")


def heldout_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = corpus.prompts(corpus.source_files(split="heldout"), count, seed=123)
    return [tokenizer.encode(t) for t in texts]


def run_once(llm: xspec.LLM, prompts, a, temperature: float, concurrency: int):
    llm.reset_metrics()
    t = time.perf_counter()
    out = llm.generate(
        prompts,
        max_new_tokens=a.max_new,
        temperature=temperature,
        ignore_eos=True,
        concurrency=concurrency,
        seed=0,
    )
    wall = time.perf_counter() - t
    tpot = statistics.mean(g.tpot_s for g in out if g.tpot_s is not None)
    tokens = sum(len(g.token_ids) for g in out)
    return {"tpot": tpot, "throughput": tokens / wall, "report": llm.metrics.report(), "out": out}


def hf_tpot(path, prompts, a, concurrency: int, reps: int) -> float:
    """Greedy transformers generate, batches of ``concurrency`` equal-length prompts:
    (wall - first-token time) / (new tokens - 1), median over reps."""
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n = min(len(p) for p in prompts)
    ids = torch.tensor([p[-n:] for p in prompts])  # left-trimmed to one length: no padding
    times = []
    for _ in range(reps):
        total = 0.0
        for batch in ids.split(concurrency):
            kw = dict(attention_mask=torch.ones_like(batch), do_sample=False)
            with torch.no_grad():
                t = time.perf_counter()
                hf.generate(batch, max_new_tokens=1, min_new_tokens=1, **kw)
                first = time.perf_counter() - t
                t = time.perf_counter()
                hf.generate(batch, max_new_tokens=a.max_new, min_new_tokens=a.max_new, **kw)
                total += (time.perf_counter() - t - first) / (a.max_new - 1)
        times.append(total / len(ids.split(concurrency)))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate")
    a = ap.parse_args()
    torch.set_num_threads(1)
    llms = {m: xspec.LLM(model="dsv4_tiny", spec=m, platform="cpu") for m in METHODS}
    prompts = heldout_prompts(llms["none"].tokenizer, a.prompts)
    print(
        f"trained dsv4_tiny, {len(prompts)} held-out prompts ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens), {a.max_new} new tokens each, float32 CPU, 1 thread, "
        f"median of {a.reps}"
    )
    for temperature in a.temperatures:
        for conc in a.concurrency:
            runs: dict[str, list] = {m: [] for m in METHODS}
            for m in METHODS:  # warm-up
                run_once(llms[m], prompts[:1], a, temperature, 1)
            for _ in range(a.reps):
                for m in METHODS:
                    runs[m].append(run_once(llms[m], prompts, a, temperature, conc))
            tpot = {m: statistics.median(r["tpot"] for r in runs[m]) for m in METHODS}
            thr = {m: statistics.median(r["throughput"] for r in runs[m]) for m in METHODS}
            mode = "greedy" if temperature == 0 else f"T={temperature}"
            print(f"\n== {mode}, concurrency {conc}")
            print(
                f"{'method':8} {'TPOT ms':>8} {'speed-up':>9} {'tok/s':>7} {'tok/step':>9} {'accept':>7}  survival per position"
            )
            for m in METHODS:
                rep = runs[m][-1]["report"]
                surv = " ".join(f"{s:.2f}" for s in rep.survival)
                print(
                    f"{m:8} {tpot[m] * 1e3:8.2f} {tpot['none'] / tpot[m]:8.2f}x {thr[m]:7.1f} "
                    f"{rep.mean_tokens_per_step if m != 'none' else 1.0:9.2f} "
                    f"{rep.acceptance_rate:7.3f}  {surv}"
                )
            if temperature == 0:
                same = all(
                    r["out"][i].token_ids == runs["none"][0]["out"][i].token_ids
                    for m in METHODS
                    for r in runs[m]
                    for i in range(len(prompts))
                )
                print(f"greedy outputs identical across methods: {same}")
            if a.hf and temperature == 0:
                path = llms["none"].built.target.checkpoint_dir
                hf = hf_tpot(path, prompts, a, conc, max(1, a.reps // 2))
                print(
                    f"transformers generate TPOT {hf * 1e3:.2f} ms: dspark {hf / tpot['dspark']:.2f}x, "
                    f"mtp {hf / tpot['mtp']:.2f}x, none {hf / tpot['none']:.2f}x faster"
                )


if __name__ == "__main__":
    main()
