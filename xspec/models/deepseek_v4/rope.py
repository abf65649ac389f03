"""Partial, interleaved RoPE of DeepSeek-V4 (with YaRN on the compressed layers).

RoPE rotates pairs ``(x[2i], x[2i+1])`` of the **last** ``qk_rope_head_dim`` dims of a
head (the layout is ``[nope | rope]``). SWA-only layers use ``rope_theta`` without
scaling; CSA/HCA layers, their compressors and the indexer use ``compress_rope_theta``
with YaRN and **no** attention-factor (mscale) multiply.

YaRN trigger convention: the blend is applied whenever ``rope_scaling`` says ``yarn``
(transformers' convention). The official code applies it only when its run-time
``max_seq_len`` exceeds ``original_max_position_embeddings``; both agree for every
checkpoint whose ``max_position_embeddings`` exceeds the original length (Flash: 1M vs
65536; the tiny config: 4096 vs 256).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.ops import RopeOp


def rope_inv_freq(args: DeepseekV4Args, compressed: bool) -> torch.Tensor:
    """Inverse frequencies ``[rd/2]`` (fp32) for a SWA (False) or compressed (True) layer."""
    dim = args.qk_rope_head_dim
    base = args.compress_rope_theta if compressed else args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    yarn = args.yarn
    if not compressed or yarn is None:
        return 1.0 / pos_freqs
    factor = float(yarn["factor"])
    original = float(yarn["original_max_position_embeddings"])
    beta_fast = yarn.get("beta_fast") or 32
    beta_slow = yarn.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # the rope dim whose wavelength fits `rotations` times into the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: high-frequency dims keep their frequency; 0: divided by `factor`
    # same operation order as transformers' YaRN so both tables agree bit for bit
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


# (frequencies, device) -> (cos, sin) [P, rd] fp32, interleaved as rotate() reads them;
# one table per distinct frequency set (SWA / compressed), shared by every layer
_TABLES: dict[tuple[tuple[float, ...], str], tuple[torch.Tensor, torch.Tensor]] = {}


class Rope(nn.Module):
    """Holds one inverse-frequency table (non-persistent: not a checkpoint tensor).

    ``key`` names the frequency values: layers with equal frequencies share rotation
    tables (and a forward's per-row lookups, see ``BatchLayout.rotation``).
    """

    inv_freq: torch.Tensor

    def __init__(self, inv_freq: torch.Tensor, *, device: torch.device | str = "cpu") -> None:
        """``inv_freq [rd/2]`` (with values: kept as ``key``), placed on ``device``."""
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self._key = tuple(inv_freq.tolist())

    @property
    def key(self) -> tuple[float, ...]:
        """The frequency values."""
        return self._key

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Rope:
        # a module built on the meta device and materialised with to_empty() (resident
        # quantized loading) gets its table back from the values kept at construction
        out = super()._apply(fn, recurse)
        if not self.inv_freq.is_meta:
            with torch.no_grad():
                values = torch.tensor(self._key, dtype=torch.float64)
                self.inv_freq.copy_(values.to(self.inv_freq.dtype))
        return out

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N]`` int -> ``cos, sin [N, rd/2]`` fp32."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def rotation(self, positions: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Factors of :func:`rotate`: ``positions [N]`` (all ``< limit``) -> ``cos, sin
        [N, rd]`` fp32; rope pair ``(2i, 2i+1)`` gets ``cos = (c_i, c_i)``, ``sin =
        (-s_i, s_i)``."""
        cos, sin = self._table(limit)
        return cos[positions], sin[positions]

    def _table(self, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Interleaved ``cos, sin [P >= limit, rd]`` (grown by doubling, never shrunk)."""
        key = (self.key, str(self.inv_freq.device))
        table = _TABLES.get(key)
        if table is None or table[0].shape[0] < limit:
            size = max(limit, 2 * table[0].shape[0] if table else 4096)
            pos = torch.arange(size, dtype=torch.float32, device=self.inv_freq.device)
            cos, sin = self.cos_sin(pos)  # the same product and functions, row by row
            table = (
                cos.repeat_interleave(2, dim=1),
                torch.stack((-sin, sin), dim=-1).flatten(1),
            )
            _TABLES[key] = table
        return table


def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    inverse: bool = False,
    kernel: RopeOp | None = None,
) -> torch.Tensor:
    """RoPE with :meth:`Rope.rotation` factors: ``x [N, ..., D]``, ``cos/sin [N, rd]``.

    ``rope * cos + swap(rope) * sin`` on the last ``rd`` dims, ``swap`` exchanging each
    pair: the same products and sums as :func:`apply_rope`, in fewer whole-tensor ops.
    fp32 math, cast back to ``x.dtype``. ``kernel``: a platform's ``rope`` op
    (``models.ops.RopeOp``), used where it takes the inputs.
    """
    if kernel is not None and (y := kernel(x, cos, sin, inverse)) is not None:
        return y
    rd = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd,)
    cos, sin = cos.view(shape), sin.view(shape)
    rope = x[..., -rd:].float()
    # each pair exchanged (a copy: the same values as flip(-1) on [..., rd/2, 2], faster)
    swapped = torch.stack((rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rope = rope * cos - swapped * sin if inverse else rope * cos + swapped * sin
    return torch.cat([x[..., :-rd], rope.to(x.dtype)], dim=-1)


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, inverse: bool = False
) -> torch.Tensor:
    """Rotate the last ``2*cos.shape[-1]`` dims of ``x`` pairwise.

    ``x [N, ..., D]`` (any dims between N and D broadcast, e.g. heads), ``cos/sin [N, rd/2]``.
    ``inverse`` rotates by the negative angle (the output de-rotation of V = K).
    Computed in fp32 and cast back to ``x.dtype``.
    """
    half = cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.reshape(shape), sin.reshape(shape)
    if inverse:
        sin = -sin
    nope, rope = x[..., : -2 * half], x[..., -2 * half :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)
