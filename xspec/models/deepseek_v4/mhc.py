"""Norms and the mHC residual (Manifold-Constrained Hyper-Connections) of DeepSeek-V4.

The residual is ``hc_mult`` parallel streams ``X [T, hc, d]``. Around each sub-block
(attention, FFN) a tiny perceptron over the RMS-normalised flattened streams yields
``pre [hc]`` (collapse weights), ``post [hc]`` (expand weights) and ``comb [hc, hc]``,
which Sinkhorn-Knopp makes doubly stochastic so the residual mixing cannot blow up:

    u = sum_i pre_i X_i                      (block input, [d])
    X'_j = post_j * f(u) + sum_i comb[i, j] X_i  (note: the sum runs over comb's FIRST index)

The final ``hc_head`` collapses the streams with sigmoid weights (no Sinkhorn). The mHC
tensors (``hc_*_fn/base/scale``) are fp32 and all of this runs in fp32, as officially.
The checkpoint stores them as plain tensors on the owning module (``layers.{i}.hc_attn_fn``,
``hc_head_fn``), hence free functions over parameters rather than submodules.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.ops import REFERENCE_OPS, ModelOps, eager


class RMSNorm(nn.Module):
    """Weighted RMSNorm; weight fp32, math in fp32, output cast back to the input dtype.
    ``ops.rms_norm``: the platform's op, where it takes the input."""

    def __init__(
        self,
        dim: int,
        eps: float,
        device: torch.device | str = "cpu",
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = eager(self.ops.rms_norm)
        if kernel is not None and (y := kernel(x, self.weight, self.eps)) is not None:
            return y
        # F.rms_norm is the same x * rsqrt(mean(x^2) + eps) * weight, as one op
        return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float, ops: ModelOps = REFERENCE_OPS) -> torch.Tensor:
    """Unweighted RMS normalisation over the last dim (same dtype as ``x``)."""
    kernel = eager(ops.rms_norm)
    if kernel is not None and (y := kernel(x, None, eps)) is not None:
        return y
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], eps=eps)
    # lower precision: the rsqrt is rounded to x.dtype before the product (as before)
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def new_hc_params(
    args: DeepseekV4Args, *, head: bool, device: torch.device | str = "cpu"
) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """Fresh ``(fn, base, scale)`` fp32 parameters of one mHC site.

    Block site: ``fn [(2+hc)*hc, hc*d]``, ``base [(2+hc)*hc]``, ``scale [3]``.
    Head (``head=True``): ``fn [hc, hc*d]``, ``base [hc]``, ``scale [1]``.
    """
    hc, d = args.hc_mult, args.hidden_size
    rows = hc if head else (2 + hc) * hc
    return (
        nn.Parameter(torch.zeros(rows, hc * d, dtype=torch.float32, device=device)),
        nn.Parameter(torch.zeros(rows, dtype=torch.float32, device=device)),
        nn.Parameter(torch.ones(1 if head else 3, dtype=torch.float32, device=device)),
    )


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project positive ``comb [..., hc, hc]`` towards doubly stochastic.

    One column normalisation, then ``iters - 1`` (row, column) rounds, each with ``+eps``
    in the denominator: the loop ends on a column normalisation, as officially.
    """
    if _functional(comb):  # training or compiling: out of place
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return comb
    hc = comb.shape[-1]
    flat = comb.reshape(-1, hc, hc)
    return _sinkhorn_last(flat.permute(1, 2, 0), iters, eps).view(comb.shape)


def _sinkhorn_last(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` of ``comb [hc, hc, N]`` (matrices along the last dim, where the
    reductions vectorise) -> ``[N, hc, hc]`` contiguous, without autograd.

    The matrices sit in the top-left block of a ``[hc+1, hc+1, N]`` buffer whose last
    row and column hold ``eps``, so each row (column) sum over the bordered block is
    ``sum + eps`` in one op and each normalisation is 2 in-place ops, not 3: twenty
    rounds are ~80 tiny ops per call, each costing its dispatch, not its arithmetic.
    """
    hc = comb.shape[0]
    buf = comb.new_full((hc + 1, hc + 1, comb.shape[-1]), eps)
    buf[:hc, :hc] = comb
    return _sinkhorn_bordered(buf, iters)


def _sinkhorn_bordered(buf: torch.Tensor, iters: int) -> torch.Tensor:
    """Sinkhorn in place on the top-left ``[hc, hc, N]`` block of the eps-bordered
    ``buf [hc+1, hc+1, N]`` -> ``[N, hc, hc]`` contiguous. The sums go into two
    preallocated buffers (``out=``): no allocation per round, only the dispatch."""
    hc = buf.shape[0] - 1
    comb, rows, cols = buf[:hc, :hc], buf[:hc, :], buf[:, :hc]
    row_sums = buf.new_empty(hc, 1, buf.shape[-1])  # [hc, 1, N]
    col_sums = buf.new_empty(1, hc, buf.shape[-1])  # [1, hc, N]
    comb.div_(torch.sum(cols, dim=0, keepdim=True, out=col_sums))
    for _ in range(iters - 1):
        comb.div_(torch.sum(rows, dim=1, keepdim=True, out=row_sums))
        comb.div_(torch.sum(cols, dim=0, keepdim=True, out=col_sums))
    return comb.permute(2, 0, 1).contiguous()


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    args: DeepseekV4Args,
    ops: ModelOps = REFERENCE_OPS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for one sub-block.

    ``x [T, hc, d]`` -> ``u [T, d]`` (x.dtype), ``post [T, hc]`` fp32, ``comb [T, hc, hc]`` fp32.
    ``ops``: the platform's ops: ``rms_norm``, and ``mhc_pre`` (``models.ops.MhcPreOp``)
    for everything after the ``fn`` projection, which returns ``(u | None, pre, post,
    comb)`` as computed here (``u`` only given ``x``), or None for inputs it does not take.
    Under autograd (training) the forward is this same computation and the backward is
    :class:`_HcPreGrad`'s, written out by hand.
    """
    if _records(x, fn, base, scale):
        return _HcPreGrad.apply(x, fn, base, scale, args, ops)
    u, post, comb, _ = _hc_pre(x, fn, base, scale, args, ops)
    return u, post, comb


def _hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    args: DeepseekV4Args,
    ops: ModelOps,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """:func:`hc_pre`'s computation -> ``u, post, comb`` and what its backward reads: the
    normalised streams ``flat [T, hc*d]`` and their projection ``mix [T, (2+hc)*hc]`` fp32."""
    hc, t = args.hc_mult, x.shape[0]
    flat = rms_normalize(x.flatten(1).float(), args.rms_norm_eps, ops)  # [T, hc*d]
    mix = F.linear(flat, fn.float())  # [T, (2+hc)*hc] = [pre | post | comb]
    kernel = eager(ops.mhc_pre)
    fused_out = None
    if kernel is not None:
        streams = x if x.dtype == torch.float32 and x.is_contiguous() else None
        iters, eps = args.hc_sinkhorn_iters, args.hc_eps
        fused_out = kernel(mix, scale.float(), base.float(), hc, iters, eps, streams)
    if fused_out is not None:
        u, pre, post, comb = fused_out
        if u is None:
            u = (pre.unsqueeze(-1) * x).sum(dim=1)
        return u.to(x.dtype), post, comb, (flat, mix)
    # scale[0] scales the pre columns, scale[1] post, scale[2] comb: one multiply-add
    z = mix * _site_scale(scale.float(), hc) + base.float()
    gates = torch.sigmoid(z[:, : 2 * hc])
    pre = gates[:, :hc] + args.hc_eps
    post = 2 * gates[:, hc:]
    logits = z[:, 2 * hc :].view(t, hc, hc)
    if _functional(logits):  # a compiler traces it
        comb = torch.softmax(logits, dim=-1) + args.hc_eps
        comb = sinkhorn(comb, args.hc_sinkhorn_iters, args.hc_eps)
    else:  # softmax and Sinkhorn with the rows along the last dim (vectorised at any T)
        buf = x.new_full((hc + 1, hc + 1, t), args.hc_eps, dtype=torch.float32)
        soft = torch.softmax(logits.permute(1, 2, 0), dim=1)  # [hc, hc, T]
        torch.add(soft, args.hc_eps, out=buf[:hc, :hc])  # softmax + eps, into the buffer
        comb = _sinkhorn_bordered(buf, args.hc_sinkhorn_iters)
    u = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)  # sum_i pre_i X_i
    return u, post, comb, (flat, mix)


def _records(*tensors: torch.Tensor) -> bool:
    """Whether autograd records this call eagerly (training; a compiler traces the
    reference math instead)."""
    return (
        torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
        and any(t.requires_grad for t in tensors)
    )


class _HcPreGrad(torch.autograd.Function):
    """:func:`hc_pre` with a hand-written backward (training).

    The forward is the inference computation itself (no autograd graph of its ~100
    small ops); the backward is the same math's derivative in a few whole-tensor ops:
    the RMS norm and the ``fn`` projection as two matmuls and one fused update of the
    ``[T, hc*d]`` streams, Sinkhorn's rounds replayed with the matrices along the last
    dim (vectorised over rows) and differentiated round by round.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        args: DeepseekV4Args,
        ops: ModelOps,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        u, post, comb, (flat, mix) = _hc_pre(x, fn, base, scale, args, ops)
        ctx.args = args
        ctx.save_for_backward(x, fn, base, scale, flat, mix)
        return u, post, comb

    @staticmethod
    def backward(
        ctx: Any, g_u: torch.Tensor, g_post: torch.Tensor, g_comb: torch.Tensor
    ) -> tuple[torch.Tensor | None, ...]:
        x, fn, base, scale, flat, mix = ctx.saved_tensors
        args: DeepseekV4Args = ctx.args
        t, hc, d = x.shape
        xf, g_u = x.float(), g_u.float()
        site = _column_site(hc, x.device)
        z = mix * scale.float().index_select(0, site) + base.float()
        gates = torch.sigmoid(z[:, : 2 * hc])  # [T, 2hc]: pre - eps | post / 2
        work = xf * g_u.unsqueeze(1)  # [T, hc, d]; reused below for the streams' gradient
        g_pre = work.sum(dim=-1)  # [T, hc]: d u / d pre_i = <X_i, g_u>
        g_gates = torch.cat([g_pre, 2 * g_post.float()], dim=1) * gates * (1 - gates)
        g_logits = _softmax_sinkhorn_grad(z[:, 2 * hc :], g_comb.float(), args)  # [T, hc*hc]
        g_z = torch.cat([g_gates, g_logits], dim=1)  # [T, (2+hc)*hc]
        g_mix = g_z * scale.float().index_select(0, site)
        per_site = torch.zeros_like(scale, dtype=torch.float32).index_add_(
            0, site, (g_z * mix).sum(dim=0)
        )  # [3]: d z / d scale[s] = the mix columns of site s
        g_x = None
        if ctx.needs_input_grad[0]:
            # rms norm: flat = x * r, r = (mean(x^2) + eps)^-1/2, so for a gradient g on
            # flat: d/dx = r * (g - flat * <g, flat> / D); <g_mix @ fn, flat> = <g_mix, mix>
            n = flat.shape[1]
            g_flat = torch.mm(g_mix, fn.float(), out=work.view(t, n))  # [T, D]
            dot = (g_mix * mix).sum(dim=-1, keepdim=True)
            norm = torch.linalg.vector_norm(xf.flatten(1), dim=-1, keepdim=True)
            r = torch.rsqrt(norm.square() / n + args.rms_norm_eps)  # [T, 1]
            g_x = g_flat.addcmul_(flat, dot, value=-1.0 / n).mul_(r).view(t, hc, d)
            pre = gates[:, :hc] + args.hc_eps
            g_x = g_x.addcmul_(pre.unsqueeze(-1), g_u.unsqueeze(1)).to(x.dtype)
        g_fn = (g_mix.t() @ flat).to(fn.dtype) if ctx.needs_input_grad[1] else None
        g_base = g_z.sum(dim=0).to(base.dtype) if ctx.needs_input_grad[2] else None
        g_scale = per_site.to(scale.dtype) if ctx.needs_input_grad[3] else None
        return g_x, g_fn, g_base, g_scale, None, None


def _softmax_sinkhorn_grad(
    logits: torch.Tensor, g_comb: torch.Tensor, args: DeepseekV4Args
) -> torch.Tensor:
    """Gradient of ``comb = sinkhorn(softmax(logits) + eps)`` (as :func:`sinkhorn`):
    ``logits [T, hc*hc]`` (row-major ``[i, j]``), ``g_comb [T, hc, hc]`` -> ``[T, hc*hc]``.

    Each round ``c' = c / (sum_a c + eps)`` (``a``: the column or the row index) has
    ``dc = (g - sum_a g * c') / (sum_a c + eps)``. The rounds are replayed forward once
    (each one's output and denominator kept), then walked back; the matrices lie along
    the last dim ``[hc, hc, T]`` so every op is vectorised over the rows.
    """
    t, hc, eps = logits.shape[0], args.hc_mult, args.hc_eps
    soft = torch.softmax(logits.view(t, hc, hc).permute(1, 2, 0), dim=1)  # [i, j, T]
    c = soft + eps
    rounds: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (summed dim, c', denominator)
    for dim in [0] + [1, 0] * (args.hc_sinkhorn_iters - 1):  # columns first, ends on columns
        den = c.sum(dim=dim, keepdim=True) + eps
        c = c / den
        rounds.append((dim, c, den))
    g = g_comb.permute(1, 2, 0)  # [i, j, T]
    for dim, out, den in reversed(rounds):
        g = (g - (g * out).sum(dim=dim, keepdim=True)) / den
    g = soft * (g - (g * soft).sum(dim=1, keepdim=True))  # softmax over j
    return g.permute(2, 0, 1).reshape(t, hc * hc)


def _functional(t: torch.Tensor) -> bool:
    """Out-of-place math for autograd, and for a compiler (which fuses it anyway); the
    eager inference path instead minimises the number of ops, each a dispatch."""
    return torch.compiler.is_compiling() or (t.requires_grad and torch.is_grad_enabled())


def _site_scale(scale: torch.Tensor, hc: int) -> torch.Tensor:
    """``scale [3]`` -> ``[(2+hc)*hc]``, one factor per column of ``[pre | post | comb]``."""
    if torch.compiler.is_compiling():
        sizes = (hc, hc, hc * hc)
        return torch.cat([scale[i : i + 1].expand(n) for i, n in enumerate(sizes)])
    return scale.index_select(0, _column_site(hc, scale.device))


@functools.lru_cache(maxsize=8)
def _column_site(hc: int, device: torch.device) -> torch.Tensor:
    """``[(2+hc)*hc]`` int64: 0 for the pre columns, 1 for post, 2 for comb (one gather
    expands ``scale``; ``repeat_interleave`` costs several ops)."""
    return torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)


def hc_post(
    y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a sub-block output back into the streams.

    ``y [T, d]`` block output, ``x [T, hc, d]`` streams it read, ``post [T, hc]``,
    ``comb [T, hc, hc]`` -> ``[T, hc, d]``: ``post_j * y + sum_i comb[i, j] * x_i``.
    """
    if _records(y, x, post, comb):
        return _HcPostGrad.apply(y, x, post, comb)
    dtype = x.dtype
    expanded = post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2)  # [T, hc, d]
    return torch.baddbmm(expanded, comb.to(dtype).transpose(-1, -2), x)


class _HcPostGrad(torch.autograd.Function):
    """:func:`hc_post` with a hand-written backward (training): the forward is the
    inference computation; the backward is three small batched matmuls and one product,
    without the ``[T, hc, d]`` temporaries autograd keeps for the broadcast product."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(y, x, post, comb)
        return hc_post(y, x, post, comb)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y, x, post, comb = ctx.saved_tensors  # g [T, hc, d], as the output
        dtype = x.dtype
        g_y = torch.bmm(post.to(dtype).unsqueeze(1), g).squeeze(1)  # sum_j post_j g_j
        g_post = (g * y.unsqueeze(1)).sum(dim=-1)  # [T, hc]: <g_j, y>
        g_comb = torch.bmm(x, g.transpose(1, 2))  # [T, hc, hc]: [i, j] = <x_i, g_j>
        g_x = torch.bmm(comb.to(dtype), g)  # [T, hc, d]: sum_j comb[i, j] g_j
        return g_y.to(y.dtype), g_x, g_post.to(post.dtype), g_comb.to(comb.dtype)


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    args: DeepseekV4Args,
    ops: ModelOps = REFERENCE_OPS,
) -> torch.Tensor:
    """Final collapse of the streams: ``x [T, hc, d]`` -> ``[T, d]`` (x.dtype)."""
    flat = rms_normalize(x.flatten(1).float(), args.rms_norm_eps, ops)  # [T, hc*d]
    mix = F.linear(flat, fn.float())  # [T, hc]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + args.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class HyperHead:
    """Mixin for modules that own ``hc_head_{fn,base,scale}`` (the model, MTP modules).

    Call :meth:`init_hyper_head` in ``__init__`` (after ``nn.Module.__init__``); the
    parameters are registered under the official names on the module itself. The
    module's ``ops`` (set at its construction) serve the head too.
    """

    hc_head_fn: nn.Parameter
    hc_head_base: nn.Parameter
    hc_head_scale: nn.Parameter
    args: DeepseekV4Args
    ops: ModelOps

    def init_hyper_head(self, args: DeepseekV4Args, device: torch.device | str) -> None:
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = new_hc_params(
            args, head=True, device=device
        )

    def hyper_head(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hc, d]`` -> ``[T, d]``."""
        fn, base, scale = self.hc_head_fn, self.hc_head_base, self.hc_head_scale
        return hc_head(x, fn, base, scale, self.args, self.ops)
