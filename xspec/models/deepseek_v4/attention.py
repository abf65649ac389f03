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

Projections run on all ``T`` rows at once; the attention itself loops over sequences
(each reads its own caches). The per-query work is ``O(window + selected entries)``.
"""

from __future__ import annotations

import torch
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.compressor import Compressor, Indexer
from xspec.models.deepseek_v4.mhc import RMSNorm, rms_normalize
from xspec.models.deepseek_v4.rope import Rope, apply_rope, rope_inv_freq
from xspec.models.deepseek_v4.state import BlockContext, LayerCache

_QUERY_BLOCK = 256  # queries per gather: bounds the [block, K, D] workspace of long chunks


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, index: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of each query over its own KV rows, with a value-less sink.

    ``q [S, H, D]``, ``kv [N, D]`` (K = V), ``index [S, K]`` rows of ``kv`` per query
    (-1 = unused), ``sink [H]`` -> ``[S, H, D]`` fp32.
    """
    kv = kv.float()
    sink = sink.float().view(1, -1, 1)
    out = []
    for b in range(0, q.shape[0], _QUERY_BLOCK):
        idx = index[b : b + _QUERY_BLOCK]
        rows = kv[idx.clamp(min=0)]  # [B, K, D]
        logits = torch.einsum("shd,skd->shk", q[b : b + _QUERY_BLOCK].float(), rows) * scale
        logits = logits.masked_fill((idx < 0).unsqueeze(1), float("-inf"))
        # the sink joins the softmax denominator only (it has no value row)
        logits = torch.cat([logits, sink.expand(idx.shape[0], -1, 1)], dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
        out.append(torch.einsum("shk,skd->shd", probs, rows))
    return torch.cat(out)


def window_index(num_prev: int, num_new: int, window: int, device: torch.device) -> torch.Tensor:
    """Rows of ``local = cat(previous raw rows, new raw rows)`` that each new query sees.

    Query ``r`` (0-based among ``num_new``) sits at local row ``num_prev + r`` and sees
    the ``window`` rows ending there -> ``[num_new, min(window, num_prev + num_new)]``
    int64, -1 before the sequence start.
    """
    width = min(window, num_prev + num_new)
    first = torch.arange(num_new, device=device) + num_prev - width + 1  # [S]
    index = first[:, None] + torch.arange(width, device=device)[None, :]
    return index.masked_fill(index < 0, -1)


def causal_entries(n: int, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Every compressed entry, -1 where not yet causal: ``positions [S]`` -> ``[S, n]``."""
    ids = torch.arange(n, device=positions.device)[None, :].expand(positions.shape[0], n)
    return ids.masked_fill(ids >= ((positions + 1) // ratio)[:, None], -1)


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
    ) -> None:
        super().__init__()
        h, hd, d = args.num_attention_heads, args.head_dim, args.hidden_size
        self.args = args
        self.compress_ratio = compress_ratio
        self.n_heads, self.head_dim, self.o_groups = h, hd, args.o_groups
        kw = dict(bias=False, dtype=dtype, device=device)
        self.wq_a = nn.Linear(d, args.q_lora_rank, **kw)  # type: ignore[arg-type]
        self.q_norm = RMSNorm(args.q_lora_rank, args.rms_norm_eps, device=device)
        self.wq_b = nn.Linear(args.q_lora_rank, h * hd, **kw)  # type: ignore[arg-type]
        self.wkv = nn.Linear(d, hd, **kw)  # type: ignore[arg-type]
        self.kv_norm = RMSNorm(hd, args.rms_norm_eps, device=device)
        # wo_a is stored [G*o_lora, H*D/G] and applied per group of heads
        self.wo_a = nn.Linear(h * hd // args.o_groups, args.o_groups * args.o_lora_rank, **kw)  # type: ignore[arg-type]
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, d, **kw)  # type: ignore[arg-type]
        self.attn_sink = nn.Parameter(torch.zeros(h, dtype=torch.float32, device=device))
        # SWA-only layers use plain rope_theta; compressed layers (and their compressor and
        # indexer) use compress_rope_theta with YaRN.
        self.rope = Rope(rope_inv_freq(args, compressed=compress_ratio > 0).to(device))
        self.compressor = (
            Compressor(args, compress_ratio, hd, self.rope, dtype=dtype, device=device)
            if compress_ratio
            else None
        )
        self.indexer = (
            Indexer(args, self.rope, dtype=dtype, device=device) if compress_ratio == 4 else None
        )

    def forward(self, x: torch.Tensor, ctx: BlockContext) -> torch.Tensor:
        """``x [T, d]`` (normed block input) -> ``[T, d]``; appends every row to its cache."""
        t = x.shape[0]
        cos, sin = self.rope.cos_sin(ctx.positions)  # [T, rd/2]
        qr = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = self.wq_b(qr).view(t, self.n_heads, self.head_dim)
        q = apply_rope(rms_normalize(q, self.args.rms_norm_eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [T, D]
        # per-token compressor rows (and indexer queries) for all rows at once
        side = self._side_inputs(x, qr, ctx.positions, cos, sin)
        out = torch.empty(t, self.n_heads, self.head_dim, dtype=torch.float32, device=x.device)
        for r0, r1, start, cache in ctx.spans():
            local = torch.cat([cache.window_rows(start), kv[r0:r1]])  # raw rows, [L, D]
            index = window_index(local.shape[0] - (r1 - r0), r1 - r0, cache.window, x.device)
            if self.compressor is not None:
                entries, picks = self._compressed(cache, side, r0, r1, start, ctx.positions[r0:r1])
                picks = torch.where(picks >= 0, picks + local.shape[0], -1)  # rows after `local`
                index = torch.cat([index, picks], dim=1)
                local = torch.cat([local, entries.to(local.dtype)])
            scale = self.head_dim**-0.5
            out[r0:r1] = sparse_attention(q[r0:r1], local, index, self.attn_sink, scale)
            cache.write_window(start, kv[r0:r1])
            cache.advance(r1 - r0)
        out = apply_rope(out.to(x.dtype), cos, sin, inverse=True)
        return self.wo_b(self.grouped_out(out))

    def _side_inputs(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        """Compressor rows ``kv/score [T, coff*D]``, indexer rows ``ikv/iscore`` and
        indexer queries ``iq [T, h, c]`` / head weights ``iw [T, h]`` (whichever exist)."""
        side: dict[str, torch.Tensor] = {}
        if self.compressor is not None:
            side["kv"], side["score"] = self.compressor.project(x, positions)
        if self.indexer is not None:
            side["iq"], side["iw"] = self.indexer.queries(qr, x, cos, sin)
            side["ikv"], side["iscore"] = self.indexer.compressor.project(x, positions)
        return side

    def _compressed(
        self,
        cache: LayerCache,
        side: dict[str, torch.Tensor],
        r0: int,
        r1: int,
        start: int,
        positions: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Emit one sequence's new entries, then pick the ones each query attends.

        Returns ``entries [n, D]`` and ``picks [S, K]`` entry ids (-1 = none): every
        causal entry on HCA layers, the indexer's top-k on CSA layers.
        """
        assert self.compressor is not None and cache.compressor is not None
        self.compressor.update(cache.compressor, side["kv"][r0:r1], side["score"][r0:r1], start)
        entries = cache.compressor.valid_entries()
        if self.indexer is None:
            return entries, causal_entries(entries.shape[0], positions, self.compress_ratio)
        assert cache.indexer is not None
        rows = slice(r0, r1)
        self.indexer.compressor.update(
            cache.indexer, side["ikv"][rows], side["iscore"][rows], start
        )
        keys = cache.indexer.valid_entries()
        return entries, self.indexer.select(side["iq"][rows], side["iw"][rows], keys, positions)

    def grouped_out(self, out: torch.Tensor) -> torch.Tensor:
        """``out [T, H, D]`` -> ``[T, G*o_lora]``: ``wo_a`` applied per group of heads."""
        groups = out.reshape(out.shape[0], self.o_groups, -1)  # [T, G, H*D/G]
        w = self.wo_a.weight.view(self.o_groups, -1, groups.shape[-1])  # [G, o_lora, H*D/G]
        return torch.einsum("tgi,goi->tgo", groups, w).flatten(1)

    def new_cache(self, *, max_rollback: int, max_context: int) -> LayerCache:
        """An empty cache of this layer's kind for one sequence."""
        return LayerCache(
            self.args,
            self.compress_ratio,
            dtype=self.wkv.weight.dtype,
            device=self.wkv.weight.device,
            max_rollback=max_rollback,
            max_context=max_context,
        )
