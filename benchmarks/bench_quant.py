"""Resident quantized weights at DeepSeek-V4-Flash geometry: one layer's linears and the
MoE experts its rows reach, decode (1 row) and verify (6 rows), per stored format.

    python benchmarks/bench_quant.py [--reps 5] [--threads 1] [--formats fp8 mxfp4 w8a8]

One layer of Flash (hidden 4096, q_lora 1024, 64 heads x 512, o_groups 8 x 1024, indexer
64 x 128, 256 experts x 2048, 6 routed + 1 shared per row), random weights:

* attention ``wq_a, wq_b, wkv, wo_a (one group-stacked linear), wo_b``, indexer ``wq_b``:
  FP8 (128x128 ue8m0 blocks) or W8A8; with ``mxfp4`` the dense part is FP8, as in the
  Flash release;
* the experts: each row's 6 routed experts (distinct across rows) and the shared
  expert, ``w1, w3`` then SwiGLU then ``w2``; MXFP4 routed experts for ``mxfp4``, FP8
  for ``fp8``, int8 for ``w8a8``; the shared expert FP8 / FP8 / int8.

The dense linears, the shared expert (on all rows) and one routed expert (on one row)
are timed separately, interleaved across modes; a step is composed as dense + shared +
6 x rows routed experts (each row reaches 6 distinct experts, one row each), which is how
the reference MoE runs them (one expert after another), without the router, attention
core and mHC, which do not depend on the weight format.

Modes, interleaved per repeat (median reported):

* ``bf16``: the same weights dequantized once to bf16 and resident (twice the W8A8 bytes);
* ``dequant``: ``model.quant_compute=dequant``: each weight dequantized for its call
  (exact against ``bf16`` up to the weight's own rounding), then the bf16 GEMM;
* ``native``: ``model.quant_compute=native`` with the reference ops: the plain-torch
  statement of the semantics (FP8/MXFP4: e4m3 activation blocks, fp32 GEMM on the
  dequantized weight; W8A8: int8 activations, ``torch._int_mm`` on the int8 weight);
* ``kernel``: ``model.quant_compute=auto`` on ``platform=cpu``: the native host kernels
  reading the stored bytes (W8A8: int8 GEMV, bit for bit ``native``; FP8 / MXFP4: each
  weight row decoded once for all rows, ``native`` up to summation order).

"weights read / token": the bytes of the weights the step touches, divided by its rows
(stored bytes for the quantized modes; a dequantizing call also writes and reads a float
copy of each weight, not counted). Nothing here is asserted by the test suite.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from xspec.models.deepseek_v4.convert import quantize_fp8_blocks, quantize_int8
from xspec.models.deepseek_v4.quant import quant_mxfp4
from xspec.models.ops import REFERENCE_OPS, ModelOps, dense
from xspec.models.quantized import QuantizedWeight
from xspec.platforms import native

D, Q_LORA, HEADS, HEAD_DIM, O_GROUPS, O_LORA = 4096, 1024, 64, 512, 8, 1024
INDEX_DIM, INTER, EXPERTS, TOP_K = 64 * 128, 2048, 256, 6
DENSE = {  # name: (out, in)
    "wq_a": (Q_LORA, D),
    "wq_b": (HEADS * HEAD_DIM, Q_LORA),
    "wkv": (HEAD_DIM, D),
    "wo_a": (O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS),
    "wo_b": (D, O_GROUPS * O_LORA),
    "indexer.wq_b": (INDEX_DIM, Q_LORA),
}
MODES = ("bf16", "dequant", "native", "kernel")
Weight = torch.Tensor | QuantizedWeight


def quantized(fmt: str, w: torch.Tensor) -> QuantizedWeight:
    """``w [N, K]`` float stored as ``fmt`` (``fp8`` / ``mxfp4`` / ``w8a8``)."""
    if fmt == "fp8":
        q, s = quantize_fp8_blocks(w, [128, 128])
        return QuantizedWeight("fp8", q, s, None, torch.bfloat16)
    if fmt == "mxfp4":
        q, s = quant_mxfp4(w)
        return QuantizedWeight("mxfp4", q, s, None, torch.bfloat16)
    q, s = quantize_int8(w)
    return QuantizedWeight("w8a8", q, s, None, torch.bfloat16)


class Layer:
    """One Flash layer's dense linears and one expert (w1, w3, w2) in ``fmt``."""

    def __init__(self, fmt: str, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        dense_fmt = "fp8" if fmt == "mxfp4" else fmt

        def rand(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, generator=gen) / k**0.5

        self.dense = {n: quantized(dense_fmt, rand(*s)) for n, s in DENSE.items()}
        self.shared = [quantized(dense_fmt, rand(*s)) for s in _ffn_shapes()]
        self.routed = [quantized(fmt, rand(*s)) for s in _ffn_shapes()]

    def weights(self, mode: str) -> dict[str, list[Weight]]:
        """``dense`` (the six linears), ``shared`` and ``routed`` (one expert's w1, w3,
        w2) as ``mode`` holds them."""

        def held(w: QuantizedWeight) -> Weight:
            if mode == "bf16":
                return w.dequantize()
            compute = "native" if mode == "kernel" else mode
            return QuantizedWeight(w.format, w.data, w.scale, w.offset, w.dtype, compute, w.block)

        return {
            "dense": [held(w) for w in self.dense.values()],
            "shared": [held(w) for w in self.shared],
            "routed": [held(w) for w in self.routed],
        }


def _ffn_shapes() -> list[tuple[int, int]]:
    return [(INTER, D), (INTER, D), (D, INTER)]  # w1, w3, w2


def nbytes(w: Weight) -> int:
    return w.nbytes if isinstance(w, QuantizedWeight) else w.numel() * w.element_size()


def run_dense(ops: ModelOps, x: torch.Tensor, ws: list[Weight]) -> None:
    """The attention and indexer projections on all rows ``x [T, d]``."""
    wq_a, wq_b, wkv, wo_a, wo_b, iwq_b = ws
    qr = dense(ops, x, wq_a)
    dense(ops, qr, wq_b)
    dense(ops, qr, iwq_b)
    dense(ops, x, wkv)
    heads = torch.randn(x.shape[0], HEADS * HEAD_DIM // O_GROUPS, dtype=x.dtype)
    dense(ops, dense(ops, heads, wo_a), wo_b)


def run_expert(ops: ModelOps, x: torch.Tensor, ws: list[Weight]) -> None:
    """One expert (SwiGLU) on ``x [T, d]``."""
    w1, w3, w2 = ws
    h = F.silu(dense(ops, x, w1).float()) * dense(ops, x, w3).float()
    dense(ops, h.to(x.dtype), w2)


def interleaved(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds per call, the fns called round-robin after one warm-up each."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--formats", nargs="+", default=["fp8", "mxfp4", "w8a8"])
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernels, line = native.load()
    host_ops = kernels.ops() if kernels is not None else REFERENCE_OPS
    print(f"host kernels: {line}")
    print(
        f"one DeepSeek-V4-Flash layer's linears + reached experts; {a.threads} thread(s), "
        f"median of {a.reps} interleaved repeats; step = dense + shared expert on all rows "
        f"+ {TOP_K} routed experts per row (1 row each)"
    )
    print(f"{'format':7} {'rows':>4} {'mode':8} {'ms/step':>9} {'x bf16':>7} {'MB read/token':>14}")
    for fmt in a.formats:
        layer = Layer(fmt)
        modes = [m for m in MODES if m != "kernel" or kernels is not None]
        held = {m: layer.weights(m) for m in modes}
        ops = {m: host_ops if m == "kernel" else REFERENCE_OPS for m in modes}
        one = torch.randn(1, D, generator=torch.Generator().manual_seed(1)).bfloat16()
        for rows in (1, 6):
            x = torch.randn(rows, D, generator=torch.Generator().manual_seed(2)).bfloat16()
            fns: dict[str, Callable[[], None]] = {}
            for m in modes:
                w, o = held[m], ops[m]
                fns[f"{m}/dense"] = lambda w=w, o=o, x=x: run_dense(o, x, w["dense"])
                fns[f"{m}/shared"] = lambda w=w, o=o, x=x: run_expert(o, x, w["shared"])
                fns[f"{m}/routed"] = lambda w=w, o=o, r=one: run_expert(o, r, w["routed"])
            with torch.no_grad():
                t = interleaved(fns, a.reps)
            routed = TOP_K * rows  # distinct experts, one row each
            step = {
                m: t[f"{m}/dense"] + t[f"{m}/shared"] + routed * t[f"{m}/routed"] for m in modes
            }
            for m in modes:
                w = held[m]
                read = sum(nbytes(v) for v in [*w["dense"], *w["shared"]])
                read += routed * sum(nbytes(v) for v in w["routed"])
                print(
                    f"{fmt:7} {rows:>4} {m:8} {step[m] * 1e3:9.1f} {step[m] / step['bf16']:7.2f} "
                    f"{read / rows / 1e6:14.1f}"
                )


if __name__ == "__main__":
    main()
