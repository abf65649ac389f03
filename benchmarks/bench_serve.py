"""xspec's own server under load, side by side in one run (docs/performance.md,
"Serving"):

1. **serving benchmark at a fixed request rate**, ``spec=none`` vs ``spec=dspark``: each
   server in its own process (``python -m xspec.serve``), loaded by ``xspec.bench``'s
   client (Poisson arrivals): TTFT / TPOT / ITL percentiles, output throughput, acceptance;
2. **server vs offline engine** at concurrency 32 on the same prompts: output tokens per
   second of the server (all requests sent at once, at most 32 in flight, streamed over
   HTTP) against ``LLM.generate(..., concurrency=32)`` in a fresh process, each the
   median of ``--bursts`` runs in its process, back to back. The ratio (the median of
   the repeats' ratios) is what the HTTP layer, the thread hand-off and per-request
   streaming cost.

Configurations alternate within each repeat (the machine is noisy); medians are printed.

    python benchmarks/bench_serve.py                    # the defaults below
    python benchmarks/bench_serve.py --repeats 3 --num-prompts 96 --rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xspec.bench.dataset import BenchRequest, LocalTokens, synthetic  # noqa: E402
from xspec.bench.serve import ServeConfig, run_benchmark  # noqa: E402

OFFLINE = """
import json, sys, time, xspec
args = json.loads(sys.argv[1])
llm = xspec.LLM(model=args["model"], spec=args["spec"], platform="cpu")
llm.generate(args["prompts"][:2], max_new_tokens=4, ignore_eos=True)  # warm-up
runs = []
for _ in range(args["bursts"]):
    t0 = time.perf_counter()
    gens = llm.generate(args["prompts"], max_new_tokens=args["max_tokens"], ignore_eos=True,
                        concurrency=args["concurrency"])
    runs.append(sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t0))
print(json.dumps({"output_throughput": runs}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: str, spec: str, concurrency: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [f"model={model}", f"spec={spec}", "platform=cpu", f"server.port={self.port}",
                f"server.concurrency={concurrency}", "server.max_queue=4096"]  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xspec.serve", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("xspec.serve:"):
                return
        raise RuntimeError(f"the {spec} server did not start (exit {self.proc.wait()})")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def load(url: str, reqs: list[BenchRequest], rate: float, concurrency: int, seed: int) -> dict:
    cfg = ServeConfig(base_url=url, request_rate=rate, max_concurrency=concurrency, seed=seed,
                      ignore_eos=True)  # fmt: skip
    return asyncio.run(run_benchmark(cfg, reqs))


def offline(
    model: str, spec: str, reqs: list[BenchRequest], concurrency: int, bursts: int
) -> float:
    """The median output tok/s of ``bursts`` runs of ``reqs`` in one fresh process."""
    args = {"model": model, "spec": spec, "prompts": [r.prompt for r in reqs],
            "max_tokens": reqs[0].max_tokens, "concurrency": concurrency, "bursts": bursts}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", OFFLINE, json.dumps(args)], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return statistics.median(json.loads(out.stdout.strip().splitlines()[-1])["output_throughput"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="dsv4_tiny")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rate", type=float, default=4.0, help="requests/s of the fixed-rate run")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--bursts", type=int, default=3, help="bursts per process (median)")
    a = p.parse_args()
    assets = Path(__file__).resolve().parents[1] / "xspec" / "assets" / a.model  # its tokenizer
    reqs = asyncio.run(synthetic(a.num_prompts, a.input_len, a.output_len, 0, LocalTokens(assets)))
    rated: dict[str, list[dict]] = {"none": [], "dspark": []}
    burst: dict[str, list[float]] = {"none": [], "dspark": []}
    off: dict[str, list[float]] = {"none": [], "dspark": []}
    for rep in range(a.repeats):
        for spec in ("none", "dspark"):
            off[spec].append(offline(a.model, spec, reqs, a.concurrency, a.bursts))
            server = Server(a.model, spec, a.concurrency)
            try:
                load(server.url, reqs[:4], float("inf"), 4, seed=99)  # warm the server path
                tps = [
                    load(server.url, reqs, float("inf"), a.concurrency, rep)["output_throughput"]
                    for _ in range(a.bursts)
                ]
                burst[spec].append(statistics.median(tps))
                rated[spec].append(load(server.url, reqs, a.rate, a.concurrency, rep))
            finally:
                server.stop()
            print(f"repeat {rep + 1}/{a.repeats} spec={spec} done", file=sys.stderr)

    def med(spec: str, key: str) -> float:
        vals = [r[key] for r in rated[spec] if r.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    print(f"\n## Serving: {a.model}, {a.num_prompts} requests of {a.input_len} tokens -> "
          f"{a.output_len} tokens, Poisson {a.rate:g} req/s, at most {a.concurrency} in flight, "
          f"greedy, median of {a.repeats}\n")  # fmt: skip
    keys = [("output_throughput", "output tok/s"), ("median_ttft_ms", "median TTFT ms"),
            ("p99_ttft_ms", "p99 TTFT ms"), ("median_tpot_ms", "median TPOT ms"),
            ("p99_tpot_ms", "p99 TPOT ms"), ("median_itl_ms", "median ITL ms"),
            ("p99_itl_ms", "p99 ITL ms"), ("median_e2el_ms", "median e2e ms")]  # fmt: skip
    print("| metric | spec=none | spec=dspark | dspark / none |\n|---|---|---|---|")
    for key, name in keys:
        n, d = med("none", key), med("dspark", key)
        print(f"| {name} | {n:.1f} | {d:.1f} | {d / n:.2f}x |")
    acc = [r.get("acceptance_length") for r in rated["dspark"]]
    if acc and all(x is not None for x in acc):
        print(f"| acceptance length (dspark) | | {statistics.median(acc):.2f} | |")
    print(f"\n## Server vs offline engine: concurrency {a.concurrency}, the same "
          f"{a.num_prompts} prompts, all sent at once, output tok/s: per repeat the median "
          f"of {a.bursts} bursts in one process each, then the median of {a.repeats} "
          "repeats; the ratio is the median of the repeats' ratios (each repeat runs "
          "offline and server back to back)\n")  # fmt: skip
    print("| spec | offline `LLM.generate` | server (HTTP, streamed) | server / offline |")
    print("|---|---|---|---|")
    for spec in ("none", "dspark"):
        o, s = statistics.median(off[spec]), statistics.median(burst[spec])
        ratio = statistics.median(b / f for b, f in zip(burst[spec], off[spec]))
        print(f"| {spec} | {o:.1f} | {s:.1f} | {ratio:.2f} |")
    print(
        f"\n(raw: offline {off}, server {burst}; {time.strftime('%Y-%m-%d %H:%M')}, "
        f"{os.cpu_count()} CPUs)"
    )


if __name__ == "__main__":
    main()
