"""The NPU plugin's policy, run on the CPU through NpuPolicyCpuPlatform.

No torch_npu here: the policy half of NpuPlatform (capture +1, SAS mode table,
validation, capabilities) is exercised through real subclasses that replace only the
device half, never through mocked modules.
"""

from __future__ import annotations

import pytest

from tests.platforms.conformance import NativeSas, PlatformCfg, PlatformConformance, import_probe
from xspec.errors import PlatformError
from xspec.models.base import CapturePoint, CaptureSite
from xspec.platforms import get_platform
from xspec.platforms.base import Platform, SasMode
from xspec.platforms.cpu import CpuPlatform
from xspec.platforms.npu.emulated import EMULATED_SAS_OPERATOR, NpuPolicyCpuPlatform
from xspec.platforms.npu.platform import NpuPlatform, select_sas_mode
from xspec.platforms.npu.probe import SasOperatorProbe

NPU_USABLE = NpuPlatform.unavailable_reason() is None


def emulated(native_sas: str = "auto", *, accepts: bool = True) -> NpuPolicyCpuPlatform:
    cfg = PlatformCfg(name="npu_emulated", native_sas=NativeSas(native_sas))
    return NpuPolicyCpuPlatform(cfg, operator_accepts_ori_sparse_indices=accepts)


class TestNpuEmulatedConformance(PlatformConformance):
    """An operator that takes ori_sparse_indices (the reference attention does)."""

    def make_platform(self, native_sas: str = "auto") -> Platform:
        return emulated(native_sas)


class TestNpuEmulatedOldOperatorConformance(PlatformConformance):
    """An operator that rejects ori_sparse_indices: auto must fall back to COMPAT."""

    def make_platform(self, native_sas: str = "auto") -> Platform:
        return emulated(native_sas, accepts=False)


@pytest.mark.npu
@pytest.mark.skipif(not NPU_USABLE, reason="needs torch_npu, Ascend CANN and an NPU")
class TestNpuConformance(PlatformConformance):
    """The real plugin, device half included (Ascend machines only)."""

    def make_platform(self, native_sas: str = "auto") -> Platform:
        return NpuPlatform(PlatformCfg(name="npu", native_sas=NativeSas(native_sas)))


def test_npu_package_imports_without_torch_npu() -> None:
    # The package and its modules, in one fresh interpreter.
    probe = import_probe(
        "xspec.platforms.npu",
        "xspec.platforms.npu.platform",
        "xspec.platforms.npu.probe",
        "xspec.platforms.npu.emulated",
    )
    assert probe == {"torch_npu": False, "cuda_initialized": False}, probe


@pytest.mark.skipif(NPU_USABLE, reason="torch_npu and CANN are present")
def test_npu_refused_here_with_install_hint() -> None:
    with pytest.raises(PlatformError) as info:
        get_platform(PlatformCfg(name="npu"))
    message = str(info.value)
    assert message.startswith("platform=npu cannot run here: ")
    assert "pip install 'xspec[npu]'" in message and "CANN" in message


def test_capture_maps_output_of_layer_to_input_of_next() -> None:
    platform = emulated()
    for layer in (0, 1, 7, 60):
        assert platform.capture_point(layer) == CapturePoint(
            layer=layer + 1, site=CaptureSite.INPUT
        )
    # The same checkpoint ids on the CPU name the same hidden states the other way round.
    cpu = CpuPlatform(PlatformCfg(name="cpu"))
    assert [cpu.capture_point(i) for i in (2, 5)] == [
        CapturePoint(layer=2, site=CaptureSite.OUTPUT),
        CapturePoint(layer=5, site=CaptureSite.OUTPUT),
    ]


SAS_TABLE = [
    # native_sas, operator accepts ori_sparse_indices, expected mode (None: PlatformError)
    ("off", True, SasMode.COMPAT),
    ("off", False, SasMode.COMPAT),
    ("auto", True, SasMode.NATIVE),
    ("auto", False, SasMode.COMPAT),
    ("on", True, SasMode.NATIVE),
    ("on", False, None),
]


@pytest.mark.parametrize(("native_sas", "accepts", "expected"), SAS_TABLE)
def test_sas_mode_table(native_sas: str, accepts: bool, expected: SasMode | None) -> None:
    platform = emulated(native_sas, accepts=accepts)
    if expected is None:
        with pytest.raises(PlatformError, match="ori_sparse_indices"):
            select_sas_mode(native_sas, accepts)
        with pytest.raises(PlatformError, match=r"platform\.native_sas=on"):
            platform.sas_mode()
        assert not platform.capabilities.native_sparse_attention
        problems = platform.validate(dtype="float32")
        assert len(problems) == 1 and "does not accept ori_sparse_indices" in problems[0], problems
        return
    assert select_sas_mode(native_sas, accepts) is expected
    assert platform.sas_mode() is expected
    assert platform.capabilities.native_sparse_attention == (expected is SasMode.NATIVE)
    assert platform.validate(dtype="float32") == []


@pytest.mark.parametrize(
    ("native_sas", "accepts", "clause"),
    [
        ("auto", True, f"native ({EMULATED_SAS_OPERATOR} takes ori_sparse_indices)"),
        ("auto", False, f"compat ({EMULATED_SAS_OPERATOR} does not take ori_sparse_indices)"),
        ("off", True, "compat (platform.native_sas=off)"),
    ],
)
def test_headline_names_the_layout_and_the_operator(
    native_sas: str, accepts: bool, clause: str
) -> None:
    # The run headline (engine/report.py) carries step_options().summary().
    summary = emulated(native_sas, accepts=accepts).step_options().summary()
    assert summary.endswith(f"; sparse attention: {clause}"), summary


def test_runtime_fallback_when_operator_rejects_indices() -> None:
    # The probe said yes; the operator then rejected the indices at run time.
    auto = emulated("auto", accepts=True)
    assert auto.sas_mode() is SasMode.NATIVE
    assert auto.sas_mode(operator_accepts_ori_sparse_indices=False) is SasMode.COMPAT
    required = emulated("on", accepts=True)
    with pytest.raises(PlatformError, match="ori_sparse_indices"):
        required.sas_mode(operator_accepts_ori_sparse_indices=False)


@pytest.mark.parametrize(
    ("mode", "window", "gamma", "expected"),
    [
        (SasMode.NATIVE, 128, 5, 132),  # xLLM DSparkSparseTilingUsesSupportedWindow
        (SasMode.COMPAT, 128, 5, 127),
        (SasMode.NATIVE, 128, 0, 127),  # an empty block needs no extra room
        (SasMode.COMPAT, 4, 3, 3),
    ],
)
def test_ori_win_left(mode: SasMode, window: int, gamma: int, expected: int) -> None:
    assert mode.ori_win_left(window, gamma) == expected


def test_ori_win_left_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="window >= 1"):
        SasMode.NATIVE.ori_win_left(0, 3)


def test_real_npu_policy_capabilities() -> None:
    # NpuPlatform's own capabilities, with only detection replaced (no device is touched).
    class PolicyOnly(NpuPlatform):
        @classmethod
        def unavailable_reason(cls) -> str | None:
            return None

        def _probe_sas_operator(self) -> SasOperatorProbe:
            return SasOperatorProbe("npu::npu_sparse_attn_sharedkv", True)

    caps = PolicyOnly(PlatformCfg(name="npu")).capabilities
    assert caps.distributed_backend == "hccl" and caps.native_sparse_attention
    assert not PolicyOnly(
        PlatformCfg(name="npu", native_sas=NativeSas.off)
    ).capabilities.native_sparse_attention
    # The emulation keeps the policy but reports the CPU it runs on.
    emu = emulated().capabilities
    assert emu.distributed_backend == "gloo" and emu.native_sparse_attention


def test_native_sas_on_validates_only_where_supported() -> None:
    assert emulated("on").validate(dtype="bfloat16") == []
    cpu_problems = CpuPlatform(PlatformCfg(name="cpu", native_sas=NativeSas.on)).validate(
        dtype="bfloat16"
    )
    assert any("platform.native_sas=on is only supported on NPU" in p for p in cpu_problems)
