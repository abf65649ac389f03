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

import torch
import torch.nn.functional as F
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args


class RMSNorm(nn.Module):
    """Weighted RMSNorm; weight fp32, math in fp32, output cast back to the input dtype."""

    def __init__(self, dim: int, eps: float, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_normalize(x.float(), self.eps)).to(x.dtype)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation over the last dim (same dtype as ``x``)."""
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
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def hc_pre(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    args: DeepseekV4Args,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for one sub-block.

    ``x [T, hc, d]`` -> ``u [T, d]`` (x.dtype), ``post [T, hc]`` fp32, ``comb [T, hc, hc]`` fp32.
    """
    hc = args.hc_mult
    flat = rms_normalize(x.flatten(1).float(), args.rms_norm_eps)  # [T, hc*d]
    mix = F.linear(flat, fn.float())  # [T, (2+hc)*hc]
    pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + args.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.view(-1, hc, hc) * scale[2] + comb_b.view(hc, hc)
    comb = torch.softmax(logits, dim=-1) + args.hc_eps
    comb = sinkhorn(comb, args.hc_sinkhorn_iters, args.hc_eps)
    u = (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)
    return u, post, comb


def hc_post(
    y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a sub-block output back into the streams.

    ``y [T, d]`` block output, ``x [T, hc, d]`` streams it read, ``post [T, hc]``,
    ``comb [T, hc, hc]`` -> ``[T, hc, d]``: ``post_j * y + sum_i comb[i, j] * x_i``.
    """
    dtype = x.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), x)
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + mixed


def hc_head(
    x: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    args: DeepseekV4Args,
) -> torch.Tensor:
    """Final collapse of the streams: ``x [T, hc, d]`` -> ``[T, d]`` (x.dtype)."""
    flat = rms_normalize(x.flatten(1).float(), args.rms_norm_eps)  # [T, hc*d]
    mix = F.linear(flat, fn.float())  # [T, hc]
    pre = torch.sigmoid(mix * scale.float() + base.float()) + args.hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=1).to(x.dtype)


class HyperHead:
    """Mixin for modules that own ``hc_head_{fn,base,scale}`` (the model, MTP modules).

    Call :meth:`init_hyper_head` in ``__init__`` (after ``nn.Module.__init__``); the
    parameters are registered under the official names on the module itself.
    """

    hc_head_fn: nn.Parameter
    hc_head_base: nn.Parameter
    hc_head_scale: nn.Parameter
    args: DeepseekV4Args

    def init_hyper_head(self, args: DeepseekV4Args, device: torch.device | str) -> None:
        self.hc_head_fn, self.hc_head_base, self.hc_head_scale = new_hc_params(
            args, head=True, device=device
        )

    def hyper_head(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hc, d]`` -> ``[T, d]``."""
        return hc_head(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.args)
