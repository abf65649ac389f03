"""The prefix cache on a shared system prompt: TTFT of a new turn with the cache on
(its shared prefix restored) vs off (prefilled whole), and what a cold prefill costs with
the cache on (one block per forward, snapshots) vs off, in one process, alternated.

    python benchmarks/bench_prefix_cache.py [--prefix 1536] [--turn 64] [--reps 5]
        [--concurrency 8] [--max-new 32] [key=value ...]    # e.g. model=dsv4_tiny spec=dspark

Each repeat: a fresh shared prefix of ``--prefix`` random tokens (the system prompt) and
two turns that append ``--turn`` tokens of their own to it. Each model serves the first
turn (cold: with the cache on it runs one block per forward and snapshots each boundary)
and then the second (with the cache on, a hit on the whole prefix). One output token for
the first turn, eight for the second (TTFT is the prefill). Medians over ``--reps``
after one warm-up repeat; on and off alternate within a repeat.

``--concurrency N`` (0: skip): then N conversations share one fresh prefix; each model
serves their first turns together (one output token), then their second turns together
(``--max-new`` tokens each, eos ignored): output tokens per second of that run and the
drafter's tokens per step (committed / decode steps), on vs off.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import xspec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--turn", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    kv = dict(o.split("=", 1) for o in args.overrides)
    model, spec = kv.pop("model", "dsv4_tiny"), kv.pop("spec", "none")
    on = xspec.LLM(model=model, spec=spec, platform="cpu", overrides=kv)
    off = xspec.LLM(
        model=model, spec=spec, platform="cpu", overrides={**kv, "engine.prefix_cache": False}
    )
    times: dict[str, list[float]] = {"on_cold": [], "on_turn": [], "off_cold": [], "off_turn": []}
    for rep in range(args.reps + 1):  # the first is a warm-up
        g = torch.Generator().manual_seed(rep)
        prefix = torch.randint(5, 250, (args.prefix,), generator=g).tolist()
        first = prefix + torch.randint(5, 250, (args.turn,), generator=g).tolist()
        turn = prefix + torch.randint(5, 250, (args.turn,), generator=g).tolist()
        outs = {}
        for name, llm in (("on", on), ("off", off)):
            cold = llm.generate([first], max_new_tokens=1)[0]
            hit = llm.generate([turn], max_new_tokens=8, ignore_eos=True)[0]
            outs[name] = hit.token_ids
            if rep:
                times[f"{name}_cold"].append(cold.ttft_s)
                times[f"{name}_turn"].append(hit.ttft_s)
        same = outs["on"] == outs["off"]  # (block chunking may move a near-tie)
        print(f"rep {rep}: second-turn outputs on == off: {same}", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model={model} spec={spec} prefix={args.prefix} turn={args.turn} reps={args.reps}")
    for k, v in med.items():
        print(f"  TTFT {k:9s} {v * 1e3:8.1f} ms")
    print(f"  turn TTFT speed-up (off / on): {med['off_turn'] / med['on_turn']:.1f}x")
    print(f"  cold prefill cost of the cache (on / off): {med['on_cold'] / med['off_cold']:.2f}x")
    if args.concurrency:
        batched(on, off, args)


def batched(on: xspec.LLM, off: xspec.LLM, args: argparse.Namespace) -> None:
    """Second turns of ``--concurrency`` conversations at once: tok/s and tokens/step."""
    n = args.concurrency
    rates: dict[str, list[float]] = {"on": [], "off": []}
    per_step: dict[str, list[float]] = {"on": [], "off": []}
    for rep in range(args.reps + 1):
        g = torch.Generator().manual_seed(1000 + rep)
        prefix = torch.randint(5, 250, (args.prefix,), generator=g).tolist()
        turns = [
            [prefix + torch.randint(5, 250, (args.turn,), generator=g).tolist() for _ in range(n)]
            for _ in range(2)
        ]
        for name, llm in (("on", on), ("off", off)):
            llm.generate(turns[0], max_new_tokens=1, concurrency=n)
            t0 = time.perf_counter()
            gens = llm.generate(
                turns[1], max_new_tokens=args.max_new, ignore_eos=True, concurrency=n
            )
            wall = time.perf_counter() - t0
            if rep:
                rates[name].append(sum(len(x.token_ids) for x in gens) / wall)
                steps = sum(x.num_steps for x in gens)
                per_step[name].append(
                    sum(x.spec.num_accepted_tokens + x.num_steps for x in gens) / max(steps, 1)
                )
    for name in ("on", "off"):
        print(
            f"  concurrency {n}, cache {name:3s}: {statistics.median(rates[name]):7.1f} tok/s, "
            f"{statistics.median(per_step[name]):.3f} tokens/step"
        )
    print(
        f"  throughput (on / off): {statistics.median(rates['on']) / statistics.median(rates['off']):.2f}x"
    )


if __name__ == "__main__":
    main()
