"""``platform=example_cpu``: the host CPU, answering the contract its own way.

It differs from xspec's built-in ``cpu`` platform in ways a run can observe, so a test
can tell the plugin is really in use:

- capture points use the "hooks fire before a layer" convention (output of layer L is
  read at the input of L+1), like an NPU runtime;
- it serves only float32 and at most 4 speculative tokens.
"""

from __future__ import annotations

from xspec.models.base import CapturePoint, CaptureSite
from xspec.platforms.base import Capabilities, check_layer_id
from xspec.platforms.cpu import CpuPlatform


class ExampleCpuPlatform(CpuPlatform):
    """CPU device, pre-layer capture hooks, float32 only, gamma <= 4."""

    name = "example_cpu"
    description = "example plugin: host CPU with pre-layer capture hooks, float32, gamma <= 4"

    def _build_capabilities(self) -> Capabilities:
        return Capabilities(dtypes=frozenset({"float32"}), max_speculative_tokens=4)

    def capture_point(self, checkpoint_layer_id: int) -> CapturePoint:
        check_layer_id(checkpoint_layer_id)
        return CapturePoint(layer=checkpoint_layer_id + 1, site=CaptureSite.INPUT)
