"""Quantized weights as checkpoints store them, and the math of computing with them.

A :class:`QuantizedWeight` is one linear weight ``W [N, K]`` kept in its stored bytes:

* ``fp8``: ``data`` e4m3 ``[N, K]``, ``scale`` (ue8m0 / fp32 / bf16) one per ``block``
  (128x128) block ``[ceil(N/bn), ceil(K/bk)]``: ``W = data * scale[n // bn, k // bk]``;
* ``mxfp4``: ``data`` int8 ``[N, K/2]``, two e2m1 codes per byte, low nibble = even
  column; ``scale`` ue8m0 (or its raw exponent bytes, uint8) ``[N, K/32]``;
* ``w8a8``: ``data`` int8 ``[N, K]``, ``scale`` ``[N, 1]``, optional ``offset`` ``[N, 1]``
  (msModelSlim): ``W = (data - offset) * scale``.

Two ways to compute ``x @ W.T`` (``QuantizedWeight.compute``, from ``model.quant_compute``):

* ``dequant`` (the reference, exact): :meth:`QuantizedWeight.dequantize` this one weight
  to the model dtype (fp32 math, then one rounding, the same values a dequantizing loader
  would have stored) and run the float op: bit for bit the dequantized float model;
* ``native``: quantize the activations as the format prescribes and accumulate on the
  quantized operands (:func:`native_linear`, the plain-torch statement of the semantics
  that platform kernels implement): FP8 and MXFP4 weights take e4m3 activations in
  per-token blocks of 128 with power-of-two scales (DeepSeek's ``act_quant``), W8A8 takes
  per-token symmetric int8 activations with int32 accumulation (``npu_dynamic_quant`` +
  ``npu_quant_matmul``). This differs from ``dequant`` by the activation rounding
  (relative ~2^-4 per element for e4m3, ~1/254 of the row's max for int8);
* ``auto``: the platform's native op where it has one (``ModelOps.quant_linear``), else
  ``dequant``.

This module is part of the op interface (platforms may import it, like ``models.ops``):
torch only, no model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("fp8", "mxfp4", "w8a8")
COMPUTE_MODES = ("auto", "dequant", "native")
MXFP4_BLOCK = 32  # values per ue8m0 scale along K
ACT_BLOCK = 128  # activation values per e4m3 scale along K (DeepSeek's act_quant)
E4M3_MAX = 448.0
INT8_MAX = 127.0
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One linear weight ``[N, K]`` in its stored form (see the module docstring).

    ``dtype``: the model dtype this weight stands in for (what ``dequantize`` returns);
    ``compute``: ``auto | dequant | native``; ``block``: FP8's scale block.
    """

    format: str
    data: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    dtype: torch.dtype
    compute: str = "dequant"
    block: tuple[int, int] = (128, 128)

    @property
    def shape(self) -> tuple[int, int]:
        """The logical ``(N, K)``."""
        n, k = self.data.shape
        return (n, 2 * k) if self.format == "mxfp4" else (n, k)

    @property
    def nbytes(self) -> int:
        """Stored bytes (data, scales, offsets)."""
        parts = [self.data, self.scale] + ([] if self.offset is None else [self.offset])
        return sum(t.numel() * t.element_size() for t in parts)

    def dequantize(self, rows: slice | None = None) -> torch.Tensor:
        """``W[rows]`` in ``dtype`` (fp32 math, one rounding): ``[n, K]``."""
        return self.dequantize_f32(rows).to(self.dtype)

    def dequantize_f32(self, rows: slice | None = None) -> torch.Tensor:
        """``W[rows]`` in fp32 (exact: every stored value and scale is an fp32 number)."""
        rows = rows or slice(None)
        if self.format == "w8a8":
            off = None if self.offset is None else self.offset[rows]
            return dequant_w8a8(self.data[rows], self.scale[rows], off)
        if self.format == "mxfp4":
            return dequant_mxfp4(self.data[rows], self.scale[rows])
        if self.format == "fp8":
            start, stop, _ = rows.indices(self.data.shape[0])
            bn = self.block[0]
            lo = start // bn  # scale rows covering [start, stop)
            full = dequant_fp8(self.data[lo * bn : stop], self.scale[lo:], list(self.block))
            return full[start - lo * bn :]
        raise ValueError(f"unknown quantized format {self.format!r}; known: {list(FORMATS)}")


# -- dequantization (exact in fp32) ---------------------------------------------------------


def dequant_w8a8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None) -> torch.Tensor:
    """q [N, K] int8, scale / offset [N, 1] or [N] -> fp32 [N, K] = (q - offset) * scale."""
    w = q.to(torch.float32)
    if offset is not None:
        w = w - offset.to(torch.float32).reshape(-1, 1)
    return w * scale.to(torch.float32).reshape(-1, 1)


def dequant_fp8(w: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """w [N, K] e4m3, scale [>= ceil(N/bn), ceil(K/bk)] -> fp32 [N, K] (one scale per block)."""
    n, k = w.shape
    full = scale.to(torch.float32).repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return w.to(torch.float32) * full[:n, :k]


def mxfp4_shape_problem(packed: list[int], scale: list[int], want: list[int]) -> str | None:
    """Why ``packed`` / ``scale`` shapes cannot hold an MXFP4 ``want = [N, K]`` weight
    (None when they can): K must be a multiple of 32, packed ``[N, K/2]``, scale ``[N, K/32]``."""
    if len(want) != 2 or want[1] % MXFP4_BLOCK:
        return (
            f"MXFP4 needs a 2-D weight with K a multiple of {MXFP4_BLOCK}, the config gives {want}"
        )
    n, k = want
    if packed != [n, k // 2]:
        return f"packed MXFP4 weight is {packed}, expected [N, K/2] = {[n, k // 2]}"
    if scale != [n, k // MXFP4_BLOCK]:
        return (
            f"MXFP4 scale is {scale}, expected one per {MXFP4_BLOCK} values: "
            f"{[n, k // MXFP4_BLOCK]}"
        )
    return None


def mxfp4_scale_f32(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales as fp32: ``float8_e8m0fnu`` converts exactly; raw uint8 bytes are
    exponents ``2^(byte - 127)`` (transformers' convention for both)."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    if scale.dtype != torch.float8_e8m0fnu:
        raise TypeError(f"MXFP4 scales are float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale.to(torch.float32)


def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed int8 ``[N, K/2]`` + scale ue8m0 ``[N, K/32]`` -> fp32 ``[N, K]``."""
    n, half = packed.shape
    problem = mxfp4_shape_problem(list(packed.shape), list(scale.shape), [n, 2 * half])
    if problem is not None:
        raise ValueError(problem)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)  # [N, K/2]
    low, high = lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]  # even, odd columns
    values = torch.stack([low, high], dim=-1).reshape(n, -1, MXFP4_BLOCK)  # [N, K/32, 32]
    return (values * mxfp4_scale_f32(scale).unsqueeze(-1)).reshape(n, 2 * half)


# -- activation quantization (the "native" semantics) ----------------------------------------


def act_quant_fp8(x: torch.Tensor, block: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 blocks (DeepSeek's ``act_quant`` with ue8m0 scales): ``x [T, K]`` ->
    ``(q e4m3 [T, K], scale fp32 [T, ceil(K/block)])``; each block's scale is the smallest
    power of two with ``max|x_block| / scale <= 448`` (an all-zero block: 2^-126)."""
    t, k = x.shape
    nb = -(-k // block)
    padded = x.new_zeros(t, nb * block, dtype=torch.float32)
    padded[:, :k] = x.float()
    blocks = padded.view(t, nb, block)
    amax = blocks.abs().amax(dim=-1).clamp(min=2.0**-126 * E4M3_MAX)  # [T, nb]
    scale = torch.exp2(torch.ceil(torch.log2(amax / E4M3_MAX)))
    q = (blocks / scale.unsqueeze(-1)).to(torch.float8_e4m3fn).view(t, nb * block)[:, :k]
    return q, scale


def dynamic_quant_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8 (``npu_dynamic_quant``): ``x [T, K]`` -> ``(q int8 [T, K],
    scale fp32 [T])`` with ``scale = max|x_t| / 127`` and ``q = round(x / scale)`` (half
    to even); an all-zero row gets scale 1."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [T, K] int8 @ b [N, K].T int8`` with exact int32 accumulation -> ``[T, N]``
    (``torch._int_mm`` reading ``b`` in place where it takes the shapes; otherwise fp64,
    which holds every partial sum of int8 products exactly for K < 2^37)."""
    if hasattr(torch, "_int_mm"):
        try:
            return torch._int_mm(a.contiguous(), b.T)
        except RuntimeError:  # a device kernel with shape limits (e.g. rows <= 16)
            pass
    return (a.double() @ b.double().T).to(torch.int32)


def native_linear(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """The ``native`` semantics in plain torch: ``x [..., K]`` -> ``[..., N]`` in x.dtype.

    W8A8: int8 activations per token, int32 accumulation, then in fp32 ``acc * x_scale *
    w_scale`` (``npu_quant_matmul``'s order; an offset subtracts ``offset * sum(x_q)``
    from the accumulator first). FP8 / MXFP4: e4m3
    activation blocks of 128, products of the quantized operands summed in fp32 with both
    scales applied (what a scaled GEMM computes, up to summation order).
    """
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if w.format == "w8a8":
        xq, xs = dynamic_quant_int8(x2)
        acc = int8_matmul(xq, w.data)  # [T, N] int32
        if w.offset is not None:  # (q - o) . x_q = q . x_q - o * sum(x_q), exact in fp64
            exact = acc.double() - xq.double().sum(-1, keepdim=True) * w.offset.double().reshape(
                1, -1
            )
            acc_f = exact.float()
        else:
            acc_f = acc.float()
        y = acc_f * xs.unsqueeze(-1) * w.scale.float().reshape(1, -1)  # token, then channel
    else:
        xq, xs = act_quant_fp8(x2)
        xd = xq.float() * xs.repeat_interleave(ACT_BLOCK, 1)[:, :k]  # exact in fp32
        y = xd @ w.dequantize_f32().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*lead, -1)


__all__ = [
    "COMPUTE_MODES",
    "E2M1_VALUES",
    "FORMATS",
    "QuantizedWeight",
    "act_quant_fp8",
    "dequant_fp8",
    "dequant_mxfp4",
    "dequant_w8a8",
    "dynamic_quant_int8",
    "int8_matmul",
    "mxfp4_scale_f32",
    "mxfp4_shape_problem",
    "native_linear",
]
