"""FP8 linears on NVIDIA GPUs with ``torch._scaled_mm`` (sm89+: Ada, Hopper, Blackwell).

:class:`Fp8ScaledMM` is the CUDA platform's ``quant_linear`` op (``models.ops``) for FP8
weights with 128x128 block scales: the ``native`` semantics of
:mod:`xspec.models.quantized` (e4m3 activations in per-token blocks of 128, each block's
products summed with both scales applied). One ``_scaled_mm`` per 128-wide K block reads
the stored e4m3 weight in place (its ``[N, K]`` rows are the column-major operand the
kernel wants); the raw block product comes back in fp32 and the activation and weight
block scales are applied to it, then the blocks are summed. Other formats, shapes the
kernel does not take, and GPUs without FP8 tensor cores answer None: the model then
dequantizes the weight for the call (``model.quant_compute=auto``) or runs the plain-torch
semantics (``native``).
"""

from __future__ import annotations

import torch

from xspec.models.quantized import ACT_BLOCK, QuantizedWeight, act_quant_fp8


def fp8_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` has FP8 kernels for ``device`` (sm89 or newer)."""
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


class Fp8ScaledMM:
    """The ``quant_linear`` op for FP8 block-scaled weights (see the module docstring)."""

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        data = weight.data
        n, k = data.shape
        if (
            weight.format != "fp8"
            or data.device.type != "cuda"
            or x.device != data.device
            or tuple(weight.block) != (ACT_BLOCK, ACT_BLOCK)
            or k % ACT_BLOCK
            or n % 16
            or not fp8_supported(data.device)
        ):
            return None
        lead = x.shape[:-1]
        x2 = x.reshape(-1, k)
        m = x2.shape[0]
        rows = -(-m // 16) * 16  # the kernel takes row counts in multiples of 16
        xq, xs = act_quant_fp8(torch.nn.functional.pad(x2.float(), (0, 0, 0, rows - m)))
        w_scale = weight.scale.float().repeat_interleave(ACT_BLOCK, 0)[:n]  # [N, K/128]
        one = torch.ones((), dtype=torch.float32, device=data.device)
        out = torch.zeros(rows, n, dtype=torch.float32, device=data.device)
        for b in range(k // ACT_BLOCK):
            cols = slice(b * ACT_BLOCK, (b + 1) * ACT_BLOCK)
            raw = torch._scaled_mm(
                xq[:, cols].contiguous(),
                data[:, cols].T,  # [128, N], column-major: the stored rows in place
                scale_a=one,
                scale_b=one,
                out_dtype=torch.float32,
            )
            out += raw * xs[:, b : b + 1] * w_scale[:, b].unsqueeze(0)
        if bias is not None:
            out += bias.float()
        return out[:m].to(x.dtype).reshape(*lead, n)
