"""Structured output under speculation: what draft masking and forced tokens are worth.

    python benchmarks/bench_structured.py [--prompts 6] [--max-new 48] [--concurrency 1]
        [--temperatures 0 0.8] [--reps 3] [--mtp-gamma 3] [--threads 1]

Held-out code prompts, each asked for JSON matching a small schema (an object with a
string, an integer, an enum and an array of enums), on the trained ``dsv4_tiny``. Side by
side in one process, configurations interleaved round-robin over ``--reps`` repeats
(medians): ``spec=none``, and MTP (gamma ``--mtp-gamma``) and DSpark (its trained block)
each with the drafts proposed unmasked (``spec.mask_drafts=false``, forced tokens off),
masked inside the drafter (forced tokens off), and masked with forced tokens. Printed per
configuration and temperature: committed tokens per step; TPOT (wall) and the process's
CPU time per output token (steadier than wall time on a shared host; ``--threads``
torch threads) with its speed-up over ``spec=none``; the grammar work per decode step
(host CPU time in masks, walks and commits, :data:`xspec.spec.constrained.GRAMMAR_CLOCK`)
in ms and as a share of the step's CPU time; and (greedy) whether every output equals
``spec=none``'s (it must).

Nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import xspec
from xspec.engine.engine import Engine, Request
from xspec.grammar import GrammarSpec
from xspec.sampling import SamplingParams
from xspec.spec.constrained import GRAMMAR_CLOCK
from xspec.train import corpus

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "line": {"type": "integer", "minimum": 0, "maximum": 9999},
        "kind": {"enum": ["function", "class", "import", "comment"]},
        "tags": {"type": "array", "items": {"enum": ["io", "math", "text", "net"]}, "maxItems": 3},
    },
    "required": ["name", "line", "kind", "tags"],
    "additionalProperties": False,
}
CONFIGS = {  # name: (spec, mask_drafts, forced_tokens)
    "none": ("none", True, True),
    "mtp unmasked": ("mtp", False, False),
    "mtp masked": ("mtp", True, False),
    "mtp masked+forced": ("mtp", True, True),
    "dspark unmasked": ("dspark", False, False),
    "dspark masked": ("dspark", True, False),
    "dspark masked+forced": ("dspark", True, True),
}


def run_once(built, prompts, max_new: int, concurrency: int, temperature: float) -> dict:
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=built.tokenizer.stop_ids)
    grammar = built.grammars.compile(GrammarSpec.json_schema(SCHEMA))
    reqs = [
        Request(p, max_new, SamplingParams(temperature=temperature, seed=i), grammar=grammar)
        for i, p in enumerate(prompts)
    ]
    GRAMMAR_CLOCK.reset()
    cpu = time.process_time()
    gens = engine.run(reqs, concurrency)
    cpu = time.process_time() - cpu
    steps = engine.metrics.report().num_steps
    tokens = sum(len(g.token_ids) for g in gens)
    tpots = [g.tpot_s for g in gens if g.tpot_s is not None]
    return {
        "tokens_per_step": tokens / max(1, sum(g.num_steps for g in gens)),
        "tpot": statistics.mean(tpots),
        "cpu_per_token": cpu / tokens,
        "grammar_ms_per_step": GRAMMAR_CLOCK.cpu_seconds / max(1, steps) * 1e3,
        "grammar_share": GRAMMAR_CLOCK.cpu_seconds / cpu,
        "outputs": [g.token_ids for g in gens],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=48)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--mtp-gamma", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    built = {}
    for name, (spec, mask, forced) in CONFIGS.items():
        overrides = {"spec.mask_drafts": mask, "spec.forced_tokens": forced}
        if spec == "mtp":
            overrides["spec.num_speculative_tokens"] = a.mtp_gamma
        built[name] = xspec.LLM(
            model="dsv4_tiny", spec=spec, platform="cpu", overrides=overrides
        ).built
    tok = built["none"].tokenizer
    texts = corpus.prompts(corpus.source_files(split="heldout"), a.prompts, seed=123)
    prompts = [tok.encode(t[-200:] + "\n# as JSON: ") for t in texts]
    for c in a.concurrency:
        for temp in a.temperatures:
            runs: dict[str, list[dict]] = {n: [] for n in CONFIGS}
            for _ in range(a.reps):  # round-robin: every configuration sees the same load
                for name in CONFIGS:
                    runs[name].append(run_once(built[name], prompts, a.max_new, c, temp))
            base = statistics.median(r["cpu_per_token"] for r in runs["none"])
            regime = "greedy" if temp == 0 else f"T={temp}"
            print(
                f"\nconcurrency {c}, {regime}, {len(prompts)} prompts x {a.max_new} tokens max, "
                f"{a.reps} reps (medians)"
            )
            print(
                f"{'config':<22}{'tokens/step':>12}{'TPOT ms':>9}{'CPU ms/tok':>11}"
                f"{'speed-up':>9}{'grammar ms/step':>16}{'% of step':>10}  same as none"
            )
            for name, rs in runs.items():
                med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "outputs"}
                same = (
                    str(all(r["outputs"] == runs["none"][0]["outputs"] for r in rs))
                    if temp == 0
                    else "-"
                )
                print(
                    f"{name:<22}{med['tokens_per_step']:>12.2f}{med['tpot'] * 1e3:>9.1f}"
                    f"{med['cpu_per_token'] * 1e3:>11.1f}{base / med['cpu_per_token']:>8.2f}x"
                    f"{med['grammar_ms_per_step']:>16.2f}"
                    f"{med['grammar_share']:>10.1%}  {same}"
                )


if __name__ == "__main__":
    main()
