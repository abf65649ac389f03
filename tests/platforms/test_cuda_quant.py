"""FP8 linears through torch._scaled_mm on a GPU with FP8 tensor cores: the ``native``
semantics (xspec.models.quantized) within the tensor cores' accumulation error, and the
greedy speculative output of an FP8 checkpoint equal to the baseline's on the GPU."""

from __future__ import annotations

import pytest
import torch

from xspec.models.deepseek_v4.convert import quantize_fp8_blocks, quantize_int8
from xspec.models.quantized import QuantizedWeight, native_linear
from xspec.platforms.cuda import CudaPlatform

_REASON = CudaPlatform.unavailable_reason()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(_REASON is not None, reason=str(_REASON))]


def _fp8_or_skip() -> None:
    from xspec.platforms.cuda_quant import fp8_supported

    if not fp8_supported(torch.device("cuda", 0)):
        pytest.skip("this GPU has no FP8 tensor cores (sm89+)")


@pytest.mark.parametrize("rows", [1, 6, 33])
def test_scaled_mm_matches_the_native_semantics(rows: int) -> None:
    from xspec.platforms.cuda_quant import Fp8ScaledMM

    _fp8_or_skip()
    gen = torch.Generator().manual_seed(rows)
    q, s = quantize_fp8_blocks(torch.randn(640, 1024, generator=gen) / 32, [128, 128])
    cuda = torch.device("cuda", 0)
    w = QuantizedWeight("fp8", q.to(cuda), s.to(cuda), None, torch.bfloat16, "native")
    x = torch.randn(rows, 1024, generator=gen).to(cuda, torch.bfloat16)
    bias = torch.randn(640, generator=gen).to(cuda)
    got = Fp8ScaledMM()(x, w, bias)
    assert got is not None and got.shape == (rows, 640) and got.dtype == torch.bfloat16
    want = native_linear(x.cpu(), QuantizedWeight("fp8", q, s, None, torch.bfloat16), bias.cpu())
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


def test_other_formats_fall_back() -> None:
    from xspec.platforms.cuda_quant import Fp8ScaledMM

    q, s = quantize_int8(torch.randn(64, 256))
    cuda = torch.device("cuda", 0)
    w = QuantizedWeight("w8a8", q.to(cuda), s.to(cuda), None, torch.bfloat16, "native")
    assert Fp8ScaledMM()(torch.randn(2, 256, device=cuda, dtype=torch.bfloat16), w, None) is None


def test_fp8_checkpoint_greedy_speculative_equals_baseline(tmp_path) -> None:
    import xspec
    from xspec.models.deepseek_v4.convert import quantize_fp8
    from xspec.models.deepseek_v4.tiny import tiny_dir

    _fp8_or_skip()
    quantize_fp8(tiny_dir(), tmp_path / "fp8")
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    def greedy(spec: str) -> list[list[int]]:
        llm = xspec.LLM(
            model="dsv4_flash",
            spec=spec,
            platform="cuda",
            overrides={
                "model.path": str(tmp_path / "fp8"),
                "model.dtype": "bfloat16",
                "model.tokenizer": "byte",
                "model.quant_compute": "auto",  # the _scaled_mm op on this GPU
                "platform.compile": "off",
            },
        )
        outs = llm.generate([ids, ids[:7]], 12, ignore_eos=True, concurrency=2)
        return [g.token_ids for g in outs]

    assert greedy("mtp") == greedy("none")
