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

Emission is vectorised over every window a chunk completes (rows of the chunk itself
plus, for windows that began earlier, rows read back from the per-position ring of
:class:`~xspec.models.deepseek_v4.state.CompressorCache`).

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
from xspec.models.deepseek_v4.mhc import RMSNorm
from xspec.models.deepseek_v4.rope import Rope, apply_rope
from xspec.models.deepseek_v4.state import CompressorCache


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
    ) -> None:
        super().__init__()
        self.ratio = ratio
        self.width = width
        self.coff = 2 if ratio == 4 else 1
        out = self.coff * width
        self.wkv = nn.Linear(args.hidden_size, out, bias=False, dtype=dtype, device=device)
        self.wgate = nn.Linear(args.hidden_size, out, bias=False, dtype=dtype, device=device)
        self.ape = nn.Parameter(torch.zeros(ratio, out, dtype=torch.float32, device=device))
        self.norm = RMSNorm(width, args.rms_norm_eps, device=device)
        self.rope = rope

    def project(
        self, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token rows: ``x [T, d]``, ``positions [T]`` -> ``kv, score [T, coff*width]`` fp32."""
        xf = x.float()  # the official compressor runs in fp32
        kv = F.linear(xf, self.wkv.weight.float())
        score = F.linear(xf, self.wgate.weight.float()) + self.ape[positions % self.ratio]
        return kv, score

    def update(
        self, cache: CompressorCache, kv: torch.Tensor, score: torch.Tensor, start: int
    ) -> None:
        """Append one sequence's rows ``kv, score [S, coff*width]`` of positions
        ``start..start+S-1``: emit every entry they complete, then store the rows."""
        m, end = self.ratio, start + kv.shape[0]
        first, last = start // m, end // m  # new entries: [first, last)
        if last > first:
            begin = (first - self.coff + 1) * m  # first row position the new entries read
            old_kv, old_score = cache.rows(begin, start)
            used = last * m - start  # rows of this chunk inside complete windows
            rows_kv = torch.cat([old_kv, kv[:used]])
            rows_score = torch.cat([old_score, score[:used]])
            pooled = self.pool(rows_kv, rows_score)  # [last-first, width]
            window_starts = torch.arange(first, last, device=kv.device) * m
            cos, sin = self.rope.cos_sin(window_starts)
            cache.put_entries(first, apply_rope(self.norm(pooled), cos, sin))
        cache.write_rows(start, kv, score)

    def pool(self, kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
        """Softmax pooling of consecutive windows.

        ``kv, score [(n + coff - 1) * m, coff*width]`` (for CSA the first window only
        supplies the ``Ca`` half of the first entry) -> ``[n, width]`` fp32.
        """
        m, w = self.ratio, self.width
        kv = kv.view(-1, m, self.coff * w)
        score = score.view(-1, m, self.coff * w)
        if self.coff == 2:  # entry w: Ca of window w-1 (first m rows), Cb of window w
            kv = torch.cat([kv[:-1, :, :w], kv[1:, :, w:]], dim=1)  # [n, 2m, w]
            score = torch.cat([score[:-1, :, :w], score[1:, :, w:]], dim=1)
        return (kv * score.softmax(dim=1)).sum(dim=1)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer. Checkpoint tensors: ``wq_b.weight
    [index_n_heads*index_head_dim, q_lora_rank]``, ``weights_proj.weight
    [index_n_heads, d]``, ``compressor.*`` (a ratio-4 :class:`Compressor` at index_head_dim)."""

    def __init__(
        self, args: DeepseekV4Args, rope: Rope, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.topk = args.index_topk
        self.wq_b = nn.Linear(
            args.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype, device=device
        )
        self.weights_proj = nn.Linear(
            args.hidden_size, self.n_heads, bias=False, dtype=dtype, device=device
        )
        self.compressor = Compressor(args, 4, self.head_dim, rope, dtype=dtype, device=device)
        self.rope = rope

    def queries(
        self, qr: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``qr [T, q_lora]``, ``x [T, d]``, ``cos/sin [T, rd/2]`` ->
        ``q [T, n_heads, head_dim]`` fp32 (roped), head weights ``[T, n_heads]`` fp32."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = apply_rope(q, cos, sin).float()
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, weights

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Top-k causal entries per query.

        ``q [S, n_heads, head_dim]``, ``weights [S, n_heads]``, ``keys [n, head_dim]``,
        ``positions [S]`` -> ``[S, min(index_topk, n)]`` int64 entry ids, -1 = none.
        """
        n = keys.shape[0]
        k = min(self.topk, n)
        if k == 0:
            return torch.empty(q.shape[0], 0, dtype=torch.long, device=q.device)
        scores = F.relu(torch.matmul(q, keys.float().t())) * self.head_dim**-0.5  # [S, H, n]
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [S, n]
        visible = (positions + 1) // 4  # entries < visible are causal
        future = torch.arange(n, device=q.device)[None, :] >= visible[:, None]
        picks = stable_topk(scores.masked_fill(future, float("-inf")), k)
        return torch.where(picks >= visible[:, None], -1, picks)


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries per row, exact ties going to the lower index.

    ``scores [S, n]`` -> ``[S, k]`` int64 in ascending index order. ReLU scores tie at
    exactly 0 often; ``torch.topk`` breaks such ties differently for different row
    lengths, which would make the selection (and the logits) depend on how a sequence
    was chunked. The official top-k leaves ties unspecified, so any fixed rule is valid.
    """
    kth = scores.topk(k, dim=-1).values[:, -1:]  # [S, 1]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # how many tied entries still fit
    chosen = above | (tied & (tied.cumsum(dim=-1) <= room))
    return chosen.nonzero()[:, 1].view(scores.shape[0], k)
