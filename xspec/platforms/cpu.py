"""The CPU platform: fp32-deterministic reference for every parity test."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from xspec.models.ops import REFERENCE_OPS, ModelOps
from xspec.platforms.base import Capabilities, Platform

# cgroup v2 reports "max" when unlimited; v1 reports a huge number (PAGE_COUNTER_MAX).
_CGROUP_UNLIMITED = 1 << 60


class HostDevice:
    """Device hooks of a platform that executes on the host CPU (mixed in before Platform)."""

    default_memory_fraction = 0.5  # the host's RAM is shared with everything else

    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_available(self) -> int:
        return host_memory_available()

    def synchronize(self) -> None:
        # CPU ops run synchronously; nothing is queued.
        return None

    def rank_device_index(self, local_rank: int) -> int:
        return 0  # every process of the node shares the one host device

    def _device_problems(self) -> list[str]:
        # torch has one "cpu" device (all cores); an index > 0 would select nothing different
        device_index = getattr(self, "device_index", 0)
        if device_index != 0:
            return [
                f"platform.device_index={device_index}: the host CPU is one device, index 0; "
                "drop the override (threads: torch.set_num_threads / OMP_NUM_THREADS)"
            ]
        return []


class CpuPlatform(HostDevice, Platform):
    """Runs everything on the host CPU: torch ops, plus native fused kernels (mHC,
    RMSNorm, RoPE, indexer top-k; built on first use with the system C compiler, see
    ``platforms/native``)."""

    name = "cpu"
    description = "host CPU, torch ops + native fused kernels, gloo collectives"

    def _build_capabilities(self) -> Capabilities:
        # inductor compiles on the host, but per compiled region the guard and call
        # overhead (~0.1 ms in a real step) eats what fusion saves at decode sizes, so
        # platform.compile=auto stays eager here (measured: docs/performance.md)
        return self.reference_attention_capabilities(
            compile_backend="inductor",
            compile_by_default=False,
            grouped_mm_dtypes=frozenset({"float32", "bfloat16"}),
            grouped_mm_eager=False,
        )

    def model_ops(self) -> tuple[ModelOps, str]:
        from xspec.platforms import native

        kernels, line = native.load()
        return (kernels.ops() if kernels is not None else REFERENCE_OPS), line

    def gemm_row_tile(self, dtype: torch.dtype) -> int | None:
        """Probed once per dtype: MKL serves a row count below 12 that is not a multiple
        of 4 with other kernels than a longer call, so 4 is the usual answer."""
        return _host_row_tile(dtype)

    def validate(self, *, dtype: str) -> list[str]:
        problems = super().validate(dtype=dtype)
        return problems + self._device_problems()


@functools.cache
def _host_row_tile(dtype: torch.dtype) -> int | None:
    from xspec.models.invariant import probe_row_tile

    return probe_row_tile(torch.device("cpu"), dtype)


def host_memory_available() -> int:
    """Bytes of host memory this process may still use.

    The smaller of the machine's available memory (psutil if installed, else
    /proc/meminfo MemAvailable) and the container's cgroup headroom: inside a container
    MemAvailable describes the whole host, not our limit.
    """
    available = _machine_available()
    headroom = _cgroup_headroom()
    return available if headroom is None else min(available, headroom)


def _machine_available() -> int:
    try:
        import psutil  # optional; more portable than /proc

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # the file reports kB
    except OSError:
        pass
    # Last resort (non-Linux without psutil): free physical pages.
    return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def _cgroup_headroom() -> int | None:
    """limit - usage of this process's memory cgroup, or None when unlimited/unknown."""
    candidates = (
        (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),  # v2
        (
            Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # v1
            Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        ),
    )
    for limit_file, usage_file in candidates:
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        limit = int(limit_text)
        if limit >= _CGROUP_UNLIMITED:
            return None
        return max(limit - usage, 0)
    return None
