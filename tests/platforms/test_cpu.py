"""CPU platform: conformance, auto resolution, and the base-class contract checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.platforms.conformance import NativeSas, PlatformCfg, PlatformConformance
from xspec.errors import ConfigError, PlatformError
from xspec.models.base import CapturePoint, CaptureSite
from xspec.models.ops import REFERENCE_OPS, ModelOps
from xspec.platforms import get_platform
from xspec.platforms.auto import AutoPlatform
from xspec.platforms.base import Capabilities, Platform
from xspec.platforms.compile import StepCompiler
from xspec.platforms.cpu import CpuPlatform, host_memory_available
from xspec.platforms.cuda import CudaPlatform
from xspec.platforms.npu.emulated import NpuPolicyCpuPlatform
from xspec.platforms.npu.platform import NpuPlatform


class TestCpuConformance(PlatformConformance):
    def make_platform(self, native_sas: str = "auto") -> Platform:
        return CpuPlatform(PlatformCfg(name="cpu", native_sas=NativeSas(native_sas)))


def test_cpu_answers() -> None:
    platform = get_platform(PlatformCfg(name="cpu"))
    assert isinstance(platform, CpuPlatform)
    assert platform.device() == torch.device("cpu")
    assert platform.capture_point(3) == CapturePoint(layer=3, site=CaptureSite.OUTPUT)
    # the conservative defaults, except the draft window (the reference torch attention
    # takes explicit, native, index sets) and the step functions: inductor compiles them
    # (on request: auto stays eager on the host) and grouped GEMMs take fp32 and bf16
    assert platform.capabilities == Capabilities(
        native_sparse_attention=True,
        compile_backend="inductor",
        grouped_mm_dtypes=frozenset({"float32", "bfloat16"}),
    )
    assert platform.distributed_backend() == "gloo"


def test_step_options_follow_platform_compile_and_kernels() -> None:
    default = CpuPlatform(PlatformCfg(name="cpu")).step_options()
    assert default.compile is None  # auto: eager on the host
    ops = default.ops
    assert ops.mhc_pre is not None and ops.rope is not None  # (a C compiler here)
    assert ops.grouped_mm_eager is False
    reference = CpuPlatform(PlatformCfg(name="cpu", kernels="reference")).step_options()
    assert reference.ops.mhc_pre is None and "reference torch ops" in reference.describe
    compiled = CpuPlatform(PlatformCfg(name="cpu", compile="on")).step_options()
    assert isinstance(compiled.compile, StepCompiler) and compiled.compile.backend == "inductor"
    assert "compiled (inductor)" in compiled.summary() and "0 graphs" in compiled.summary()
    assert CpuPlatform(PlatformCfg(name="cpu", compile="off")).step_options().compile is None


@pytest.mark.parametrize(("key", "value"), [("compile", "yes"), ("kernels", "native")])
def test_bad_step_settings_are_config_errors(key: str, value: str) -> None:
    with pytest.raises(ConfigError, match=f"platform.{key}={value!r} is not a valid choice"):
        CpuPlatform(PlatformCfg(name="cpu", **{key: value}))


def test_compile_on_where_the_platform_cannot_compile_is_refused() -> None:
    platform = NpuPolicyCpuPlatform(PlatformCfg(name="npu_emulated", compile="on"))
    problems = platform.validate(dtype="float32")
    assert any("platform.compile=on" in p and "cannot compile" in p for p in problems), problems
    auto = NpuPolicyCpuPlatform(PlatformCfg(name="npu_emulated")).step_options()
    assert auto.compile is None


def test_native_sas_on_rejected_on_cpu() -> None:
    platform = CpuPlatform(PlatformCfg(name="cpu", native_sas=NativeSas.on))
    problems = platform.validate(dtype="float32")
    assert len(problems) == 1, problems
    assert "platform.native_sas=on" in problems[0] and "platform=cpu" in problems[0]


def test_batch_invariant_pads_fp32_gemm_rows_and_drops_grouped_gemms() -> None:
    platform = CpuPlatform(PlatformCfg(name="cpu", batch_invariant=True))
    steps, tile = platform.step_options(), platform.gemm_row_tile(torch.float32)
    assert tile is not None and steps.row_tile == tile  # MKL on AVX2: 4
    assert ("batch-invariant" in steps.describe) == (tile > 1)
    if tile > 1:  # expert groups' rows follow the batch: per-expert GEMMs
        assert steps.ops.grouped_mm_dtypes == frozenset()
    assert CpuPlatform(PlatformCfg(name="cpu")).step_options().row_tile == 1


@pytest.mark.parametrize(
    ("settings", "dtype", "needle"),
    [
        ({"compile": "on"}, "float32", "runs eager steps: set platform.compile=off"),
        ({"kernels": "reference"}, "float32", "platform.kernels=reference"),
        ({}, "bfloat16", "model.dtype=bfloat16"),
    ],
)
def test_batch_invariant_where_it_is_not_shown_is_refused(
    settings: dict[str, str], dtype: str, needle: str
) -> None:
    platform = CpuPlatform(PlatformCfg(name="cpu", batch_invariant=True, **settings))
    problems = platform.validate(dtype=dtype)
    assert any("platform.batch_invariant=true" in p and needle in p for p in problems), problems
    assert (
        CpuPlatform(PlatformCfg(name="cpu", batch_invariant=True)).validate(dtype="float32") == []
    )


def test_batch_invariant_without_the_kernels_loaded_is_refused() -> None:
    """kernels=auto where the native kernels did not load (no C compiler): the reference
    attention runs, which is not batch-invariant."""

    class NoKernels(CpuPlatform):
        def model_ops(self) -> tuple[ModelOps, str]:
            return REFERENCE_OPS, "no C compiler (set $CC); using the reference torch ops"

    problems = NoKernels(PlatformCfg(name="cpu", batch_invariant=True)).validate(dtype="float32")
    assert any("needs the platform's attention kernel" in p for p in problems), problems


def test_batch_invariant_needs_the_platform_to_promise_row_invariant_gemms() -> None:
    """A platform that does not override ``gemm_row_tile`` (the NPU policy emulation)."""
    platform = NpuPolicyCpuPlatform(PlatformCfg(name="npu_emulated", batch_invariant=True))
    problems = platform.validate(dtype="float32")
    assert any("does not make its fp32 GEMMs row-invariant" in p for p in problems), problems


def test_host_memory_within_meminfo() -> None:
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        pytest.skip("no /proc/meminfo on this OS")
    total_kb = next(
        int(line.split()[1])
        for line in meminfo.read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    free = host_memory_available()
    assert 0 < free <= total_kb * 1024


def test_auto_resolves_to_cpu_here() -> None:
    if NpuPlatform.unavailable_reason() is None or CudaPlatform.unavailable_reason() is None:
        pytest.skip("an accelerator is usable here; auto would (correctly) pick it")
    assert AutoPlatform.resolve() is CpuPlatform
    platform = get_platform(PlatformCfg(name="auto", native_sas=NativeSas.off))
    assert type(platform) is CpuPlatform
    assert platform.native_sas == "off"


def test_auto_is_not_instantiable() -> None:
    with pytest.raises(TypeError):
        AutoPlatform(PlatformCfg(name="auto"))  # type: ignore[abstract]


def test_get_platform_unknown_name_lists_known() -> None:
    with pytest.raises(ConfigError, match=r"unknown platform 'cpux'; known: auto, cpu, cuda, npu"):
        get_platform(PlatformCfg(name="cpux"))


def test_get_platform_with_real_config_schema() -> None:
    config = pytest.importorskip("xspec.config")
    platform = get_platform(config.PlatformConfig(name="cpu"))
    assert isinstance(platform, CpuPlatform) and platform.native_sas == "auto"


def test_bad_config_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"platform\.native_sas='maybe'"):
        CpuPlatform(PlatformCfg(name="cpu", native_sas="maybe"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"platform\.device_index=-1"):
        CpuPlatform(PlatformCfg(name="cpu", device_index=-1))


@pytest.mark.parametrize("name", ["cpu", "npu_emulated"])
def test_host_platforms_have_one_device(name: str) -> None:
    ok = get_platform(PlatformCfg(name=name))
    assert ok.validate(dtype="float32") == []
    bad = get_platform(PlatformCfg(name=name, device_index=1))
    problems = bad.validate(dtype="float32")
    assert any("platform.device_index=1: the host CPU is one device" in p for p in problems)


def test_unavailable_platform_raises_its_reason() -> None:
    class Missing(CpuPlatform):
        name = "missing"

        @classmethod
        def unavailable_reason(cls) -> str | None:
            return "needs the frobnicator: pip install frob"

    with pytest.raises(PlatformError, match=r"platform=missing cannot run here: needs the frob"):
        Missing(PlatformCfg(name="missing"))


def test_hook_with_wrong_signature_fails_at_class_definition() -> None:
    with pytest.raises(TypeError, match=r"capture_point has parameters"):

        class Renamed(CpuPlatform):
            name = "renamed"

            def capture_point(self, layer: int) -> CapturePoint:
                return CapturePoint(layer=layer, site=CaptureSite.OUTPUT)

    with pytest.raises(TypeError, match=r"validate has parameters"):

        class Positional(CpuPlatform):
            name = "positional"

            def validate(self, dtype: str, num_speculative_tokens: int) -> list[str]:
                return []
