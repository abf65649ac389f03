"""xspec.models.quantized: dequantizing part of a weight, and the ``native`` semantics
(activations quantized as the format prescribes) against independent statements of them;
the ``model.quant_compute`` modes through ``models.ops.linear``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xspec.models.deepseek_v4.convert import quantize_fp8_blocks, quantize_int8
from xspec.models.deepseek_v4.quant import quant_mxfp4
from xspec.models.ops import REFERENCE_OPS, ModelOps, linear
from xspec.models.quantized import (
    QuantizedWeight,
    act_quant_fp8,
    dynamic_quant_int8,
    native_linear,
)

GEN = torch.Generator().manual_seed(0)


def weight(fmt: str, n: int = 200, k: int = 320, compute: str = "dequant") -> QuantizedWeight:
    """A random ``[n, k]`` weight stored in ``fmt`` (K=320: a partial 128-block)."""
    w = torch.randn(n, k, generator=GEN) / k**0.5
    if fmt == "fp8":
        q, s = quantize_fp8_blocks(w, [128, 128])
        return QuantizedWeight("fp8", q, s, None, torch.float32, compute)
    if fmt == "mxfp4":
        q, s = quant_mxfp4(w)
        return QuantizedWeight("mxfp4", q, s, None, torch.float32, compute)
    q, s = quantize_int8(w)
    return QuantizedWeight("w8a8", q, s, torch.zeros_like(s), torch.float32, compute)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "w8a8"])
def test_dequantize_rows_equals_the_rows_of_the_whole(fmt: str) -> None:
    w = weight(fmt)
    full = w.dequantize()
    assert full.shape == (200, 320) and w.shape == (200, 320)
    for rows in (slice(0, 1), slice(100, 200), slice(130, 131), slice(127, 129)):
        assert torch.equal(w.dequantize(rows), full[rows]), rows


def test_stored_bytes() -> None:
    assert weight("w8a8").nbytes == 200 * 320 + 2 * 200 * 4
    assert weight("mxfp4").nbytes == 200 * 160 + 200 * 10
    assert weight("fp8").nbytes == 200 * 320 + 2 * 3


def test_act_quant_fp8_blocks() -> None:
    """Per token, per 128 values: the smallest power of two fitting 448, e4m3 values."""
    x = torch.randn(5, 300, generator=GEN) * torch.tensor([1e-3, 1.0, 30.0, 1e3, 0.0]).unsqueeze(1)
    q, s = act_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and s.shape == (5, 3)
    blocks = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    live = blocks > 0
    assert (blocks[live] <= 448 * s[live]).all() and (blocks[live] > 224 * s[live]).all()
    assert torch.equal(s.log2(), s.log2().round())  # powers of two (ue8m0)
    back = q.float() * s.repeat_interleave(128, 1)[:, :300]
    assert (
        (back - x).abs() <= x.abs() * 2**-4 + s.repeat_interleave(128, 1)[:, :300] * 2**-9
    ).all()


def test_dynamic_quant_int8_per_token() -> None:
    x = torch.randn(4, 64, generator=GEN)
    x[3] = 0
    q, s = dynamic_quant_int8(x)
    assert q.dtype == torch.int8 and s.shape == (4,)
    assert torch.equal(s[:3], x[:3].abs().amax(-1) / 127) and s[3] == 1
    assert torch.equal(q.abs().amax(-1)[:3], torch.full((3,), 127, dtype=torch.int8))
    assert torch.equal(q, torch.round(x / s.unsqueeze(1)).to(torch.int8))


def test_native_w8a8_is_int32_accumulation_then_scales() -> None:
    """Independently: integer products summed exactly (int64), then acc * x_scale * w_scale."""
    w = weight("w8a8")
    x = torch.randn(3, 7, 320, generator=GEN)
    got = native_linear(x, w, None)  # [3, 7, 200]
    x2 = x.reshape(21, 320)
    xs = x2.abs().amax(-1) / 127
    xq = torch.round(x2 / xs.unsqueeze(1)).long()
    acc = (xq.unsqueeze(1) * w.data.long().unsqueeze(0)).sum(-1)  # [21, 200] exact
    want = acc.float() * xs.unsqueeze(1) * w.scale.reshape(1, -1)
    assert torch.equal(got.reshape(21, 200), want)


def test_native_w8a8_offset() -> None:
    """An asymmetric weight: acc - offset * sum(x_q), i.e. (q - offset) . x_q."""
    w = weight("w8a8")
    w = QuantizedWeight("w8a8", w.data, w.scale, torch.full_like(w.scale, 3.0), torch.float32)
    x = torch.randn(4, 320, generator=GEN)
    xq, xs = dynamic_quant_int8(x)
    acc = xq.double() @ (w.data.double() - 3.0).T
    want = acc.float() * xs.unsqueeze(1) * w.scale.reshape(1, -1)
    assert torch.equal(native_linear(x, w, None), want)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_native_fp8_is_a_blockwise_scaled_gemm(fmt: str) -> None:
    """Independently: per K block, (e4m3 x codes @ weight values) * x_scale, summed."""
    w = weight(fmt)
    x = torch.randn(6, 320, generator=GEN)
    got = native_linear(x, w, None)
    xq, xs = act_quant_fp8(x)
    wd = w.dequantize_f32()
    want = sum(
        (xq[:, b * 128 : (b + 1) * 128].float() @ wd[:, b * 128 : (b + 1) * 128].T)
        * xs[:, b : b + 1]
        for b in range(3)
    )
    assert isinstance(want, torch.Tensor)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    exact = x @ wd.T  # the activation rounding is really there, and small
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 0.05, rel


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "w8a8"])
def test_compute_modes_through_the_linear_op(fmt: str) -> None:
    x = torch.randn(5, 320, generator=GEN)
    calls: list[str] = []

    def platform_op(x: torch.Tensor, w: QuantizedWeight, bias: torch.Tensor | None):
        calls.append(w.format)
        return torch.full((x.shape[0], w.shape[0]), 7.0)

    ops = ModelOps(quant_linear=platform_op)
    with torch.no_grad():
        dq = weight(fmt)
        assert torch.equal(linear(REFERENCE_OPS, x, dq), F.linear(x, dq.dequantize()))
        assert torch.equal(linear(ops, x, dq), F.linear(x, dq.dequantize()))  # dequant: no op
        nat = QuantizedWeight(dq.format, dq.data, dq.scale, dq.offset, dq.dtype, "native")
        assert torch.equal(linear(REFERENCE_OPS, x, nat), native_linear(x, nat, None))
        assert torch.equal(linear(ops, x, nat), torch.full((5, 200), 7.0))
        auto = QuantizedWeight(dq.format, dq.data, dq.scale, dq.offset, dq.dtype, "auto")
        assert torch.equal(linear(REFERENCE_OPS, x, auto), F.linear(x, dq.dequantize()))
        assert torch.equal(linear(ops, x, auto), torch.full((5, 200), 7.0))
    assert calls == [fmt, fmt]
