"""The NPU plugin's policy on the CPU device.

:class:`NpuPolicyCpuPlatform` runs the NPU plugin's policy (capture +1 mapping, SAS mode
selection, validation) on the CPU device; for tests and for comparing capture
conventions. It is a real subclass of :class:`NpuPlatform` that replaces only the
device half (device, memory, synchronisation, operator probe), so ``platform=npu_emulated``
next to ``platform=cpu`` shows that capturing at the input of L+1 yields the same hidden
states as capturing at the output of L.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from xspec.platforms.base import (
    Capabilities,
    DraftAttentionOp,
    PlatformSettings,
    SasIndicesRejected,
)
from xspec.platforms.cpu import HostDevice
from xspec.platforms.npu.platform import NpuPlatform
from xspec.platforms.npu.probe import SasOperatorProbe

# What the emulation's probe names as the operator: the reference torch attention (or,
# with operator_accepts_ori_sparse_indices=False, a double of an older operator).
EMULATED_SAS_OPERATOR = "reference sparse_attention (emulated)"


class NpuPolicyCpuPlatform(HostDevice, NpuPlatform):
    """NPU policy, CPU device. Needs neither torch_npu nor CANN."""

    name = "npu_emulated"
    description = "NPU plugin policy (capture +1, SAS mode selection, validation) on the CPU"

    def __init__(
        self,
        cfg: PlatformSettings,
        *,
        operator_accepts_ori_sparse_indices: bool = True,
        operator_rejects_at_run_time: bool = False,
    ) -> None:
        # Stands in for the operator probe. Default True: the reference torch attention
        # reproduces explicit index sets, so native SAS is servable on the CPU.
        self._operator_accepts = operator_accepts_ori_sparse_indices
        # An operator double whose schema declares the argument but which refuses explicit
        # indices when called (as older CANN releases do): exercises the runtime fallback.
        self._rejects_at_run_time = operator_rejects_at_run_time
        super().__init__(cfg)

    def draft_window_attention(self) -> DraftAttentionOp | None:
        if not self._rejects_at_run_time:
            return None  # the model's reference attention

        def rejecting(
            q: torch.Tensor,
            parts: list[tuple[torch.Tensor, torch.Tensor]],
            sink: torch.Tensor,
            scale: float,
            *,
            explicit_indices: bool,
        ) -> torch.Tensor | None:
            if explicit_indices:
                raise SasIndicesRejected("operator double: ori_sparse_indices is not supported")
            return None  # compatibility indices: the model's reference runs them

        return rejecting

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None

    def _build_capabilities(self) -> Capabilities:
        # Keep the NPU's policy answers; device-bound ones follow the CPU it really runs on.
        return replace(super()._build_capabilities(), distributed_backend="gloo")

    def _quant_kernels(self) -> Any:
        # the W8A8 operators' documented semantics in plain torch (platforms/npu/quant.py)
        from xspec.platforms.npu.quant import EmulatedQuantOps

        return EmulatedQuantOps()

    def _probe_sas_operator(self) -> SasOperatorProbe:
        return SasOperatorProbe(EMULATED_SAS_OPERATOR, self._operator_accepts)
