"""Draft cost on dsv4_tiny: a DSpark block draft and an MTP draft vs one target decode step.

    python benchmarks/bench_draft_step.py [--context 512] [--batch 1 8] [--gamma 5] [--reps 30]
                                          [--kernels auto|reference] [--temperature 0]

For each batch size the sequences are prefilled to ``--context`` tokens through the real
speculative step (so every cache is in its decode-time state), then these are timed
round-robin (median of ``--reps``; target steps are rolled back after each call, draft
``observe`` calls are not: the draft context grows by ``--reps`` rows, which is noise):

* ``target``: one target decode step (1 row per sequence), the unit;
* ``dspark propose``: the whole DSpark draft of ``--gamma`` tokens (3 stages over the
  block, Markov loop, confidence head);
* ``dspark observe``: writing one committed position's context K/V into the 3 stages;
* ``mtp observe`` / ``mtp propose``: the MTP's per-step work at gamma 1 (its one block
  forward happens in observe; propose only samples the kept logits).

``--temperature T`` (> 0): every request samples at T with its own seeded generator, as a
served sampled batch does (the drafts' q, the Markov loop's draws); 0 (default) is greedy.

Ratios are measured side by side in one run; nothing is asserted.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from step_setup import interleaved, setup, timers  # (the script's folder is on sys.path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    print(
        f"dsv4_tiny float32 on cpu ({torch.get_num_threads()} threads), context {a.context}, "
        f"median of {a.reps} interleaved reps, "
        f"{'greedy' if a.temperature == 0 else f'T={a.temperature}'}; "
        "fractions of one target decode step"
    )
    print(f"{'batch':>5} {'what':<16} {'ms':>8} {'x target':>9}")
    for batch in a.batch:
        fns: dict[str, Callable[[], None]] = {}
        for spec, gamma in (("dspark", a.gamma), ("mtp", None)):
            llm, seqs = setup(spec, gamma, a.context, batch, a.kernels, a.temperature)
            fns |= timers(llm, seqs, spec if spec == "mtp" else f"dspark g={a.gamma}")
        interleaved(fns, 3, lambda: None)  # warm-up
        med = interleaved(fns, a.reps, lambda: None)
        for k, v in med.items():
            print(f"{batch:>5} {k:<16} {v * 1e3:>8.2f} {v / med['target']:>9.2f}")


if __name__ == "__main__":
    main()
