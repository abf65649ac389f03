"""What logprobs and the logits processors cost under speculation: tokens per decode step,
TPOT and process CPU time per output token of the same workload with ``logprobs``, with
the penalties (presence, frequency, repetition) and with a ``logit_bias``, against none of
them, for every spec method, in one process; with ``--batch-invariant`` also the plain
workload on a second build with ``platform.batch_invariant=true`` (logprobs bit for bit
equal across speculation and batching: docs/sampling.md).

    python benchmarks/bench_sampling.py [--spec none mtp dspark] [--concurrency 4]
        [--requests 4] [--max-new 32] [--reps 3] [--temperature 0] [--threads 1]
        [--batch-invariant] [key=value ...]

Every spec method is built first; then each repeat runs every (method, setting) once,
methods and settings in an order rotated from one repeat to the next (a slow spell of a
shared machine falls on all of them), every request generating ``--max-new`` tokens (EOS
ignored). Printed per method and setting, medians over the repeats: TPOT (ms, wall
clock), tokens per decode step (committed tokens after the first / decode steps, per
request summed), CPU time per output token (ms, this process's CPU time over the run,
all threads: steadier than wall time on a loaded machine, since time the process waits
for a core is not counted), and each as a ratio to the plain setting of the same method.
Penalties and biases change the text, so they change acceptance: the tokens-per-step
ratio is that effect, the TPOT and CPU ratios its sum with the processors' own time.
``pen.undrafted`` runs the penalties with the drafter proposing without them
(``Drafter.process_drafts`` off): what proposing under them gains.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import xspec

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def push(self",
    "The quick brown fox",
]
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs=5": {"logprobs": 5},
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
    "logit_bias": {"logit_bias": {t: -2.0 for t in range(100, 116)}},
}
INVARIANT = "batch_inv."  # the plain workload on the platform.batch_invariant build
# the penalties with the drafter proposing without them (Drafter.process_drafts off)
UNDRAFTED = "pen.undrafted"
Row = tuple[float, float, float]  # (TPOT s, tokens per step, CPU s per output token)


def run(llm: xspec.LLM, args: argparse.Namespace, kw: dict[str, Any]) -> Row:
    """One run of the workload."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    cpu = time.process_time()
    gens = llm.generate(
        prompts,
        args.max_new,
        temperature=args.temperature,
        ignore_eos=True,
        concurrency=args.concurrency,
        **kw,
    )
    cpu = time.process_time() - cpu
    tpot = statistics.median(g.tpot_s for g in gens if g.tpot_s is not None)
    per_step = sum(len(g.token_ids) - 1 for g in gens) / sum(g.num_steps for g in gens)
    return tpot, per_step, cpu / sum(len(g.token_ids) for g in gens)


def _rotated(items: list[str], k: int) -> list[str]:
    return items[k % len(items) :] + items[: k % len(items)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", nargs="+", default=["none", "mtp", "dspark"])
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--batch-invariant", action="store_true", help="also time a "
                    "platform.batch_invariant=true build")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU time per token "
                    "counts spinning threads too: one thread keeps it the work's)")  # fmt: skip
    args, overrides = ap.parse_known_args()
    overrides += [s for s in args.spec if "=" in s]  # key=value after --spec's names
    args.spec = [s for s in args.spec if "=" not in s]
    cfg = dict(o.split("=", 1) for o in overrides)
    torch.set_num_threads(args.threads)
    model = cfg.pop("model", "dsv4_tiny")
    platform = cfg.pop("platform", "auto")
    print(f"model={model} T={args.temperature} concurrency={args.concurrency} "
          f"requests={args.requests} max_new={args.max_new} reps={args.reps} "
          f"threads={args.threads}")  # fmt: skip
    settings = {name: (name, kw) for name, kw in SETTINGS.items()}
    settings[UNDRAFTED] = (UNDRAFTED, SETTINGS["penalties"])
    variants = {"": cfg}
    if args.batch_invariant:
        variants[INVARIANT] = {**cfg, "platform.batch_invariant": True}
        settings[INVARIANT] = (INVARIANT, {})
    llms = {
        (s, v): xspec.LLM(model=model, spec=s, platform=platform, overrides=o)
        for s in args.spec
        for v, o in variants.items()
    }
    for llm in llms.values():
        run(llm, args, {})  # warm-up
    results: dict[tuple[str, str], list[Row]] = {}
    for rep in range(args.reps):
        for i, spec in enumerate(_rotated(args.spec, rep)):
            for name in _rotated(list(settings), rep + i):
                variant = INVARIANT if name == INVARIANT else ""
                llm = llms[spec, variant]
                llm.engine.drafter.process_drafts = name != UNDRAFTED
                row = run(llm, args, settings[name][1])
                results.setdefault((spec, name), []).append(row)
    print(
        f"{'spec':7} {'setting':13} {'TPOT ms':>8} {'tok/step':>8} {'CPU ms/tok':>10} "
        f"{'TPOT x':>7} {'tok/step x':>10} {'CPU x':>6}"
    )
    for spec in args.spec:
        base = [statistics.median(r[k] for r in results[spec, "plain"]) for k in range(3)]
        for name in settings:
            t, s, c = (statistics.median(r[k] for r in results[spec, name]) for k in range(3))
            print(
                f"{spec:7} {name:13} {t * 1e3:8.2f} {s:8.2f} {c * 1e3:10.2f} "
                f"{t / base[0]:7.3f} {s / base[1]:10.3f} {c / base[2]:6.3f}"
            )


if __name__ == "__main__":
    main()
