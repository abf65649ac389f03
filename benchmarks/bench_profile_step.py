"""Where a step spends its time on dsv4_tiny: torch.profiler tables per step kind.

    python benchmarks/bench_profile_step.py [--context 512] [--batch 1 8] [--gamma 5]
                                            [--steps 10] [--top 12] [--kernels auto|reference]

For each batch size, the sequences are prefilled to ``--context`` tokens through the real
speculative step (``bench_draft_step.setup``), then each of these is profiled over
``--steps`` calls (after warm-up calls, outside the profile):

* ``decode``: one target decode step (1 row per sequence), rolled back after each call;
* ``verify 6``: one target forward of ``gamma + 1`` rows per sequence, rolled back;
* ``mtp observe`` / ``mtp propose``: the MTP draft's per-step work (gamma 1);
* ``dspark observe`` / ``dspark propose``: the DSpark draft of ``--gamma`` tokens.

Printed per step kind: wall ms per call, ops per call (those dispatched from Python,
and every aten op with nested ones: each costs its dispatch on CPU and a launch on GPU),
the self-CPU time inside ops,
and the top ``--top`` operators by self CPU time with their calls per step. Use it to
judge whether a change removed ops or only moved time. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from step_setup import scorer, setup, timers  # (the script's folder is on sys.path)
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode


class _OpCounter(TorchDispatchMode):
    """Counts the ops dispatched from Python (the nested calls inside an op not included)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


def report(name: str, fn: Callable[[], None], steps: int, top: int) -> None:
    """Profile ``steps`` calls of ``fn``; print ms/call, ops/call and the top self-CPU ops."""
    for _ in range(3):  # warm-up: lazy allocations, memo tables, restacked rings
        fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    wall = (time.perf_counter() - t) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            fn()
    with _OpCounter() as counter:
        fn()
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::")) / steps
    total = sum(e.self_cpu_time_total for e in events) / steps
    print(
        f"\n== {name}: {wall * 1e3:.2f} ms/call (unprofiled); {counter.calls} ops dispatched "
        f"from Python, {calls:.0f} aten ops with nested ones; {total / 1e3:.2f} ms/call "
        "self-CPU inside ops (profiled; the rest of the wall time is Python and dispatch)"
    )
    print(f"  {'operator':<34} {'self ms':>8} {'share':>6} {'calls':>7}")
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in ranked[:top]:
        share = e.self_cpu_time_total / steps / total if total else 0.0
        print(
            f"  {e.key[:34]:<34} {e.self_cpu_time_total / steps / 1e3:>8.3f} "
            f"{share:>6.1%} {e.count / steps:>7.1f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--gamma", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kernels", default="auto", choices=["auto", "reference"])
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    print(
        f"dsv4_tiny float32 on cpu ({torch.get_num_threads()} threads), context {a.context}, "
        f"{a.steps} profiled calls per step kind"
    )
    for batch in a.batch:
        dspark, dseqs = setup("dspark", a.gamma, a.context, batch, a.kernels)
        mtp, mseqs = setup("mtp", None, a.context, batch, a.kernels)
        fns = timers(mtp, mseqs, "mtp") | timers(dspark, dseqs, f"dspark g={a.gamma}")
        steps = {
            "decode": fns["target"],
            f"verify {a.gamma + 1}": scorer(
                mtp.built.target,
                [s.target_state for s in mseqs],
                a.gamma + 1,
                torch.Generator().manual_seed(0),
            ),
            "mtp observe": fns["mtp observe"],
            "mtp propose": fns["mtp propose"],
            "dspark observe": fns[f"dspark g={a.gamma} observe"],
            "dspark propose": fns[f"dspark g={a.gamma} propose"],
        }
        for name, fn in steps.items():
            report(f"batch {batch} {name}", fn, a.steps, a.top)


if __name__ == "__main__":
    main()
