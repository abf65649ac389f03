"""Training the target through the inference modules: the forward under autograd is the
inference forward bit for bit, and the mHC collapse's hand-written backward is the
derivative of the same math (checked against autograd through the plain ops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.mhc import hc_post, hc_pre, sinkhorn

ARGS = DeepseekV4Args.tiny()


def _site(seed: int = 0, rows: int = 40) -> tuple[torch.Tensor, ...]:
    """Streams ``x [rows, hc, d]`` and one mHC site's ``fn, base, scale`` (random)."""
    gen = torch.Generator().manual_seed(seed)
    hc, d = ARGS.hc_mult, ARGS.hidden_size
    x = torch.randn(rows, hc, d, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=gen) / (hc * d) ** 0.5
    base = torch.randn((2 + hc) * hc, generator=gen) * 0.5
    scale = 0.5 + torch.rand(3, generator=gen)
    return x, fn, base, scale


def _reference_hc_pre(x, fn, base, scale):
    """hc_pre written with plain differentiable ops (autograd derives its backward)."""
    hc = ARGS.hc_mult
    flat = F.rms_norm(x.flatten(1), (x.shape[1] * x.shape[2],), eps=ARGS.rms_norm_eps)
    mix = F.linear(flat, fn)
    site = torch.tensor([0] * hc + [1] * hc + [2] * hc * hc)
    z = mix * scale[site] + base
    gates = torch.sigmoid(z[:, : 2 * hc])
    pre, post = gates[:, :hc] + ARGS.hc_eps, 2 * gates[:, hc:]
    comb = torch.softmax(z[:, 2 * hc :].view(-1, hc, hc), dim=-1) + ARGS.hc_eps
    comb = sinkhorn(comb, ARGS.hc_sinkhorn_iters, ARGS.hc_eps)
    return (pre.unsqueeze(-1) * x).sum(dim=1), post, comb


def test_hc_pre_under_autograd_is_the_inference_forward() -> None:
    """Training reads the same bits as serving: Sinkhorn's rounds included."""
    x, fn, base, scale = _site()
    with torch.no_grad():
        served = hc_pre(x, fn, base, scale, ARGS)
    params = [t.clone().requires_grad_() for t in (x, fn, base, scale)]
    trained = hc_pre(*params, ARGS)
    for a, b in zip(served, trained):
        assert torch.equal(a, b.detach())


def test_hc_pre_backward_is_the_derivative_of_its_math() -> None:
    x, fn, base, scale = _site(seed=1)
    gen = torch.Generator().manual_seed(2)
    u, post, comb = _reference_hc_pre(x, fn, base, scale)
    weights = [torch.randn(t.shape, generator=gen) for t in (u, post, comb)]

    def grads(fn_):
        params = [t.clone().requires_grad_() for t in (x, fn, base, scale)]
        outs = fn_(*params)
        loss = sum((o * w).sum() for o, w in zip(outs, weights))
        return torch.autograd.grad(loss, params)

    mine = grads(lambda *p: hc_pre(*p, ARGS))
    ref = grads(_reference_hc_pre)
    for name, a, b in zip(("x", "fn", "base", "scale"), mine, ref):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"d/d{name}: relative error {err:.3g}"


def test_frozen_streams_train_the_site_parameters_only() -> None:
    """A drafter block reading a frozen target's streams: only fn/base/scale get grads."""
    x, fn, base, scale = _site(seed=3)
    params = [t.clone().requires_grad_() for t in (fn, base, scale)]
    u, post, comb = hc_pre(x, *params, ARGS)
    grads = torch.autograd.grad(u.sum() + post.sum() + comb.square().sum(), params)
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_hc_post_backward_is_the_derivative_of_its_math() -> None:
    gen = torch.Generator().manual_seed(4)
    hc, d, rows = ARGS.hc_mult, ARGS.hidden_size, 24
    inputs = [
        torch.randn(rows, d, generator=gen),  # y
        torch.randn(rows, hc, d, generator=gen),  # x
        torch.rand(rows, hc, generator=gen),  # post
        torch.rand(rows, hc, hc, generator=gen),  # comb
    ]
    weight = torch.randn(rows, hc, d, generator=gen)

    def reference(y, x, post, comb):
        return post.unsqueeze(-1) * y.unsqueeze(1) + torch.einsum("tij,tid->tjd", comb, x)

    def grads(fn_):
        params = [t.clone().requires_grad_() for t in inputs]
        return torch.autograd.grad((fn_(*params) * weight).sum(), params)

    for name, a, b in zip(("y", "x", "post", "comb"), grads(hc_post), grads(reference)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 1e-5, f"d/d{name}: relative error {err:.3g}"
