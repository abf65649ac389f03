"""Ascend NPU platform (torch_npu + CANN).

Two halves, kept apart on purpose:

- policy (no torch_npu): the capture mapping (hooks fire *before* a layer, so the output
  of checkpoint layer L is read at the input of L+1), SAS mode selection from
  ``platform.native_sas``, validation and capabilities. :mod:`.emulated` reuses it on the
  CPU, so CPU tests exercise exactly this code.
- device (torch_npu, imported lazily inside methods): device handle, memory query,
  synchronisation, and loading the modules that register the sparse-attention operator
  before :mod:`.probe` reads its schema.
"""

from __future__ import annotations

import os
from dataclasses import replace
from functools import cached_property
from types import ModuleType
from typing import Any

import torch
from lightning_utilities.core.imports import package_available

from xspec.capture import CapturePoint, CaptureSite
from xspec.errors import PlatformError
from xspec.platforms.base import (
    Capabilities,
    ModelOps,
    Platform,
    SasMode,
    StepOptions,
    check_layer_id,
)
from xspec.platforms.npu.probe import (
    NATIVE_SAS_ARGUMENT,
    SAS_OPERATORS,
    SasOperatorProbe,
    import_registering_modules,
    probe_sas_operator,
)

# Set by CANN's set_env.sh; torch_npu cannot load its kernels without them.
_CANN_ENV_VARS = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
_INSTALL_HINT = (
    "platform=npu needs torch_npu and Ascend CANN: pip install 'xspec[npu]' on a machine "
    "with CANN installed, then source <CANN install dir>/set_env.sh"
)


def select_sas_mode(native_sas: str, operator_accepts: bool) -> SasMode:
    """The SAS mode table (pure policy).

    ==========  ==================  =========================================
    native_sas  operator accepts    mode
    ==========  ==================  =========================================
    off         either              COMPAT
    auto        yes / no            NATIVE / COMPAT (runtime fallback)
    on          yes / no            NATIVE / PlatformError (required)
    ==========  ==================  =========================================
    """
    if native_sas == "off":
        return SasMode.COMPAT
    if operator_accepts:
        return SasMode.NATIVE
    if native_sas == "on":
        raise PlatformError(_operator_rejects_message())
    return SasMode.COMPAT


def _operator_rejects_message() -> str:
    return (
        f"platform.native_sas=on but the installed sparse attention operator does not accept "
        f"{NATIVE_SAS_ARGUMENT}; upgrade torch_npu/CANN or set platform.native_sas=auto or off"
    )


class NpuPlatform(Platform):
    """Ascend NPU: +1 capture mapping, native SAS where the operator allows, hccl."""

    name = "npu"
    description = "Ascend NPU via torch_npu + CANN: native sparse attention, hccl"
    supports_native_sas_option = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # find_spec only: importing torch_npu where CANN is missing can break torch itself.
        missing = []
        if not package_available("torch_npu"):
            missing.append("torch_npu is not installed")
        if not any(os.environ.get(var) for var in _CANN_ENV_VARS):
            missing.append(f"Ascend CANN is not set up ({' / '.join(_CANN_ENV_VARS)} unset)")
        if missing:
            return f"{'; '.join(missing)}. {_INSTALL_HINT}"
        return None

    # ---- policy: no torch_npu below this line until the device section ----

    @cached_property
    def sas_operator(self) -> SasOperatorProbe:
        """The installed SAS operator, probed once (see :mod:`.probe`)."""
        return self._probe_sas_operator()

    @property
    def operator_accepts_ori_sparse_indices(self) -> bool:
        """Whether the installed SAS operator takes explicit ``ori_sparse_indices``."""
        return self.sas_operator.accepts_ori_sparse_indices

    def sas_summary(self) -> str:
        """The run report's clause on the draft window layout: the mode, and the operator
        the probe found (or that none was) as the reason. ``off`` probes nothing."""
        if self.native_sas == "off":
            return "sparse attention: compat (platform.native_sas=off)"
        probe = self.sas_operator
        mode = SasMode.NATIVE if probe.accepts_ori_sparse_indices else SasMode.COMPAT
        return f"sparse attention: {mode.value} ({probe.describe()})"

    def step_options(self) -> StepOptions:
        # The run headline (xspec: model=... platform=...) prints this line: add the SAS
        # layout and the operator the probe found.
        if self._step_options is None:
            options = super().step_options()
            self._step_options = replace(
                options, describe=f"{options.describe}; {self.sas_summary()}"
            )
        return self._step_options

    def model_ops(self) -> tuple[ModelOps, str]:
        """W8A8 dynamic linears through ``npu_dynamic_quant`` + ``npu_quant_matmul``
        (:mod:`.quant`); every other op: the model's reference."""
        from xspec.platforms.npu.quant import W8A8DynamicLinear

        op = W8A8DynamicLinear(self._quant_kernels)  # torch_npu imported at the first call
        return ModelOps(quant_linear=op), "W8A8 dynamic linears (npu_quant_matmul)"

    def _quant_kernels(self) -> Any:
        """The module holding the W8A8 operators: ``torch_npu``."""
        import torch_npu  # only here: the NPU plugin

        return torch_npu

    def _build_capabilities(self) -> Capabilities:
        native = self.native_sas != "off" and self.operator_accepts_ori_sparse_indices
        return Capabilities(
            native_sparse_attention=native,
            distributed_backend="hccl",
            # Step compilation on Ascend goes through torchair (a graph mode xspec does
            # not wire yet): compile_backend stays None, so platform.compile=on is
            # refused and auto runs eager. torch_npu's npu_grouped_matmul and a fused
            # mHC operator would plug in through model_ops(); not wired either.
        )

    def capture_point(self, checkpoint_layer_id: int) -> CapturePoint:
        # Capture hooks run at the top of each layer: "output of L" == "input of L+1".
        check_layer_id(checkpoint_layer_id)
        return CapturePoint(layer=checkpoint_layer_id + 1, site=CaptureSite.INPUT)

    def sas_mode(self, operator_accepts_ori_sparse_indices: bool | None = None) -> SasMode:
        """SAS mode for ``platform.native_sas`` (see :func:`select_sas_mode`).

        With no argument, uses the probed operator. The attention backend passes
        ``False`` after the operator rejected explicit indices at run time, which under
        ``auto`` falls back to COMPAT and under ``on`` raises.
        """
        accepts = operator_accepts_ori_sparse_indices
        if accepts is None:
            accepts = self.operator_accepts_ori_sparse_indices
        return select_sas_mode(self.native_sas, accepts)

    def validate(self, *, dtype: str) -> list[str]:
        problems = super().validate(dtype=dtype)
        if self.native_sas == "on" and not self.operator_accepts_ori_sparse_indices:
            problems.append(_operator_rejects_message())
        problems.extend(self._device_problems())
        return problems

    # ---- device: everything that needs torch_npu ----

    def _probe_sas_operator(self) -> SasOperatorProbe:
        """Which SAS operator is registered, and does its schema declare ``ori_sparse_indices``?

        Reads the registered schemas of every namespace in ``SAS_OPERATORS`` (torch_npu's
        ``npu``, vllm-ascend's ``_C_ascend``) instead of calling the operator: some older
        operators abort during tiling (not a Python error) when given explicit indices, so
        a trial call is unsafe. Unverified against every CANN release;
        ``native_sas=off`` is the escape hatch.
        """
        self._import_operator_modules()
        return probe_sas_operator(SAS_OPERATORS)

    def _import_operator_modules(self) -> None:
        """Import torch_npu and the other modules that register SAS operators."""
        _import_torch_npu()
        import_registering_modules(SAS_OPERATORS)

    def _device_problems(self) -> list[str]:
        torch_npu = _import_torch_npu()
        count = int(torch_npu.npu.device_count())
        if self.device_index >= count:
            return [
                f"platform.device_index={self.device_index} but only {count} NPU(s) are visible; "
                f"use 0..{count - 1} or adjust ASCEND_RT_VISIBLE_DEVICES"
            ]
        return []

    def device(self) -> torch.device:
        _import_torch_npu()  # registers the "npu" device type with torch
        return torch.device("npu", self.device_index)

    def memory_available(self) -> int:
        free, _total = _import_torch_npu().npu.mem_get_info(self.device())
        return int(free)

    def synchronize(self) -> None:
        _import_torch_npu().npu.synchronize(self.device())


def _import_torch_npu() -> ModuleType:
    """Import torch_npu on first use (only ever called from NpuPlatform's device methods)."""
    try:
        import torch_npu
    except ImportError as exc:
        raise PlatformError(f"cannot import torch_npu ({exc}). {_INSTALL_HINT}") from exc
    return torch_npu
