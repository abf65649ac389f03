"""CUDA platform: the conformance suite where a GPU is visible; the refusal path elsewhere."""

from __future__ import annotations

import pytest
import torch

from tests.platforms.conformance import NativeSas, PlatformCfg, PlatformConformance
from xspec.errors import PlatformError
from xspec.platforms import get_platform
from xspec.platforms.base import Platform
from xspec.platforms.cuda import CudaPlatform

_REASON = CudaPlatform.unavailable_reason()


@pytest.mark.cuda
@pytest.mark.skipif(_REASON is not None, reason=str(_REASON))
class TestCudaConformance(PlatformConformance):
    def make_platform(self, native_sas: str = "auto") -> Platform:
        return CudaPlatform(PlatformCfg(name="cuda", native_sas=NativeSas(native_sas)))

    def test_cuda_answers(self, platform: Platform) -> None:
        assert platform.device() == torch.device("cuda", 0)
        assert platform.distributed_backend() == "nccl"
        assert "float32" in platform.capabilities.dtypes

    def test_device_index_out_of_range_is_reported(self) -> None:
        count = torch.cuda.device_count()
        platform = CudaPlatform(PlatformCfg(name="cuda", device_index=count))
        problems = platform.validate(dtype="float32")
        assert any(f"platform.device_index={count}" in p for p in problems), problems


@pytest.mark.skipif(_REASON is None, reason="a CUDA device is visible")
def test_cuda_refused_without_device() -> None:
    assert _REASON is not None
    assert "CUDA" in _REASON
    with pytest.raises(PlatformError, match=r"platform=cuda cannot run here: .*CUDA"):
        get_platform(PlatformCfg(name="cuda"))
