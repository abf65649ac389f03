"""KV compressors (CSA ratio 4 with overlap, HCA ratio 128) and the lightning indexer.

Per token ``j`` (fp32): ``C_j = wkv(x_j)``, ``Z_j = wgate(x_j) + ape[j % m]``. Entry ``w``
is a per-channel softmax pooling of ``C`` weighted by ``Z``:

* HCA (``m = 128``): over the 128 tokens of window ``w``;
* CSA (``m = 4``, ``coff = 2``): rows carry two series ``[Ca | Cb]``; entry ``w`` pools the
  ``Ca`` half of window ``w-1`` and the ``Cb`` half of window ``w`` (8 rows; window -1 is
  kv 0 / score -inf, i.e. weight 0).

Then ``norm`` (weighted RMSNorm) and RoPE on the last ``qk_rope_head_dim`` dims at the
window start ``w*m`` with the compressed-layer frequencies. Entry ``w`` is emitted when
position ``(w+1)*m - 1`` is processed; query ``t`` may use entries ``w < (t+1) // m``.

Emission is vectorised over every window a forward completes, in every sequence of
the batch at once: one gather from ``cat(row rings, the new rows, a pad row)`` (rows of
windows that began in an earlier forward come from the per-position ring of
:class:`~xspec.models.deepseek_v4.state.CompressorCache`; see ``layout.Emission``).

The indexer (CSA only) owns a compressor at ``index_head_dim`` and scores query ``t``
against its keys: ``I[t, s] = sum_h w[t, h] * relu(q[t, h] . K[s])``; the top
``index_topk`` causal entries are attended. The official Hadamard rotation of indexer
queries/keys is orthogonal, so it leaves ``q . k`` unchanged in exact arithmetic; it
only matters for the FP4 simulation and is omitted here (as in transformers).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.layout import BatchLayout, Emission
from xspec.models.deepseek_v4.mhc import RMSNorm
from xspec.models.deepseek_v4.rope import Rope, rotate
from xspec.models.deepseek_v4.state import CompressorCache, scatter_rows, stack_rings
from xspec.models.ops import REFERENCE_OPS, ModelOps, dense, eager
from xspec.models.resident import float_weight, weight_of


class Compressor(nn.Module):
    """Checkpoint tensors: ``wkv.weight``, ``wgate.weight`` ``[coff*width, d]``,
    ``ape [m, coff*width]`` (fp32), ``norm.weight [width]``."""

    def __init__(
        self,
        args: DeepseekV4Args,
        ratio: int,
        width: int,
        rope: Rope,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.ratio = ratio
        self.width = width
        self.coff = 2 if ratio == 4 else 1
        out = self.coff * width
        self.wkv = nn.Linear(args.hidden_size, out, bias=False, dtype=dtype, device=device)
        self.wgate = nn.Linear(args.hidden_size, out, bias=False, dtype=dtype, device=device)
        self.ape = nn.Parameter(torch.zeros(ratio, out, dtype=torch.float32, device=device))
        self.norm = RMSNorm(width, args.rms_norm_eps, device=device, ops=ops)
        self.rope = rope

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rows: ``x [T, d]``, ``positions [T]`` -> ``kv, score [T, coff*width]`` fp32."""
        return self._project(x, positions % self.ratio)

    def _project(self, x: torch.Tensor, phase: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xf = x.float()  # the official compressor runs in fp32
        kv = F.linear(xf, float_weight(self.wkv).float())
        score = F.linear(xf, float_weight(self.wgate).float()) + self.ape[phase]
        return kv, score

    def rows(self, x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` at ``phase [T]`` (position % ratio) -> ring rows ``[kv | score]``
        ``[T, 2*coff*width]`` fp32."""
        return torch.cat(self._project(x, phase), dim=-1)

    def update(
        self, cache: CompressorCache, kv: torch.Tensor, score: torch.Tensor, start: int
    ) -> None:
        """Append one sequence's rows ``kv, score [S, coff*width]`` of positions
        ``start..start+S-1``: emit every entry they complete, then store the rows."""
        n = kv.shape[0]
        positions = torch.arange(start, start + n, device=kv.device)
        self.emit([cache], torch.cat([kv, score], dim=-1), BatchLayout(positions, [n], [start]))

    def emit(self, caches: list[CompressorCache], rows: torch.Tensor, layout: BatchLayout) -> None:
        """Append ``rows [T, 2*coff*width]`` (from :meth:`rows`) to the caches of the
        live sequences of ``layout``: emit every entry they complete, then store them."""
        stack = stack_rings([c.ring for c in caches])  # [B, ring, C], row b = caches[b]
        plan = layout.emission(self.ratio, self.coff, stack.shape[1])
        if plan is not None:
            entries = self._entries(stack.flatten(0, 1), rows, plan)  # [E, width]
            e0 = 0
            for b, first, n in zip(plan.seqs, plan.firsts, plan.counts):
                caches[b].put_entries(first, entries[e0 : e0 + n])
                e0 += n
        scatter_rows(stack, rows, layout.ring_slots(stack.shape[1]))

    def _entries(self, ring: torch.Tensor, rows: torch.Tensor, plan: Emission) -> torch.Tensor:
        """The entries ``plan`` completes, from the ring rows ``ring [R, C]`` of every live
        sequence and the new ``rows [T, C]``: pooled, normed and roped ``[E, width]``."""
        kernel = eager(self.ops.compress_pool)
        pooled = None
        if kernel is not None:
            pooled = kernel(ring, rows, plan.index, self.ratio, self.coff, self.width)
        if pooled is None:
            pad = torch.full_like(rows[:1], float("-inf"))  # before position 0: kv 0, score -inf
            pad[:, : self.coff * self.width] = 0
            source = torch.cat([ring, rows, pad])
            gathered = source.index_select(0, plan.index.flatten())
            pooled = self.pool(gathered.view(*plan.index.shape, -1))
        key = self.rope.key
        if key not in plan.memo:  # the indexer's compressor and other layers reuse it
            plan.memo[key] = self.rope.rotation(plan.window_starts, plan.limit)
        return rotate(self.norm(pooled), *plan.memo[key], kernel=eager(self.ops.rope))

    def pool(self, rows: torch.Tensor) -> torch.Tensor:
        """Softmax pooling of each entry's window rows (before norm and rope).

        ``rows [E, coff*m, 2*coff*width]`` (``[kv | score]`` of positions
        ``(w-coff+1)*m .. (w+1)*m - 1``) -> ``[E, width]``.
        """
        m, w, cw = self.ratio, self.width, self.coff * self.width
        kv, score = rows[..., :cw], rows[..., cw:]
        if self.coff == 2:  # entry w: Ca of window w-1 (first m rows), Cb of window w
            kv = torch.cat([kv[:, :m, :w], kv[:, m:, w:]], dim=1)  # [E, 2m, w]
            score = torch.cat([score[:, :m, :w], score[:, m:, w:]], dim=1)
        return (kv * score.softmax(dim=1)).sum(dim=1)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer. Checkpoint tensors: ``wq_b.weight
    [index_n_heads*index_head_dim, q_lora_rank]``, ``weights_proj.weight
    [index_n_heads, d]``, ``compressor.*`` (a ratio-4 :class:`Compressor` at index_head_dim)."""

    def __init__(
        self,
        args: DeepseekV4Args,
        rope: Rope,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.topk = args.index_topk
        self.wq_b = nn.Linear(
            args.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype, device=device
        )
        self.weights_proj = nn.Linear(
            args.hidden_size, self.n_heads, bias=False, dtype=dtype, device=device
        )
        self.compressor = Compressor(
            args, 4, self.head_dim, rope, dtype=dtype, device=device, ops=ops
        )
        self.rope = rope

    def queries(
        self, qr: torch.Tensor, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qr [T, q_lora]``, ``x [T, d]`` at rotation ``rot`` (``cos, sin``) -> ``q [T,
        n_heads, head_dim]`` fp32 (roped), head weights ``[T, n_heads]`` fp32."""
        q = dense(self.ops, qr, weight_of(self.wq_b)).view(qr.shape[0], self.n_heads, self.head_dim)
        q = rotate(q, *rot, kernel=eager(self.ops.rope)).float()
        weights = dense(self.ops, x, weight_of(self.weights_proj)).float() * self.n_heads**-0.5
        return q, weights

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, layout: BatchLayout
    ) -> torch.Tensor:
        """Top-k causal entries per query, each row against its own sequence's keys.

        ``q [T, n_heads, head_dim]``, ``weights [T, n_heads]``, ``keys [sum n_b, head_dim]``
        (every live sequence's, concatenated) -> ``[T, min(index_topk, max n_b)]`` int64
        entry ids, -1 = none.
        """
        index = layout.padded_entries(4)  # [B, n]
        b, n = index.shape
        k = min(self.topk, n)
        if k == 0:
            return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        kernel = eager(self.ops.index_topk)
        if kernel is not None:
            scale = self.head_dim**-0.5
            base, visible = layout.entry_base(4), layout.visible(4)
            picks = kernel(q, weights, keys.float(), base, visible, n, k, scale)
            if picks is not None:
                return picks
        # one batched matmul over sequences: [B, S*H, c] x [B, c, n]
        kp = keys.float().index_select(0, index.flatten()).view(b, n, -1)
        qp = layout.padded(q)  # [B, S, H, c]
        dots = torch.matmul(qp.flatten(1, 2), kp.transpose(1, 2))
        dots = layout.unpadded(dots.view(*qp.shape[:3], n))  # [T, H, n]
        scores = F.relu(dots) * self.head_dim**-0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [T, n]
        visible = layout.visible(4)[:, None]  # entries < visible are causal
        future = torch.arange(n, device=q.device)[None, :] >= visible
        # a NaN score (a numerical fault upstream) ranks like a future entry: never selected
        scores = scores.masked_fill(future | scores.isnan(), float("-inf"))
        picks = stable_topk(scores, k)
        # padding (other sequences' keys, or none) is never causal, so never a valid pick;
        # -inf entries only fill the k slots when fewer than k entries are selectable
        never = (picks >= visible) | scores.gather(1, picks).isneginf()
        return picks.masked_fill(never, -1)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries per row, exact ties going to the lower index.

    ``scores [S, n]`` -> ``[S, k]`` int64 in ascending index order. ReLU scores tie at
    exactly 0 often; ``torch.topk`` breaks such ties differently for different row
    lengths, which would make the selection (and the logits) depend on how a sequence
    was chunked. The official top-k leaves ties unspecified, so any fixed rule is valid.
    NaN ranks as -inf (``torch.topk`` would rank it first, and it equals nothing).
    """
    scores = scores.masked_fill(scores.isnan(), float("-inf"))
    kth = scores.topk(k, dim=-1).values[:, -1:]  # [S, 1]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # how many tied entries still fit
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))
    return chosen.nonzero()[:, 1].view(scores.shape[0], k)
