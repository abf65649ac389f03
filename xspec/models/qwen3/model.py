"""Qwen3 and Qwen3-MoE target models (ragged batches, exact rollback).

Math follows transformers' ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``: pre-norm
decoder, GQA with per-head q/k RMSNorm applied *before* NeoX RoPE, SwiGLU MLP or a
softmax(fp32) -> top-k (-> renormalise) MoE without shared expert. The module tree
mirrors the checkpoint, so ``state_dict`` keys are the Hugging Face tensor names
(``model.layers.3.self_attn.q_proj.weight``; ``lm_head.weight`` absent when tied) and
loading is an identity map.

Batching: projections, norms, MLP and MoE run over all ``T`` rows of a ragged batch at
once; only attention loops over sequences, each attending causally to its cached
tokens plus its new rows.

KV cache: one tensor per sequence, ``kv [L, 2, KV, capacity, hd]``, whose capacity
grows in blocks of ``KV_BLOCK`` tokens and at least doubles (amortised O(1) appends,
no per-step reallocation). Every layer is full attention, so rolling back is just
resetting ``num_tokens``: rows past it are never read and get overwritten.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from xspec.errors import ConfigError, RequestError
from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch, KvBytes, ModelOutput
from xspec.models.ops import EAGER_STEPS, StepOptions
from xspec.models.qwen3.args import Qwen3Args

KV_BLOCK = 16  # cache capacity granularity (tokens)


@dataclass(eq=False)
class Qwen3State:
    """One sequence's decoding state."""

    num_tokens: int  # tokens held == position of the next row
    kv: torch.Tensor  # [L, 2, KV, capacity, hd]; rows >= num_tokens are stale
    max_tokens: int | None = None  # growth cap (the engine's reservation); None: max_context

    @property
    def capacity(self) -> int:
        return self.kv.shape[3]

    def nbytes_allocated(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def reserve(self, needed: int, max_context: int) -> None:
        """Grow the KV buffer to hold ``needed`` tokens (blocks, at least doubling), never
        past ``max_tokens`` / ``max_context`` unless ``needed`` itself is larger."""
        if needed <= self.capacity:
            return
        blocks = -(-max(needed, 2 * self.capacity) // KV_BLOCK)
        limit = min(max_context, self.max_tokens or max_context)
        capacity = min(blocks * KV_BLOCK, max(limit, needed))
        kv = self.kv.new_empty(*self.kv.shape[:3], capacity, self.kv.shape[4])
        kv[:, :, :, : self.num_tokens] = self.kv[:, :, :, : self.num_tokens]
        self.kv = kv

    def snapshot(self, start: int) -> KvRows:
        """A copy of the K/V rows of positions ``start .. num_tokens - 1`` (full attention
        keeps nothing else)."""
        return KvRows(self.kv[:, :, :, start : self.num_tokens].clone(), self.num_tokens)

    def restore(self, chain: Sequence[KvRows], max_context: int) -> None:
        """Hold the rows of ``chain`` (consecutive blocks from position 0); the state must
        be empty."""
        if self.num_tokens:
            raise ValueError(f"restore into a state holding {self.num_tokens} tokens")
        end = chain[-1].end if chain else 0
        self.reserve(end, max_context)
        if chain:
            self.kv[:, :, :, :end] = torch.cat([c.rows for c in chain], dim=3)
        self.num_tokens = end


@dataclass(frozen=True, eq=False)
class KvRows:
    """A prefix-cache snapshot of a :class:`Qwen3State`: the K/V rows of one block."""

    rows: torch.Tensor  # [L, 2, KV, n, hd]
    end: int  # tokens the state held when it was taken

    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class RMSNorm(nn.Module):
    """transformers' order: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> same
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(args: Qwen3Args) -> tuple[torch.Tensor, float]:
    """(inv_freq [hd/2] fp32, cos/sin scale) for the configured RoPE type."""
    dim, base = args.head_dim, args.rope_theta
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim  # [hd/2]
    inv_freq = 1.0 / (base**exponents)
    scaling = args.rope_scaling or {"rope_type": "default"}
    kind = scaling["rope_type"]
    if kind == "default":
        return inv_freq, 1.0
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor, 1.0
    return _yarn(scaling, dim, base, factor)


def _yarn(scaling: dict, dim: int, base: float, factor: float) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: ramp-blend interpolated and
    extrapolated frequencies between the beta_fast / beta_slow rotation counts."""
    orig = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    attn = scaling.get("attention_factor")
    if attn is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attn = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp  # 1 = keep the original (high-frequency) dims
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attn)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, 1, hd] in ``dtype`` (computed in fp32)."""
    freqs = positions[:, None].float() * inv_freq  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE. x [T, heads, hd]; cos/sin [T, 1, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        d, hd = args.hidden_size, args.head_dim
        self.q_proj = nn.Linear(d, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, args.rms_norm_eps)
        self.k_norm = RMSNorm(hd, args.rms_norm_eps)

    def project_q(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``x [T, d]``, cos/sin ``[T, 1, hd]`` -> RoPE(q_norm(q)) ``[T, H, hd]``."""
        q = self.q_norm(self.q_proj(x).view(x.shape[0], self.heads, self.head_dim))
        return apply_rope(q, *rope)

    def project_kv(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]``, cos/sin ``[T, 1, hd]`` -> (RoPE(k_norm(k)), v), each ``[T, KV, hd]``.
        Block drafters also project the target's context features through this."""
        T, hd = x.shape[0], self.head_dim
        k = apply_rope(self.k_norm(self.k_proj(x).view(T, self.kv_heads, hd)), *rope)
        return k, self.v_proj(x).view(T, self.kv_heads, hd)

    def forward(
        self,
        x: torch.Tensor,  # [T, d] normed residual
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, hd]
        batch: ForwardBatch,
        layer: int,
    ) -> torch.Tensor:  # [T, d]
        T, hd = x.shape[0], self.head_dim
        q = self.project_q(x, rope)
        k, v = self.project_kv(x, rope)
        out = torch.empty_like(q)  # [T, H, hd]
        start = 0
        for n, state in zip(batch.seq_lens, batch.states):
            if n:
                rows = slice(start, start + n)
                out[rows] = _attend_cached(q[rows], k[rows], v[rows], state, layer)
            start += n
        return self.o_proj(out.view(T, self.heads * hd))


def _attend_cached(
    q: torch.Tensor,  # [n, H, hd] new rows of one sequence
    k: torch.Tensor,  # [n, KV, hd]
    v: torch.Tensor,  # [n, KV, hd]
    state: Qwen3State,
    layer: int,
) -> torch.Tensor:  # [n, H, hd]
    """Append k/v at positions num_tokens.. and attend causally over the whole cache."""
    n, past = q.shape[0], state.num_tokens
    end = past + n
    cache = state.kv[layer]  # [2, KV, cap, hd]
    cache[0, :, past:end] = k.transpose(0, 1)
    cache[1, :, past:end] = v.transpose(0, 1)
    keys, values = cache[0, None, :, :end], cache[1, None, :, :end]  # [1, KV, S, hd]
    mask = None
    if n > 1:  # row i (position past+i) sees keys 0..past+i; one row sees everything
        key_pos = torch.arange(end, device=q.device)
        mask = key_pos[None, :] <= past + torch.arange(n, device=q.device)[:, None]  # [n, S]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
    )  # [1, H, n, hd]; default scale head_dim**-0.5 as in transformers
    return out[0].transpose(0, 1)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, d]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Top-k routed experts, no shared expert (Qwen3-MoE)."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(args.hidden_size, args.moe_intermediate_size) for _ in range(args.num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, d] -> (weights [T, k] in x.dtype, expert ids [T, k])."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, d] -> [T, d]
        weights, ids = self.route(x)
        flat = ids.flatten()  # [T*k]; slot s belongs to token s // k
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                slots = order[start : start + count]
                tokens = slots // self.top_k
                y = expert(x[tokens]) * weights.flatten()[slots, None]
                out.index_add_(0, tokens, y)
            start += count
        return out


class DecoderLayer(nn.Module):
    def __init__(self, args: Qwen3Args, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp: nn.Module = (
            SparseMoe(args)
            if args.layer_is_sparse(index)
            else MLP(args.hidden_size, args.intermediate_size)
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(
        self,
        h: torch.Tensor,  # [T, d] residual
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [T, 1, hd]
        batch: ForwardBatch,
        layer: int,
    ) -> torch.Tensor:  # [T, d]; out of place, so earlier residuals stay valid captures
        h = h + self.self_attn(self.input_layernorm(h), rope, batch, layer)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """The ``model.*`` part of the checkpoint."""

    def __init__(self, args: Qwen3Args) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Qwen3Model(nn.Module):
    """A :class:`~xspec.models.base.TargetModel` for Qwen3 / Qwen3-MoE.

    Parameters are allocated uninitialised on ``device``; fill them with
    ``init_random_`` or ``xspec.models.loading.load_params`` (see ``load_model``).
    ``device="meta"`` builds a shape-only model (no memory).
    """

    checkpoint_dir: Path | None = None  # set by load_model: tokenizer.json, drafters beside it
    steps: StepOptions = EAGER_STEPS  # the family's loader sets the platform's (row padding)

    def __init__(
        self,
        args: Qwen3Args,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_context: int | None = None,
    ) -> None:
        super().__init__()
        limit = args.max_position_embeddings
        if max_context is not None and not 1 <= max_context <= limit:
            raise ConfigError(
                f"model.max_context={max_context} must be between 1 and the checkpoint's "
                f"max_position_embeddings ({limit}); lower model.max_context or leave it null"
            )
        self.args = args
        self.vocab_size, self.hidden_size = args.vocab_size, args.hidden_size
        self.num_layers = args.num_hidden_layers
        self.max_context = max_context or limit
        with torch.device("meta"):  # no host memory, no init kernels: weights come later
            self.model = Backbone(args)
            self.lm_head = (
                None
                if args.tie_word_embeddings
                else nn.Linear(args.hidden_size, args.vocab_size, bias=False)
            )
        self.to(dtype)
        if torch.device(device).type != "meta":
            self.to_empty(device=device)
        inv_freq, self.rope_scale = rope_inv_freq(args)
        self.inv_freq = inv_freq.to(
            device
        )  # [hd/2] fp32; a plain tensor so .to(dtype) keeps it fp32

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # -- TargetModel -------------------------------------------------------------------

    def kv_bytes(self) -> KvBytes:
        """Full attention: K and V of every layer per token, nothing fixed."""
        a = self.args
        es = torch.empty(0, dtype=self.dtype).element_size()
        return KvBytes(0, float(self.num_layers * 2 * a.num_key_value_heads * a.head_dim * es))

    def new_state(self, max_tokens: int | None = None) -> Qwen3State:
        a = self.args
        kv = torch.empty(
            self.num_layers,
            2,
            a.num_key_value_heads,
            0,
            a.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        return Qwen3State(num_tokens=0, kv=kv, max_tokens=max_tokens)

    @property
    def prefix_granularity(self) -> int:
        return 1  # K/V rows: any boundary

    def snapshot(self, state: Qwen3State, start: int) -> KvRows:
        return state.snapshot(start)

    def restore(self, state: Qwen3State, chain: Sequence[KvRows]) -> None:
        state.restore(chain, self.max_context)

    def truncate(self, state: Qwen3State, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens; full attention needs nothing else reset."""
        if not 0 <= num_tokens <= state.num_tokens:
            raise ValueError(
                f"cannot truncate a state of {state.num_tokens} tokens to {num_tokens}"
            )
        state.num_tokens = num_tokens

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> ModelOutput:
        with self.steps.rows():  # batch-invariant GEMMs where the platform pads rows
            return self._forward(batch)

    def _forward(self, batch: ForwardBatch) -> ModelOutput:
        ids = batch.input_ids.to(self.device)  # [T]
        self._check_batch(batch, ids)
        snapshot_at = [self._snapshot_index(p) for p in batch.capture]
        for n, state in zip(batch.seq_lens, batch.states):
            self._reserve(state, state.num_tokens + n)
        rope = self._rope(batch.positions().to(self.device))
        h = self.model.embed_tokens(ids)  # [T, d]
        snaps: dict[int, torch.Tensor] = {}  # residual entering layer i (i == L: final)
        for i, layer in enumerate(self.model.layers):
            if i in snapshot_at:
                snaps[i] = h
            h = layer(h, rope, batch, i)
        snaps[self.num_layers] = h
        for n, state in zip(batch.seq_lens, batch.states):
            state.num_tokens += n
        head = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(self.model.norm(batch.scored(h)), head).float()  # [T', V]
        aux = torch.cat([snaps[i] for i in snapshot_at], dim=-1) if snapshot_at else None
        return ModelOutput(logits=logits, hidden=h, aux_hidden=aux)

    # -- helpers -----------------------------------------------------------------------

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)

    def _snapshot_index(self, point: CapturePoint) -> int:
        """INPUT of layer l is residual l; OUTPUT of layer l is residual l+1."""
        L = self.num_layers
        index = point.layer if point.site == CaptureSite.INPUT else point.layer + 1
        if point.layer < 0 or not 0 <= index <= L:
            raise ConfigError(
                f"capture point (layer={point.layer}, site={point.site.value}) is outside this "
                f"{L}-layer model (OUTPUT: layers 0..{L - 1}; INPUT: 0..{L}); check the "
                "drafter's target layer ids"
            )
        return index

    def _check_batch(self, batch: ForwardBatch, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise RequestError(
                f"token ids must lie in 0..{self.vocab_size - 1} (vocab_size), got "
                f"min {int(ids.min())} max {int(ids.max())}; check the tokenizer matches the model"
            )
        for i, (n, state) in enumerate(zip(batch.seq_lens, batch.states)):
            if state.num_tokens + n > self.max_context:
                raise RequestError(
                    f"sequence {i} would hold {state.num_tokens + n} tokens, more than "
                    f"max_context={self.max_context}; shorten the prompt / max_new_tokens or "
                    "raise model.max_context"
                )

    def _reserve(self, state: Qwen3State, needed: int) -> None:
        state.reserve(needed, self.max_context)

    @torch.no_grad()
    def init_random_(self, seed: int = 0) -> Qwen3Model:
        """Deterministic, well-conditioned random weights (same values on any device/dtype).

        Linear weights ~ N(0, 1/fan_in) keep activations O(1); norms are 1 + N(0, 0.1^2)
        so they are not the identity; embedding / head scale 2/sqrt(d) gives logits of
        standard deviation ~2 (peaked enough to be meaningful, far from one-hot).
        """
        gen = torch.Generator().manual_seed(seed)
        d = self.hidden_size
        for name, p in self.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                values = 1.0 + 0.1 * noise
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                values = noise * (2.0 / math.sqrt(d))
            else:
                values = noise / math.sqrt(p.shape[-1])
            p.copy_(values)
        return self
