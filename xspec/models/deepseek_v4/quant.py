"""MXFP4 (OCP microscaling FP4) weights: the official DeepSeek-V4-Flash routed experts.

Storage (``expert_dtype: "fp4"`` in config.json), for a linear weight ``W [N, K]``:

* ``X.weight`` int8 ``[N, K/2]``: two e2m1 codes per byte, **low nibble = even column**,
  high nibble = odd column. Code ``c`` (4 bits: sign, 2 exponent, 1 mantissa) means
  :data:`E2M1_VALUES` ``[c]``: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives for 8-15.
* ``X.scale`` ue8m0 (``float8_e8m0fnu``, or its raw bytes as uint8) ``[N, K/32]``: one
  power of two ``2^(byte - 127)`` per 32 consecutive values along K.

``W[n, k] = E2M1_VALUES[code(n, k)] * scale[n, k // 32]``. The decoder lives in
:mod:`xspec.models.quantized` (the op interface: resident weights dequantize per call); it
equals transformers'
``Fp8Dequantize`` FP4 path bit for bit (tests/models/deepseek_v4/test_mxfp4.py).
"""

from __future__ import annotations

import torch

from xspec.models.quantized import (
    E2M1_VALUES,
    dequant_mxfp4,
    mxfp4_shape_problem,
)
from xspec.models.quantized import MXFP4_BLOCK as BLOCK

E2M1_MAX = 6.0
# Midpoints between consecutive non-negative e2m1 values (rounding boundaries).
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

__all__ = ["BLOCK", "E2M1_VALUES", "dequant_mxfp4", "mxfp4_shape_problem", "quant_mxfp4"]


def quant_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` float -> ``(packed int8 [N, K/2], scale float8_e8m0fnu [N, K/32])``.

    Scale: per 32-value block, the smallest power of two ``2^e`` with
    ``max|w_block| / 2^e <= 6`` (e2m1's max), so nothing clips; an all-zero block gets
    ``2^0``; ``e`` is clamped to ue8m0's ``[-127, 127]``. Values: ``w / 2^e`` rounded to
    the nearest e2m1 value, ties to the even code (the OCP MX rule: 0.25 -> 0,
    0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). So a representable
    ``w`` (an e2m1 value times the chosen scale) round-trips exactly, and otherwise
    ``|dequant - w| <= half the local e2m1 step * 2^e`` (at most ``2^e``). Zero, and
    values that round to zero, get the +0 code.
    """
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs K a multiple of {BLOCK}, got w of shape {[n, k]}")
    x = w.to(torch.float32).reshape(n, k // BLOCK, BLOCK)  # [N, K/32, 32]
    amax = x.abs().amax(dim=-1, keepdim=True)  # [N, K/32, 1]
    exp = torch.ceil(torch.log2(amax / E2M1_MAX))
    exp = exp + (amax > E2M1_MAX * torch.exp2(exp)).float()  # log2 rounded down across 2^e
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp)).clamp(-127, 127)
    mag = (x / torch.exp2(exp)).abs()
    bounds = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    down = torch.bucketize(mag, bounds, right=False)  # a tie goes to the lower code
    up = torch.bucketize(mag, bounds, right=True)  # a tie goes to the upper code
    code = torch.where(down % 2 == 0, down, up)  # differ only on a tie: keep the even one
    code = code + 8 * ((x < 0) & (code > 0)).long()  # sign bit; never a -0 code
    pairs = code.reshape(n, k // 2, 2).to(torch.uint8)  # [N, K/2, (even, odd)]
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)
    scale = (exp.squeeze(-1) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)  # [N, K/32]
    return packed, scale
