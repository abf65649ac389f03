"""The NPU plugin's W8A8 dynamic linear (npu_dynamic_quant + npu_quant_matmul) on the
CPU: the emulated operators implement torch_npu's documented semantics, so the call
sites' argument plumbing, layouts and scale shapes are checked here, and the result
equals the ``native`` W8A8 semantics of xspec.models.quantized bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from xspec.models.deepseek_v4.convert import quantize_fp8_blocks, quantize_int8
from xspec.models.ops import ModelOps, linear
from xspec.models.quantized import QuantizedWeight, native_linear
from xspec.platforms.npu.quant import EmulatedQuantOps, W8A8DynamicLinear

GEN = torch.Generator().manual_seed(0)


def w8a8(n: int, k: int, dtype: torch.dtype, offset: float = 0.0) -> QuantizedWeight:
    q, s = quantize_int8(torch.randn(n, k, generator=GEN) / k**0.5)
    return QuantizedWeight("w8a8", q, s, torch.full_like(s, offset), dtype, "native")


class Recording(EmulatedQuantOps):
    """The emulated operators, recording what each call received."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def npu_quant_matmul(self, x1, x2, scale, **kw):  # type: ignore[no-untyped-def,override]
        self.calls.append({"x1": x1, "x2": x2, "scale": scale, **kw})
        return EmulatedQuantOps.npu_quant_matmul(x1, x2, scale, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_npu_w8a8_equals_the_native_semantics(dtype: torch.dtype) -> None:
    w = w8a8(96, 256, dtype)
    x = torch.randn(2, 5, 256, generator=GEN).to(dtype)
    bias = torch.randn(96, generator=GEN)
    kernels = Recording()
    got = W8A8DynamicLinear(lambda: kernels)(x, w, bias)
    assert got is not None and got.shape == (2, 5, 96) and got.dtype == dtype
    assert torch.equal(got, native_linear(x, w, bias))
    (call,) = kernels.calls
    assert call["x1"].dtype == torch.int8 and list(call["x1"].shape) == [10, 256]
    assert list(call["x2"].shape) == [256, 96]  # the weight transposed to [K, N], no copy
    assert call["x2"].data_ptr() == w.data.data_ptr()
    assert list(call["scale"].shape) == [96] and list(call["pertoken_scale"].shape) == [10]
    assert call["output_dtype"] == dtype and call["bias"].dtype == torch.float32


def test_emulated_operators_refuse_wrong_layouts() -> None:
    x = torch.zeros(3, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"shapes \[3, 8\] @ \[4, 8\]"):
        EmulatedQuantOps.npu_quant_matmul(x, torch.zeros(4, 8, dtype=torch.int8), torch.ones(4))
    with pytest.raises(ValueError, match=r"pertoken_scale must be \[3\]"):
        EmulatedQuantOps.npu_quant_matmul(
            x, torch.zeros(8, 4, dtype=torch.int8), torch.ones(4), pertoken_scale=torch.ones(3, 1)
        )
    with pytest.raises(TypeError, match="int8"):
        EmulatedQuantOps.npu_quant_matmul(x.float(), x.T, torch.ones(3))


def test_what_the_npu_op_does_not_take_falls_back() -> None:
    """Asymmetric W8A8 (non-zero offset) and FP8 answer None: the model's reference runs."""
    op = W8A8DynamicLinear(EmulatedQuantOps)
    x = torch.randn(4, 256, generator=GEN)
    assert op(x, w8a8(32, 256, torch.float32, offset=2.0), None) is None
    q, s = quantize_fp8_blocks(torch.randn(32, 256, generator=GEN), [128, 128])
    fp8 = QuantizedWeight("fp8", q, s, None, torch.float32, "native")
    assert op(x, fp8, None) is None
    with torch.no_grad():  # through the linear op: the plain-torch semantics instead
        asym = w8a8(32, 256, torch.float32, offset=2.0)
        got = linear(ModelOps(quant_linear=op), x, asym)
        assert torch.equal(got, native_linear(x, asym, None))


def test_npu_emulated_platform_offers_the_op() -> None:
    from xspec.config import PlatformConfig
    from xspec.platforms.npu.emulated import NpuPolicyCpuPlatform

    ops, line = NpuPolicyCpuPlatform(PlatformConfig(name="npu_emulated")).model_ops()
    assert isinstance(ops.quant_linear, W8A8DynamicLinear) and "npu_quant_matmul" in line
    assert isinstance(ops.quant_linear.kernels, EmulatedQuantOps)
