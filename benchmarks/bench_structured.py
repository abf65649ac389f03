"""Structured output under speculation: what forced tokens are worth.

    python benchmarks/bench_structured.py [--prompts 6] [--max-new 64] [--concurrency 1 4] [--reps 3]

Held-out code prompts, each asked for JSON matching a small schema (an object with a
string, an integer and an array of enums), greedy, on the trained ``dsv4_tiny``. Side by
side, round-robin over ``--reps`` repeats (medians): ``spec=none``, and MTP and DSpark each
with ``spec.forced_tokens`` off (only the drafter's drafts, masked) and on (the tokens the
grammar forces are proposed first, without the drafter). Printed per configuration:
committed tokens per step, TPOT and its speed-up over ``spec=none``, and whether every
output equals ``spec=none``'s (it must); and the share of output tokens at which the
grammar admitted exactly one token.

Nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time

import xspec
from xspec.engine.engine import Engine, Request
from xspec.grammar import GrammarSpec
from xspec.sampling import SamplingParams
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
CONFIGS = {  # name: (spec, forced_tokens)
    "none": ("none", True),
    "mtp": ("mtp", False),
    "mtp+forced": ("mtp", True),
    "dspark": ("dspark", False),
    "dspark+forced": ("dspark", True),
}


def run_once(built, prompts, max_new: int, concurrency: int) -> dict:
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=built.tokenizer.stop_ids)
    grammar = built.grammars.compile(GrammarSpec.json_schema(SCHEMA))
    reqs = [Request(p, max_new, SamplingParams(), grammar=grammar) for p in prompts]
    t = time.perf_counter()
    gens = engine.run(reqs, concurrency)
    wall = time.perf_counter() - t
    tokens = sum(len(g.token_ids) for g in gens)
    tpots = [g.tpot_s for g in gens if g.tpot_s is not None]
    return {
        "tokens_per_step": tokens / max(1, sum(g.num_steps for g in gens)),
        "tpot": statistics.mean(tpots),
        "throughput": tokens / wall,
        "outputs": [g.token_ids for g in gens],
    }


def forced_share(built, outputs: list[list[int]]) -> float:
    """The share of output tokens at which the grammar admitted exactly one token."""
    grammar = built.grammars.compile(GrammarSpec.json_schema(SCHEMA))
    one = total = 0
    for ids in outputs:
        c = grammar.constraint()
        for t in ids:
            one += int(c.allowed().sum()) == 1
            total += 1
            c.commit([t])
    return one / max(1, total)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    built = {
        name: xspec.LLM(
            model="dsv4_tiny", spec=spec, platform="cpu",
            overrides=[f"spec.forced_tokens={str(forced).lower()}"],
        ).built
        for name, (spec, forced) in CONFIGS.items()
    }  # fmt: skip
    tok = built["none"].tokenizer
    texts = corpus.prompts(corpus.source_files(split="heldout"), a.prompts, seed=123)
    prompts = [tok.encode(t[-200:] + "\n# as JSON: ") for t in texts]
    for c in a.concurrency:
        runs: dict[str, list[dict]] = {n: [] for n in CONFIGS}
        for _ in range(a.reps):
            for name in CONFIGS:
                runs[name].append(run_once(built[name], prompts, a.max_new, c))
        base = statistics.median(r["tpot"] for r in runs["none"])
        print(
            f"\nconcurrency {c}, greedy, {len(prompts)} prompts x {a.max_new} tokens max, {a.reps} reps"
        )
        share = forced_share(built["none"], runs["none"][0]["outputs"])
        print(f"tokens the grammar forced (one allowed token): {share:.0%} of the output")
        print(f"{'config':<15}{'tokens/step':>12}{'TPOT ms':>10}{'speed-up':>10}  same as none")
        for name, rs in runs.items():
            tps = statistics.median(r["tokens_per_step"] for r in rs)
            tpot = statistics.median(r["tpot"] for r in rs)
            same = all(r["outputs"] == runs["none"][0]["outputs"] for r in rs)
            print(f"{name:<15}{tps:>12.2f}{tpot * 1e3:>10.1f}{base / tpot:>9.2f}x  {same}")


if __name__ == "__main__":
    main()
