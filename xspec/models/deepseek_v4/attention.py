"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries.

Per row ``x`` (the ``attn_norm`` output):

1. ``qr = q_norm(wq_a(x))``; ``q = wq_b(qr)`` as ``[H, D]``, unweighted per-head RMS
   normalisation, RoPE on the last ``rd`` dims.
2. ``kv = kv_norm(wkv(x))`` (``[D]``, RoPE'd): one row that is both K and V for every head.
3. Each query attends a set of KV rows: the raw window (positions ``t-window+1..t``),
   plus on HCA layers every causal compressed entry and on CSA layers the indexer's
   top-k entries. One softmax over the union, with a per-head ``attn_sink`` logit in the
   denominator only; ``scale = D**-0.5``.
4. Inverse RoPE on the output's rope dims at the query position (V carries rotated dims).
5. Grouped low-rank output: ``wo_a`` per group of heads, then ``wo_b``.

Everything runs on all ``T`` rows of the ragged batch at once, with index tensors that
the whole forward shares (``layout.BatchLayout``). Decode / verify rows first write
their K=V rows into the sequences' SWA rings (batch-stacked, see ``state.stack_rings``),
then :func:`sparse_attention` gathers each query's window rows from the rings and its
compressed entries from the concatenated entries of all sequences: one call per layer
for the whole batch, ``O(window + selected entries)`` per query. Prefill chunks, long
enough to evict rows their own window needs, use :func:`banded_attention` instead:
dense matmuls over each sequence's contiguous window rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.compressor import Compressor, Indexer
from xspec.models.deepseek_v4.layout import BatchLayout
from xspec.models.deepseek_v4.mhc import RMSNorm, rms_normalize
from xspec.models.deepseek_v4.rope import Rope, rope_inv_freq, rotate
from xspec.models.deepseek_v4.state import (
    BlockContext,
    CompressorCache,
    LayerCache,
    scatter_rows,
    stack_rings,
)
from xspec.models.ops import REFERENCE_OPS, ModelOps, SparseAttentionOp, eager, linear
from xspec.models.resident import float_weight, weight_of

_QUERY_BLOCK = 256  # queries per gather: bounds the [block, K, D] workspace of long chunks


def sparse_attention(
    q: torch.Tensor,
    parts: list[tuple[torch.Tensor, torch.Tensor]],
    sink: torch.Tensor,
    scale: float,
    kernel: SparseAttentionOp | None = None,
) -> torch.Tensor:
    """Attention of each query over its own KV rows, with a value-less sink.

    ``q [S, H, D]``; ``parts``: ``(kv [N, D], index [S, K])`` pairs (K = V; ``index``
    rows of ``kv`` per query, -1 = unused), whose selected rows are attended as one set;
    ``sink [H]`` -> ``[S, H, D]`` fp32. ``kernel``: the platform's ``sparse_attention``
    op (same arguments; it answers None where it does not take them).
    """
    if kernel is not None and (fused := kernel(q, parts, sink, scale)) is not None:
        return fused
    sink = sink.float().view(1, -1, 1)
    out = []
    for b in range(0, q.shape[0], _QUERY_BLOCK):
        gathered = [_gather(kv, index[b : b + _QUERY_BLOCK]) for kv, index in parts]
        rows = torch.cat([g[0] for g in gathered], dim=1) if len(parts) > 1 else gathered[0][0]
        mask = torch.cat([g[1] for g in gathered], dim=2) if len(parts) > 1 else gathered[0][1]
        qb = q[b : b + _QUERY_BLOCK].float()
        logits = torch.baddbmm(mask, qb, rows.transpose(1, 2), alpha=scale)  # [B, H, K]
        # the sink joins the softmax denominator only (it has no value row)
        logits = torch.cat([logits, sink.expand(qb.shape[0], -1, 1)], dim=-1)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        out.append(torch.matmul(probs, rows))
    return torch.cat(out) if len(out) > 1 else out[0]


def banded_attention(
    q: torch.Tensor,
    local: list[torch.Tensor],
    layout: BatchLayout,
    window: int,
    extra: tuple[torch.Tensor, torch.Tensor] | None,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """:func:`sparse_attention` for long chunks, as dense matmuls per block of queries.

    ``q [T, H, D]``; ``local[b] [P_b + n_b, D]``: the ``P_b`` raw rows before live
    sequence ``b``'s chunk that its first query sees, then its ``n_b`` new rows;
    ``extra``: the compressed ``(entries, index [T, K])`` part or None -> ``[T, H, D]``
    fp32. A block of queries attends the contiguous key rows its windows span, masked
    to the band: one GEMM instead of a per-query gather, at the price of at most
    ``(block + window) / window`` times the needed products.
    """
    sink = sink.float().view(1, -1, 1)
    # per sequence views (split, not slices of all T rows: under autograd a slice's
    # backward writes a [T, ...] gradient, B of them per layer); blocks joined by one cat
    seqs = q.split(layout.lens)
    picks = extra[1].split(layout.lens) if extra is not None else None
    blocks = []
    for b, (keys, n) in enumerate(zip(local, layout.lens)):
        prev, keys = keys.shape[0] - n, keys.float()
        for q0 in range(0, n, _QUERY_BLOCK):
            q1 = min(n, q0 + _QUERY_BLOCK)
            k0, k1 = max(0, prev + q0 - window + 1), prev + q1  # key rows the block spans
            band = keys[k0:k1]  # [L, D]
            qb = seqs[b][q0:q1].float()  # [S, H, D]
            logits = [
                torch.matmul(qb, band.t()) * scale
                + _band_mask(prev + q0 - k0, q1 - q0, k1 - k0, window, q.device)
            ]
            if extra is not None and picks is not None:
                ent, mask = _gather(extra[0], picks[b][q0:q1])  # [S, K, D], [S, 1, K]
                logits.append(torch.baddbmm(mask, qb, ent.transpose(1, 2), alpha=scale))
            # the sink joins the softmax denominator only (it has no value row)
            logits.append(sink.expand(qb.shape[0], -1, 1))
            probs = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
            o = torch.matmul(probs[..., : k1 - k0], band)
            blocks.append(o if extra is None else torch.baddbmm(o, probs[..., k1 - k0 : -1], ent))
    if not blocks:
        return q.new_empty(q.shape, dtype=torch.float32)
    return torch.cat(blocks) if len(blocks) > 1 else blocks[0]


def _gather(kv: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv [N, D]``, ``index [S, K]`` (-1 = none) -> rows ``[S, K, D]`` fp32 and the
    additive mask ``[S, 1, K]`` (0 or -inf). index_select is far cheaper than advanced
    indexing; a -1 reads row 0, which the mask removes."""
    rows = kv.index_select(0, index.clamp(min=0).flatten()).view(*index.shape, kv.shape[-1])
    return rows.float(), torch.where(index < 0, float("-inf"), 0.0).unsqueeze(1)


def _band_mask(
    first: int, queries: int, keys: int, window: int, device: torch.device
) -> torch.Tensor:
    """``[S, 1, L]`` additive mask: query ``i`` (at key row ``first + i``) sees key rows
    ``first + i - window + 1 .. first + i``."""
    lag = torch.arange(first, first + queries, device=device)[:, None] - torch.arange(
        keys, device=device
    )
    return torch.where((lag < 0) | (lag >= window), float("-inf"), 0.0).unsqueeze(1)


class Attention(nn.Module):
    """Checkpoint tensors (``layers.{i}.attn.``): ``wq_a, q_norm, wq_b, wkv, kv_norm,
    wo_a, wo_b, attn_sink``, plus ``compressor.*`` (ratio 4/128) and ``indexer.*`` (4)."""

    def __init__(
        self,
        args: DeepseekV4Args,
        compress_ratio: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        h, hd, d = args.num_attention_heads, args.head_dim, args.hidden_size
        self.args = args
        self.ops = ops
        self.dtype = dtype  # the linears may hold quantized storage (models.resident)
        self.compress_ratio = compress_ratio
        self.n_heads, self.head_dim, self.o_groups = h, hd, args.o_groups
        kw = dict(bias=False, dtype=dtype, device=device)
        self.wq_a = nn.Linear(d, args.q_lora_rank, **kw)  # type: ignore[arg-type]
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, device=device, ops=ops)
        self.wq_b = nn.Linear(args.q_lora_rank, h * hd, **kw)  # type: ignore[arg-type]
        self.wkv = nn.Linear(d, hd, **kw)  # type: ignore[arg-type]
        self.kv_norm = RMSNorm(hd, args.rms_norm_eps, device=device, ops=ops)
        # wo_a is stored [G*o_lora, H*D/G] and applied per group of heads
        self.wo_a = nn.Linear(h * hd // args.o_groups, args.o_groups * args.o_lora_rank, **kw)  # type: ignore[arg-type]
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, d, **kw)  # type: ignore[arg-type]
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32, device=device))
        # SWA-only layers use plain rope_theta; compressed layers (and their compressor and
        # indexer) use compress_rope_theta with YaRN.
        self.rope = Rope(rope_inv_freq(args, compressed=compress_ratio > 0), device=device)
        self.compressor = (
            Compressor(args, compress_ratio, hd, self.rope, dtype=dtype, device=device, ops=ops)
            if compress_ratio
            else None
        )
        self.indexer = (
            Indexer(args, self.rope, dtype=dtype, device=device, ops=ops)
            if compress_ratio == 4
            else None
        )

    def forward(
        self, x: torch.Tensor, ctx: BlockContext, steps: Any = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x [T, d]`` (normed block input) -> the attention result ``[T, H, D]`` fp32
        (before :meth:`output`) and the rows' rotation; appends every row to its cache.
        ``steps``: where :meth:`project` runs (compiled or not; None = here)."""
        caches, layout = ctx.live_caches(), ctx.layout()
        rot = layout.rotation(self.rope)  # cos, sin [T, rd]
        if not caches:  # no rows at all
            return x.new_zeros(x.shape[0], self.n_heads, self.head_dim, dtype=torch.float32), rot
        phase = layout.phase(self.compress_ratio) if self.compressor is not None else None
        project = steps.project if steps is not None else Attention.project
        proj = project(self, x, rot[0], rot[1], phase)
        extra = self._compressed(proj, caches, layout) if self.compressor is not None else None
        q, kv = proj.q, proj.kv
        swa = stack_rings([c.swa_ring for c in caches])  # [B, R, D], row b = caches[b]
        ring, window = swa.shape[1], caches[0].window
        sink, scale = self.attn_sink, self.head_dim**-0.5
        if max(layout.lens) <= ring - window + 1:
            # decode / verify: the new rows cannot evict a window row, so they go into the
            # rings first and every query gathers its window from the rings
            scatter_rows(swa, kv, layout.ring_slots(ring))
            parts = [(swa.flatten(0, 1), layout.window_index(ring, window))]
            parts += [extra] if extra else []
            out = sparse_attention(q, parts, sink, scale, eager(self.ops.sparse_attention))
        else:  # prefill chunks: dense blocks over each sequence's contiguous window rows
            local = [
                torch.cat([swa[b].index_select(0, slots), rows])
                for b, (slots, rows) in enumerate(
                    zip(layout.earlier_slots(ring, window), kv.split(layout.lens))
                )
            ]
            scatter_rows(swa, kv, layout.ring_slots(ring))
            out = banded_attention(q, local, layout, window, extra, sink, scale)
        for cache, n in zip(caches, layout.lens):
            cache.advance(n)
        return out, rot

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, phase: torch.Tensor | None
    ) -> Projected:
        """Every per-row projection of the normed input ``x [T, d]`` (stateless; rows at
        rotation ``cos, sin`` and compressor ``phase = position % ratio``)."""
        rot = (cos, sin)
        qr, q = self.query(x, rot)
        kv = self.key_value(x, rot)
        comp = index_rows = index_q = index_w = None
        if self.compressor is not None:
            assert phase is not None
            comp = self.compressor.rows(x, phase)
        if self.indexer is not None:
            assert phase is not None
            index_rows = self.indexer.compressor.rows(x, phase)
            index_q, index_w = self.indexer.queries(qr, x, rot)
        return Projected(q, kv, comp, index_rows, index_q, index_w)

    def query(
        self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]`` -> (``qr [T, q_lora]``, the indexer's input; roped ``q [T, H, D]``)."""
        ops = self.ops
        qr = self.q_norm(linear(ops, x, weight_of(self.wq_a)))
        q = linear(ops, qr, weight_of(self.wq_b)).view(x.shape[0], self.n_heads, self.head_dim)
        q = rms_normalize(q, self.args.rms_norm_eps, ops)
        return qr, rotate(q, *rot, kernel=eager(ops.rope))

    def key_value(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, d]`` -> the shared, roped K=V row of each input ``[T, D]``."""
        kv = self.kv_norm(linear(self.ops, x, weight_of(self.wkv)))
        return rotate(kv, *rot, kernel=eager(self.ops.rope))

    def output(
        self, out: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype
    ) -> torch.Tensor:
        """Attention result ``out [T, H, D]`` -> ``[T, d]``: inverse RoPE at the query
        positions (V carries rotated dims), then the grouped low-rank output."""
        out = rotate(out.to(dtype), *rot, inverse=True, kernel=eager(self.ops.rope))
        return linear(self.ops, self.grouped_out(out), weight_of(self.wo_b))

    def _compressed(
        self, proj: Projected, caches: list[LayerCache], layout: BatchLayout
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Emit the batch's new entries, then pick the ones each query attends.

        Returns ``entries [sum n_b, D]`` (every live sequence's, concatenated) and
        ``[T, K]`` rows of it per query (-1 = none): every causal entry on HCA layers,
        the indexer's top-k on CSA layers.
        """
        assert self.compressor is not None and proj.comp_rows is not None
        comps = _present([c.compressor for c in caches])
        self.compressor.emit(comps, proj.comp_rows, layout)
        source = _concat([c.valid_entries() for c in comps])
        ratio = self.compress_ratio
        if self.indexer is None:
            return source, layout.causal_entries(ratio)
        assert proj.index_rows is not None and proj.index_q is not None
        assert proj.index_w is not None
        keys = _present([c.indexer for c in caches])
        self.indexer.compressor.emit(keys, proj.index_rows, layout)
        entries = _concat([c.valid_entries() for c in keys])
        picks = self.indexer.select(proj.index_q, proj.index_w, entries, layout)
        return source, layout.picked_entries(ratio, picks)

    def grouped_out(self, out: torch.Tensor) -> torch.Tensor:
        """``out [T, H, D]`` -> ``[T, G*o_lora]``: ``wo_a`` applied per group of heads."""
        groups = out.reshape(out.shape[0], self.o_groups, -1).transpose(0, 1)  # [G, T, H*D/G]
        w = float_weight(self.wo_a).view(self.o_groups, -1, groups.shape[-1])  # [G, o_lora, H*D/G]
        return torch.bmm(groups, w.transpose(1, 2)).transpose(0, 1).flatten(1)

    def new_cache(self, *, max_rollback: int, max_context: int) -> LayerCache:
        """An empty cache of this layer's kind for one sequence."""
        return LayerCache(
            self.args,
            self.compress_ratio,
            dtype=self.dtype,
            device=self.attn_sink.device,
            max_rollback=max_rollback,
            max_context=max_context,
        )


class Projected(NamedTuple):
    """:meth:`Attention.project` of a batch's rows: roped queries ``q [T, H, D]`` and
    K=V rows ``kv [T, D]``; on compressed layers the compressor's ring rows, and on CSA
    layers the indexer compressor's rows, its roped queries and head weights."""

    q: torch.Tensor
    kv: torch.Tensor
    comp_rows: torch.Tensor | None
    index_rows: torch.Tensor | None
    index_q: torch.Tensor | None
    index_w: torch.Tensor | None


def _concat(rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-sequence ``[n_b, C]`` tensors as one ``[sum n_b, C]`` (no copy for one)."""
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _present(caches: list[CompressorCache | None]) -> list[CompressorCache]:
    """The compressor caches of a compressed layer (a cache of another kind is a bug)."""
    if any(c is None for c in caches):
        raise ValueError("a cache without compressor state was passed to a compressed layer")
    return caches  # type: ignore[return-value]
