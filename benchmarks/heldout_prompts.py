"""Write ``benchmarks/heldout_prompts.jsonl``: the prompts adaptive speculation is judged
on, apart from ``benchmarks/adaptive_prompts.jsonl`` (the prompts its rule was tuned on).

    python benchmarks/heldout_prompts.py [--count 24] [--out benchmarks/heldout_prompts.jsonl]

The set is the default workload's prompts (``conf/workload/default.yaml``) followed by
``--count`` evaluation prompts of the trained model: ``xspec.train.corpus.prompts`` over
the held-out standard-library files with seed 123 (what ``bench_trained.py`` and the
model card's evaluation draw), minus every prompt that shares a line of more than 20
characters with a tuning prompt. The draw reads this machine's standard library, so
the committed file is the reference; rerun this to rebuild it elsewhere.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).parent
TUNING = HERE / "adaptive_prompts.jsonl"
HELDOUT = HERE / "heldout_prompts.jsonl"
WORKLOAD = HERE.parent / "conf" / "workload" / "default.yaml"
SEED = 123  # bench_trained.py's and the model card's evaluation draw


def _lines(text: str) -> set[str]:
    """The lines of ``text`` long enough to identify where it came from."""
    return {line.strip() for line in text.splitlines() if len(line.strip()) > 20}


def heldout_prompts(count: int) -> list[str]:
    """The default workload's prompts, then ``count`` held-out-file prompts that share
    no line with a tuning prompt (the module docstring)."""
    import yaml

    from xspec.train import corpus

    tuning = [json.loads(line)["prompt"] for line in TUNING.read_text().splitlines() if line]
    seen = set().union(*map(_lines, tuning))
    workload = list(yaml.safe_load(WORKLOAD.read_text())["prompts"])
    if any(_lines(p) & seen for p in workload):
        raise SystemExit(f"a prompt of {WORKLOAD} shares lines with {TUNING}")
    files = corpus.source_files(split="heldout")
    drawn, picked = 2 * count, []
    while len(picked) < count:  # the draw is prefix-stable: a longer one extends it
        picked = [p for p in corpus.prompts(files, drawn, seed=SEED) if not _lines(p) & seen]
        picked = list(dict.fromkeys(p for p in picked if p not in workload))
        drawn *= 2
    return workload + picked[:count]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=24, help="held-out-file prompts to draw")
    ap.add_argument("--out", type=Path, default=HELDOUT)
    a = ap.parse_args()
    if a.count < 1:
        ap.error(f"--count must be at least 1, got {a.count}")
    prompts = heldout_prompts(a.count)
    a.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{a.out}: {len(prompts)} prompts")


if __name__ == "__main__":
    main()
