"""``platform=example_cpu``: the host CPU, answering the contract its own way.

It differs from xspec's built-in ``cpu`` platform in ways a run can observe, so a test
can tell the plugin is really in use:

- capture points use the "hooks fire before a layer" convention (output of layer L is
  read at the input of L+1), like an NPU runtime;
- it serves only float32 and at most 4 speculative tokens;
- it runs exactly one op for the models, ``rms_norm`` (:class:`CountingRmsNorm`), and
  leaves every other op to the model's reference (``ModelOps`` fields left None).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from xspec.capture import CapturePoint, CaptureSite
from xspec.models.ops import ModelOps
from xspec.platforms.base import Capabilities, check_layer_id
from xspec.platforms.cpu import CpuPlatform


class CountingRmsNorm:
    """An ``rms_norm`` op (``xspec.models.ops.RmsNormOp``) that counts its calls.

    It takes float32 inputs only: for any other dtype it answers None, and the model runs
    its reference op for that call. What it computes equals the reference bit for bit,
    so greedy output is the same as on the reference ops.
    """

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None:
        if x.dtype != torch.float32:
            return None
        self.calls += 1
        return F.rms_norm(x, x.shape[-1:], weight, eps)


class ExampleCpuPlatform(CpuPlatform):
    """CPU device, pre-layer capture hooks, float32 only, gamma <= 4, one op."""

    name = "example_cpu"
    description = "example plugin: host CPU with pre-layer capture hooks, float32, gamma <= 4"

    def _build_capabilities(self) -> Capabilities:
        return Capabilities(dtypes=frozenset({"float32"}), max_speculative_tokens=4)

    def capture_point(self, checkpoint_layer_id: int) -> CapturePoint:
        check_layer_id(checkpoint_layer_id)
        return CapturePoint(layer=checkpoint_layer_id + 1, site=CaptureSite.INPUT)

    def model_ops(self) -> tuple[ModelOps, str]:
        # one op; every field left None runs the model's reference op
        return ModelOps(rms_norm=CountingRmsNorm()), "example rms_norm op, reference torch ops"
