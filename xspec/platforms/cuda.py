"""The CUDA platform: one NVIDIA GPU per process, nccl collectives."""

from __future__ import annotations

import torch

from xspec.platforms.base import Capabilities, ModelOps, Platform


class CudaPlatform(Platform):
    """Runs on ``cuda:<device_index>``: torch ops, steps compiled by inductor by default,
    grouped-GEMM MoE on sm90+ in bf16."""

    name = "cuda"
    description = "NVIDIA GPU via torch.cuda, compiled steps, nccl collectives"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        # is_available() asks the driver for a device count; it creates no CUDA context.
        if not torch.backends.cuda.is_built():
            return (
                f"this torch build ({torch.__version__}) has no CUDA support: "
                "install a CUDA build of torch (see pytorch.org/get-started)"
            )
        if not torch.cuda.is_available():
            return "no CUDA device visible (torch.cuda.is_available() is False)"
        return None

    def _build_capabilities(self) -> Capabilities:
        dtypes = {"float32", "float16"}
        grouped: frozenset[str] = frozenset()
        # Pre-Ampere GPUs (compute capability < 8) have no native bfloat16 matmul. An
        # out-of-range device_index is reported by validate(), not raised here.
        if self.device_index < torch.cuda.device_count():
            major, _minor = torch.cuda.get_device_capability(self.device_index)
            if major >= 8:
                dtypes.add("bfloat16")
            if major >= 9:  # torch._grouped_mm's CUDA kernels: bf16 on sm90+
                grouped = frozenset({"bfloat16"})
        return self.reference_attention_capabilities(
            dtypes=frozenset(dtypes),
            distributed_backend="nccl",
            compile_backend="inductor",
            compile_by_default=True,
            grouped_mm_dtypes=grouped,
            grouped_mm_eager=True,  # no host sync per MoE layer
        )

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def model_ops(self) -> tuple[ModelOps, str]:
        """FP8 block-scaled linears through ``torch._scaled_mm`` where the GPU has FP8
        tensor cores (sm89+; :mod:`.cuda_quant`); everything else the model's reference."""
        from xspec.platforms.cuda_quant import Fp8ScaledMM, fp8_supported

        if self.device_index < torch.cuda.device_count() and fp8_supported(self.device()):
            return ModelOps(quant_linear=Fp8ScaledMM()), "FP8 linears (torch._scaled_mm)"
        return super().model_ops()

    def validate(self, *, dtype: str) -> list[str]:
        problems = super().validate(dtype=dtype)
        count = torch.cuda.device_count()
        if self.device_index >= count:
            problems.append(
                f"platform.device_index={self.device_index} but only {count} CUDA device(s) "
                f"are visible; use 0..{count - 1} or adjust CUDA_VISIBLE_DEVICES"
            )
        return problems

    def memory_available(self) -> int:
        free, _total = torch.cuda.mem_get_info(self.device())
        return int(free)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device())
