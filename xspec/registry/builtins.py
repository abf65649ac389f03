"""The built-in table: every in-tree implementation, one line each, as ``"module:attr"``.

Adding a platform, model or speculative method in tree is one line here (plus its
module); out-of-tree packages use the entry-point groups instead. Nothing listed here is
imported until selected.
"""

from __future__ import annotations

# registry kind -> {name: (target "module:attr", one-line description)}
BUILTINS: dict[str, dict[str, tuple[str, str]]] = {
    "platform": {
        "cpu": ("xspec.platforms.cpu:CpuPlatform", "host CPU, torch ops + native fused kernels"),
        "cuda": ("xspec.platforms.cuda:CudaPlatform", "NVIDIA GPU, nccl"),
        "npu": ("xspec.platforms.npu.platform:NpuPlatform", "Ascend NPU (torch_npu + CANN), hccl"),
        "npu_emulated": (
            "xspec.platforms.npu.emulated:NpuPolicyCpuPlatform",
            "NPU policy (capture +1, SAS mode, validation) on the CPU, for tests",
        ),
        # A resolver: AutoPlatform.create(cfg) returns the npu, cuda or cpu platform.
        "auto": ("xspec.platforms.auto:AutoPlatform", "first usable of npu, cuda, cpu"),
    },
    "model": {
        "qwen3": ("xspec.models.qwen3:FAMILY", "Qwen3 / Qwen3-MoE (Hugging Face layout)"),
        "deepseek_v4": (
            "xspec.models.deepseek_v4:FAMILY",
            "DeepSeek-V4 (official layout, W8A8)",
        ),
    },
    "spec method": {
        "none": ("xspec.spec.baseline:NoDrafter", "no drafting: plain decoding baseline"),
        "mtp": ("xspec.spec.mtp:MtpDrafter", "DeepSeek multi-token prediction head"),
        "dspark": (
            "xspec.spec.dspark:DSparkDrafter",
            "DSpark block drafter (DeepSeek-V4 0731 stages, Qwen3 draft directories)",
        ),
        "dflash": ("xspec.spec.dspark:DFlashDrafter", "DFlash block drafter (Qwen3)"),
        "oracle": (
            "xspec.spec.testing:OracleDrafter",
            "test drafter: proposes the target's tokens",
        ),
        "wrong": (
            "xspec.spec.testing:WrongDrafter",
            "test drafter: always proposes wrong tokens",
        ),
    },
}
