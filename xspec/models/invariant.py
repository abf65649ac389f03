"""Batch-invariant GEMMs: each row's result independent of the rows sharing its call.

A BLAS picks its kernel by the shape of the call. For a row of activations that means
its ``x @ W.T`` can round differently when it shares a GEMM with 1, 3 or 5 other rows
(on the host, MKL serves row counts that are not a multiple of 4 below 12 with other
kernels). Speculative verification scores ``gamma + 1`` rows where decoding without it
scores one, and batching puts other requests' rows beside them, so the target's logits
at one position agree only to ~1e-6 in fp32 across configurations: enough for equal
tokens, not for equal logprobs.

Where a platform's GEMMs are row-invariant once their row count is a multiple of some
``tile`` (:func:`probe_row_tile` finds it), :class:`PaddedRows` pads every GEMM's rows
up to that multiple with zero rows and drops them from the result: every row then goes
through the same kernel with the same reduction order whatever shares its call, and a
model's logits are bit for bit the same under speculation, batching and chunking.
``platform.batch_invariant=true`` turns it on for the target's forward
(:meth:`xspec.models.ops.StepOptions.rows`); its price is the padded rows' arithmetic
and a Python hop per torch call (docs/sampling.md gives the figure).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TILES = (1, 2, 4, 8, 16)
_PROBE_SHAPES = ((64, 96), (512, 256))  # (in, out) of the probed GEMMs
_PROBE_ROWS = 32  # every row count 1..32 against one call of 32 (a multiple of every tile)
_PROBE_LONG = 128  # and the first rows of a long (prefill-sized) call


def _padded(x: torch.Tensor, dim: int, tile: int) -> tuple[torch.Tensor, int]:
    """``x`` with zero rows appended along ``dim`` up to a multiple of ``tile``, and the
    original row count."""
    rows = x.shape[dim]
    extra = -rows % tile
    if extra == 0:
        return x, rows
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim), rows


def _float(*ts: Any) -> bool:
    return all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in ts)


class PaddedRows(TorchFunctionMode):
    """Inside this mode ``F.linear``, ``matmul`` / ``@``, ``mm``, ``addmm``, ``bmm`` and
    ``baddbmm`` on floating-point tensors compute on rows padded to a multiple of
    ``tile`` (see the module docstring); every other call runs as it is. A call with
    ``out=`` runs unpadded (the inference forwards never pass one)."""

    def __init__(self, tile: int) -> None:
        super().__init__()
        if tile < 2:
            raise ValueError(f"PaddedRows needs a tile >= 2 (got {tile})")
        self.tile = tile
        self._padders: dict[Any, Callable[..., torch.Tensor]] = {
            F.linear: self._linear,
            torch.matmul: self._matmul,
            torch.Tensor.matmul: self._matmul,
            torch.Tensor.__matmul__: self._matmul,
            torch.mm: self._matmul,
            torch.Tensor.mm: self._matmul,
            torch.bmm: self._matmul,
            torch.Tensor.bmm: self._matmul,
            torch.addmm: self._add_matmul,
            torch.Tensor.addmm: self._add_matmul,
            torch.baddbmm: self._add_matmul,
            torch.Tensor.baddbmm: self._add_matmul,
            F.scaled_dot_product_attention: self._attention,
        }

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        padder = self._padders.get(func)
        if padder is None or "out" in kwargs:
            return func(*args, **kwargs)
        return padder(func, *args, **kwargs)

    def _linear(
        self, func: Any, x: torch.Tensor, weight: torch.Tensor, bias: Any = None
    ) -> torch.Tensor:
        if x.dim() < 2 or not _float(x, weight):
            return func(x, weight, bias)
        flat, rows = _padded(x.reshape(-1, x.shape[-1]), 0, self.tile)
        y = func(flat, weight, bias)[:rows]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _matmul(self, func: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dim() < 2 or b.dim() < 2 or not _float(a, b):
            return func(a, b)
        pa, rows = _padded(a, a.dim() - 2, self.tile)
        return func(pa, b).narrow(-2, 0, rows)

    def _add_matmul(
        self, func: Any, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, **kw: Any
    ) -> torch.Tensor:
        if not _float(base, a, b):
            return func(base, a, b, **kw)
        out_shape = (*a.shape[:-1], b.shape[-1])
        pa, rows = _padded(a, a.dim() - 2, self.tile)
        pbase, _ = _padded(base.expand(out_shape), a.dim() - 2, self.tile)
        return func(pbase, pa, b, **kw).narrow(-2, 0, rows)

    def _attention(
        self,
        func: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        **kw: Any,
    ) -> torch.Tensor:
        """Several query rows with a causal (prefix) pattern attend one at a time, each to
        exactly the keys it sees, as one row decoding alone does (the fused kernel's
        blocking depends on the row count and the masked keys). Any other mask runs as
        it comes."""
        rows, keys = q.shape[-2], k.shape[-2]
        if rows == 1 or dropout_p or not _float(q, k, v):
            return func(q, k, v, attn_mask, dropout_p, is_causal, **kw)
        seen: list[int] | None = [r + 1 if is_causal else keys for r in range(rows)]
        if attn_mask is not None:
            seen = None if is_causal else _prefix_lengths(attn_mask, rows, keys)
        if seen is None:
            return func(q, k, v, attn_mask, dropout_p, is_causal, **kw)
        out = [
            func(q[..., r : r + 1, :], k[..., :n, :], v[..., :n, :], **kw)
            for r, n in enumerate(seen)
        ]
        return torch.cat(out, dim=-2)


def _prefix_lengths(mask: torch.Tensor, rows: int, keys: int) -> list[int] | None:
    """Per query row, how many leading keys a boolean ``mask [..., rows, keys]`` (the
    same for every batch and head) lets it see, or None where it is no such mask."""
    if mask.dtype != torch.bool or mask.shape[-2:] != (rows, keys):
        return None
    grid = mask.reshape(-1, rows, keys)
    if not bool((grid == grid[:1]).all()):
        return None
    counts = grid[0].sum(dim=-1)
    prefix = torch.arange(keys, device=mask.device)[None, :] < counts[:, None]
    if not torch.equal(prefix, grid[0]):
        return None
    return [int(c) for c in counts.tolist()]


def _rows_invariant(
    device: torch.device, dtype: torch.dtype, tile: int, gen: torch.Generator
) -> bool:
    """Whether every row of ``F.linear`` and ``bmm`` on ``device`` in ``dtype``, padded to
    a multiple of ``tile`` rows, equals that row of a 32-row and of a 128-row call."""
    mode = PaddedRows(tile) if tile > 1 else None
    for k, n in _PROBE_SHAPES:
        w = torch.randn(n, k, generator=gen).to(device, dtype)
        x = torch.randn(_PROBE_LONG, k, generator=gen).to(device, dtype)
        b = torch.randn(2, k, 64, generator=gen).to(device, dtype)
        full = F.linear(x[:_PROBE_ROWS], w)
        if not torch.equal(F.linear(x, w)[:_PROBE_ROWS], full):
            return False
        batched = torch.bmm(x[: 2 * _PROBE_ROWS].view(2, _PROBE_ROWS, k), b)
        for rows in range(1, _PROBE_ROWS):
            with mode if mode is not None else _nothing():
                y = F.linear(x[:rows], w)
                z = torch.bmm(x[: 2 * _PROBE_ROWS].view(2, _PROBE_ROWS, k)[:, :rows], b)
            if not (torch.equal(y, full[:rows]) and torch.equal(z, batched[:, :rows])):
                return False
    return True


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def probe_row_tile(device: torch.device, dtype: torch.dtype) -> int | None:
    """The smallest tile (of :data:`TILES`) whose padding makes ``device``'s ``dtype``
    GEMMs row-invariant (see :func:`_rows_invariant`), or None when none does. Runs a
    few hundred small GEMMs (milliseconds on a host CPU)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tile in TILES:
            if _rows_invariant(device, dtype, tile, gen):
                return tile
    return None
