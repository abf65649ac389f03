"""W8A8 dynamic linears on Ascend: ``npu_dynamic_quant`` + ``npu_quant_matmul``.

:class:`W8A8DynamicLinear` is the platform's ``quant_linear`` op (``models.ops``): it
quantizes the activations per token and runs the int8 GEMM with the weight as msModelSlim
stores it, the call sites of vllm-ascend's ``quantization/w8a8_dynamic.py``::

    x_int8, pertoken_scale = npu_dynamic_quant(x)                # [M, K] int8, [M] fp32
    y = npu_quant_matmul(x_int8, w_int8.T, w_scale.flatten(),    # w_int8.T: [K, N]
                         pertoken_scale=pertoken_scale, bias=bias, output_dtype=x.dtype)

It takes the operators as an argument: the NPU plugin passes ``torch_npu`` (imported only
there), the emulated platform :class:`EmulatedQuantOps`, plain-torch functions with the
operators' documented semantics (per-token symmetric int8 ``round(x / (max|x| / 127))``;
int32 accumulation; ``acc * pertoken_scale * scale`` in fp32, ``+ bias``, cast to
``output_dtype``), so the argument plumbing, layouts and scale shapes are tested on the CPU.
Formats other than W8A8 and weights with a non-zero offset (asymmetric, which the NPU call
above does not take) answer None: the model runs its reference for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from xspec.models.quantized import QuantizedWeight, dynamic_quant_int8, int8_matmul


class EmulatedQuantOps:
    """``torch_npu``'s W8A8 operators as documented, in plain torch (the CPU stand-in)."""

    @staticmethod
    def npu_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., K]`` -> ``(int8 [..., K], scale fp32 [...])`` per token."""
        q, scale = dynamic_quant_int8(x.reshape(-1, x.shape[-1]))
        return q.reshape(x.shape), scale.reshape(x.shape[:-1])

    @staticmethod
    def npu_quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        *,
        offset: torch.Tensor | None = None,
        pertoken_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``x1 [M, K]`` int8 @ ``x2 [K, N]`` int8 (int32 accumulation), times ``scale
        [N]`` (or [1]) and ``pertoken_scale [M]`` -> ``[M, N]`` in ``output_dtype``."""
        if x1.dtype != torch.int8 or x2.dtype != torch.int8:
            raise TypeError(f"npu_quant_matmul takes int8 x1, x2; got {x1.dtype}, {x2.dtype}")
        if x1.dim() != 2 or x2.dim() != 2 or x1.shape[1] != x2.shape[0]:
            raise ValueError(f"npu_quant_matmul shapes {list(x1.shape)} @ {list(x2.shape)}")
        n = x2.shape[1]
        if scale.dim() != 1 or scale.shape[0] not in (1, n):
            raise ValueError(f"scale must be [{n}] or [1], got {list(scale.shape)}")
        if offset is not None:
            raise NotImplementedError("the emulation serves symmetric weights (offset=None)")
        acc = int8_matmul(x1, x2.T).float()  # [M, N]
        if pertoken_scale is not None:
            if list(pertoken_scale.shape) != [x1.shape[0]]:
                raise ValueError(
                    f"pertoken_scale must be [{x1.shape[0]}], got {list(pertoken_scale.shape)}"
                )
            acc = acc * pertoken_scale.float().unsqueeze(-1)
        y = acc * scale.float().unsqueeze(0)
        if bias is not None:
            y = y + bias.float()
        return y.to(output_dtype or torch.float16)


class W8A8DynamicLinear:
    """The ``quant_linear`` op for W8A8 weights through the operators ``provide()``
    returns on first use (``torch_npu`` or :class:`EmulatedQuantOps`: building the
    platform's ops imports nothing); see the module docstring."""

    def __init__(self, provide: Callable[[], Any]) -> None:
        self._provide = provide
        self._kernels: Any = None

    @property
    def kernels(self) -> Any:
        """The operators (resolved once)."""
        if self._kernels is None:
            self._kernels = self._provide()
        return self._kernels

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        if weight.format != "w8a8" or x.device != weight.data.device:
            return None
        if weight.offset is not None and bool(weight.offset.ne(0).any()):
            return None  # asymmetric: the reference semantics handle the offset
        lead, k = x.shape[:-1], x.shape[-1]
        x_int8, pertoken_scale = self.kernels.npu_dynamic_quant(x.reshape(-1, k))
        y = self.kernels.npu_quant_matmul(
            x_int8,
            weight.data.transpose(0, 1),  # [K, N]: the layout the NPU GEMM takes
            weight.scale.reshape(-1),  # [N]
            pertoken_scale=pertoken_scale,  # [M]
            bias=None if bias is None else bias.float(),  # fp32 bias, as the op requires
            output_dtype=x.dtype,
        )
        return y.reshape(*lead, y.shape[-1])
