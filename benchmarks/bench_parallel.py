"""Data-parallel scaling and expert-parallel memory on the CPU (gloo), dsv4_tiny.

    python benchmarks/bench_parallel.py [--concurrency 16] [--requests 32] [--output-len 32]
                                        [--spec none] [--reps 2]

Runs the CLI side by side, round-robin over ``--reps`` repeats (medians reported), each
process with one thread (``OMP_NUM_THREADS=1``: DP=2 uses two cores, DP=1 one):

* ``DP=1``: ``python -m xspec`` (one process);
* ``DP=2``: ``torchrun --nproc-per-node 2 -m xspec parallel.dp=2`` (every rank its own
  requests, all experts);
* ``DP=2 x EP=2``: the same with ``parallel.ep=2`` (each rank half the experts, MoE rows
  exchanged every layer, lockstep iterations).

* ``2 x DP=1 apart``: two independent single processes at the same time, each with half
  the requests and half the concurrency: what this machine's cores allow two replicas
  without any xspec coordination (the ceiling for ``DP=2``),

at the same total ``workload.concurrency`` (split over the replicas) on the synthetic
workload; output throughput = generated tokens / wall time of the measured run
(results.json ``output_tok_s``). It also prints each layout's routed-expert bytes per
rank (results.json ``parallel.expert_bytes_per_rank``) against the single process.
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "DP=1": (1, []),
    "DP=2": (2, ["parallel.dp=2"]),
    "DP=2 x EP=2": (2, ["parallel.dp=2", "parallel.ep=2"]),
}
APART = "2 x DP=1 apart"


def start(nproc: int, args: list[str], out: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone",
              f"--nproc-per-node={nproc}"]
    )  # fmt: skip
    cmd = [*launcher, "-m", "xspec", *args, f"hydra.run.dir={out}"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return proc, out


def result(job: tuple[subprocess.Popen, Path]) -> dict:
    proc, out = job
    text = proc.communicate(timeout=1800)[0].decode(errors="replace")
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, proc.args))}\n{text[-3000:]}")
    return json.loads((out / "results.json").read_text())


def apart(args: list[str], requests: int, concurrency: int, tmp: Path) -> float:
    """Two independent single processes at once, half the work each: summed tok/s."""
    half = [f"workload.num_requests={requests // 2}", f"workload.concurrency={concurrency // 2}"]
    jobs = [start(1, [*args, *half], tmp / f"apart{i}") for i in range(2)]
    runs = [result(j) for j in jobs]
    tokens = sum(r["repeats"][0]["output_tokens"] for r in runs)
    return tokens / max(r["repeats"][0]["wall_s"] for r in runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--spec", default="none")
    ap.add_argument("--reps", type=int, default=2)
    a = ap.parse_args()
    common = [
        "model=dsv4_tiny", "platform=cpu", f"spec={a.spec}", "workload=synthetic",
        f"workload.num_requests={a.requests}", f"workload.concurrency={a.concurrency}",
        f"workload.input_len={a.input_len}", f"workload.output_len={a.output_len}",
        "workload.print_outputs=false", "workload.warmup_requests=2",
    ]  # fmt: skip
    tput: dict[str, list[float]] = {k: [] for k in [*LAYOUTS, APART]}
    experts: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for name, (nproc, extra) in LAYOUTS.items():
                out = Path(tmp) / f"{rep}-{nproc}-{len(extra)}"
                res = result(start(nproc, [*common, *extra], out))
                tput[name].append(res["output_tok_s"])
                experts[name] = res["parallel"]["expert_bytes_per_rank"]
            tput[APART].append(apart(common, a.requests, a.concurrency, Path(tmp) / str(rep)))
    base = statistics.median(tput["DP=1"])
    print(
        f"dsv4_tiny spec={a.spec} synthetic {a.requests} requests x {a.output_len} tokens, "
        f"concurrency {a.concurrency} (total), {a.reps} reps, 1 thread per process"
    )
    print(f"{'layout':<17} {'tok/s':>8} {'vs DP=1':>8}  routed experts per rank (MiB)")
    for name in [*LAYOUTS, APART]:
        t = statistics.median(tput[name])
        mib = ", ".join(f"{b / 2**20:.2f}" for b in experts.get(name, []))
        print(f"{name:<17} {t:8.1f} {t / base:8.2f}x  {mib or '(two processes, no xspec link)'}")


if __name__ == "__main__":
    main()
