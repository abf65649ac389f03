"""The CPU platform's native fused kernels against the reference torch ops they replace."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from xspec.models.deepseek_v4 import mhc
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.rope import rotate
from xspec.platforms import native


@pytest.fixture(scope="module")
def kernels() -> native.NativeKernels:
    loaded, why = native.load()
    if loaded is None:
        pytest.skip(why)
    return loaded


def test_rms_norm_matches_torch(kernels):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=gen) * 3
    w = torch.randn(300, generator=gen)
    weighted = kernels.rms_norm(x, w, 1e-6)
    plain = kernels.rms_norm(x, None, 1e-6)
    assert weighted is not None and plain is not None
    torch.testing.assert_close(weighted, F.rms_norm(x, (300,), w, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain, F.rms_norm(x, (300,), eps=1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(5, 8, 64), (5, 64), (3, 2, 48)])
def test_rope_is_bitwise_the_reference(kernels, shape, inverse):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen)
    rd = 16 if shape[-1] == 64 else 8
    cos, sin = torch.randn(shape[0], rd, generator=gen), torch.randn(shape[0], rd, generator=gen)
    y = kernels.rope(x, cos, sin, inverse)
    assert y is not None
    assert torch.equal(y, rotate(x, cos, sin, inverse=inverse))


@pytest.mark.parametrize(("hc", "iters"), [(4, 20), (2, 10)])
def test_mhc_pre_matches_the_reference_path(kernels, hc, iters):
    args = dataclasses.replace(DeepseekV4Args.tiny(), hc_mult=hc, hc_sinkhorn_iters=iters)
    hc, d = args.hc_mult, args.hidden_size
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, hc, d, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=gen) / (hc * d) ** 0.5
    base, scale = torch.randn((2 + hc) * hc, generator=gen), torch.rand(3, generator=gen) + 0.5
    with torch.no_grad():
        ref = mhc.hc_pre(x, fn, base, scale, args)
        fused = mhc.hc_pre(x, fn, base, scale, args, kernels.by_name())
    for name, a, b in zip(("u", "post", "comb"), fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    comb = fused[2]  # doubly stochastic: columns sum to 1 after the last normalisation
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(6, hc), rtol=0, atol=1e-5)


def test_inputs_a_kernel_does_not_take_fall_back(kernels):
    x = torch.randn(4, 64)
    assert kernels.rms_norm(x.bfloat16(), None, 1e-6) is None
    assert kernels.rms_norm(x.t(), None, 1e-6) is None  # not contiguous
    cos = sin = torch.randn(4, 8)
    assert kernels.rope(x.double(), cos, sin, False) is None
    mix, scale, base = torch.randn(3, 24), torch.ones(3), torch.zeros(24)
    assert kernels.mhc_pre(mix.bfloat16(), scale, base, 4, 20, 1e-6, None) is None
    assert kernels.mhc_pre(mix, scale, base, 4, 20, 1e-6, None)[0] is None  # no streams
    # the reference runs instead, and gives the reference's answer
    assert torch.equal(
        rotate(x.bfloat16(), cos, sin, kernel=kernels.rope), rotate(x.bfloat16(), cos, sin)
    )


def test_no_compiler_means_reference_ops_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    loaded, why = native.load()
    assert loaded is None
    assert "no C compiler" in why and "reference" in why


def test_a_failing_build_says_why(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    loaded, why = native.load()
    assert loaded is None
    assert "fake-cc: cannot compile" in why
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written


def test_the_build_is_cached(kernels, monkeypatch):
    again, _ = native.load()
    assert again is not None and again.path == kernels.path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_topk_is_the_reference_selection(kernels, seed):
    """Ragged sequences (decode, verify and a prefill chunk), exact ties (repeated keys:
    the lower index wins), a NaN key (never picked), fewer causal entries than k."""
    from xspec.models.base import StepOptions
    from xspec.models.deepseek_v4.compressor import Indexer
    from xspec.models.deepseek_v4.layout import BatchLayout
    from xspec.models.deepseek_v4.rope import Rope, rope_inv_freq

    args = DeepseekV4Args.tiny()
    indexer = Indexer(
        args, Rope(rope_inv_freq(args, compressed=True)), dtype=torch.float32, device="cpu"
    )
    gen = torch.Generator().manual_seed(seed)
    starts, lens = [40, 97, 3], [1, 6, 30]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    layout = BatchLayout(positions, lens, starts)
    counts = layout.entry_counts(4)
    keys = torch.randn(sum(counts), args.index_head_dim, generator=gen)
    keys[5] = keys[2]  # exact ties within the first sequence
    keys[counts[0] + 3] = float("nan")
    q = torch.randn(positions.numel(), args.index_n_heads, args.index_head_dim, generator=gen)
    w = torch.randn(positions.numel(), args.index_n_heads, generator=gen)
    with torch.no_grad():
        reference = indexer.select(q, w, keys, layout)
        indexer.configure_steps(StepOptions(kernels=kernels.by_name()))
        fused = indexer.select(q, w, keys, layout)
    assert torch.equal(fused, reference)
    assert (fused == -1).any()  # the 3-token sequence has no complete entry yet
