"""Reusable conformance suite for platform plugins (in-tree and out-of-tree).

Usage, in a test module::

    class TestMyPlatform(PlatformConformance):
        def make_platform(self, native_sas: str = "auto") -> Platform:
            return MyPlatform(PlatformCfg(name="mine", native_sas=NativeSas(native_sas)))

Every check is about the contract in ``xspec/platforms/base.py``: typed capture points
that mean "output of layer L", frozen capabilities read once, validation that lists every
problem by key, the SAS mode policy, the small device services, imports that do no
device work, and a short generation on ``platform.device()`` (baseline, oracle and MTP
drafters on dsv4_tiny_random) that fails on any host/device tensor mixing in the step. The class name does not start with ``Test``, so pytest collects it only
through subclasses.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from xspec import registry
from xspec.config import ModelConfig, SpecConfig
from xspec.errors import ConfigError
from xspec.models.base import EAGER_STEPS, CapturePoint, CaptureSite
from xspec.platforms.base import Capabilities, Platform, SasMode

KNOWN_DTYPES = {"float32", "bfloat16", "float16"}


class NativeSas(str, enum.Enum):
    """Mirrors the config's ``platform.native_sas`` choice (platforms compare ``.value``)."""

    auto = "auto"
    on = "on"
    off = "off"


@dataclass
class PlatformCfg:
    """A platform config section, duck-typed like ``xspec.config.PlatformConfig``."""

    name: str
    device_index: int = 0
    native_sas: NativeSas = NativeSas.auto
    compile: str = "auto"
    kernels: str = "auto"
    batch_invariant: bool = False


# Run in a fresh interpreter: import the given modules, report what got loaded.
_IMPORT_PROBE = """
import importlib, json, sys
import torch
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({
    "torch_npu": "torch_npu" in sys.modules,
    "cuda_initialized": torch.cuda.is_initialized(),
}))
"""


@functools.cache
def import_probe(*modules: str) -> dict[str, bool]:
    """Import ``modules`` in a subprocess (same sys.path) and report device side effects.

    Cached per module tuple: a fresh interpreter costs seconds, and the answer cannot change.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, *modules],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, f"importing {modules} failed:\n{out.stderr}"
    result: dict[str, bool] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


GENERATION_PROMPTS = [[5, 17, 42, 99, 3, 250, 11], [300, 7]]
GENERATION_TOKENS = 6


@functools.cache
def _tiny_dsv4(device: str) -> Any:
    """dsv4_tiny_random loaded on ``device`` once per test session (read-only: states are per run)."""
    cfg = ModelConfig(arch="deepseek_v4", preset="tiny_random")
    return registry.models.get("deepseek_v4").load(
        cfg, device=torch.device(device), max_rollback=8, steps=EAGER_STEPS
    )


def generate_on(platform: Platform, method: str, gamma: int | None) -> list[list[int]]:
    """Greedy tokens of GENERATION_PROMPTS through the engine, on the platform's device."""
    from xspec.engine.engine import Engine, Request
    from xspec.sampling import SamplingParams

    target = _tiny_dsv4(str(platform.device()))
    drafter = registry.spec_methods.get(method)(
        SpecConfig(method=method, num_speculative_tokens=gamma),
        target=target,
        model_cfg=ModelConfig(arch="deepseek_v4", preset="tiny_random"),
        platform=platform,
        steps=EAGER_STEPS,
    )
    engine = Engine(target, drafter, [], stop_ids=frozenset(), synchronize=platform.synchronize)
    requests = [Request(p, GENERATION_TOKENS, SamplingParams()) for p in GENERATION_PROMPTS]
    return [g.token_ids for g in engine.run(requests, concurrency=2)]


class PlatformConformance:
    """The platform contract, checked for whatever ``make_platform`` builds."""

    def make_platform(self, native_sas: str = "auto") -> Platform:
        raise NotImplementedError("subclasses build their platform here")

    @pytest.fixture
    def platform(self) -> Platform:
        return self.make_platform()

    def test_is_a_registered_platform(self, platform: Platform) -> None:
        assert isinstance(platform, Platform)
        assert isinstance(platform.name, str) and platform.name
        # The registry key and the class's name agree, and the registry hands back this class.
        assert registry.platforms.get(platform.name) is type(platform)
        assert type(platform).unavailable_reason() is None

    def test_capture_point_means_output_of_layer(self, platform: Platform) -> None:
        offsets = set()
        for layer in range(6):
            point = platform.capture_point(layer)
            assert isinstance(point, CapturePoint), f"capture_point({layer}) -> {point!r}"
            assert isinstance(point.site, CaptureSite)
            # Only two ways to name "output of layer L": after L, or before L+1.
            assert (point.layer, point.site) in {
                (layer, CaptureSite.OUTPUT),
                (layer + 1, CaptureSite.INPUT),
            }, f"capture_point({layer}) -> {point!r}"
            offsets.add((point.layer - layer, point.site))
        assert len(offsets) == 1, f"one convention for every layer, got {offsets}"

    def test_capture_point_refuses_negative_layer(self, platform: Platform) -> None:
        with pytest.raises(ConfigError, match="negative"):
            platform.capture_point(-2)

    def test_capture_point_minus_one_is_the_embedding_output(self, platform: Platform) -> None:
        # "output of layer -1" = the embedding output = the input of layer 0, whichever
        # convention the platform uses for real layers
        assert platform.capture_point(-1) == CapturePoint(layer=0, site=CaptureSite.INPUT)

    def test_capabilities_frozen_and_read_once(self, platform: Platform) -> None:
        caps = platform.capabilities
        assert isinstance(caps, Capabilities)
        assert platform.capabilities is caps, "capabilities must be computed once"
        with pytest.raises(dataclasses.FrozenInstanceError):
            caps.all_to_all = not caps.all_to_all  # type: ignore[misc]
        assert isinstance(caps.dtypes, frozenset) and caps.dtypes
        assert caps.dtypes <= KNOWN_DTYPES, f"unknown dtype names {caps.dtypes - KNOWN_DTYPES}"
        assert caps.max_speculative_tokens >= 1
        assert platform.distributed_backend() == caps.distributed_backend
        assert isinstance(caps.distributed_backend, str) and caps.distributed_backend

    def test_validate_accepts_what_it_advertises(self, platform: Platform) -> None:
        for dtype in sorted(platform.capabilities.dtypes):
            assert platform.validate(dtype=dtype) == [], dtype

    def test_validate_lists_every_problem_by_key(self, platform: Platform) -> None:
        problems = platform.validate(dtype="float8_e4m3fn")
        assert isinstance(problems, list) and all(isinstance(p, str) for p in problems)
        assert any("model.dtype" in p and "float8_e4m3fn" in p for p in problems), problems

    def test_native_sas_on_is_served_or_refused_by_key(self) -> None:
        platform = self.make_platform(native_sas="on")
        problems = platform.validate(dtype="float32")
        if platform.capabilities.native_sparse_attention:
            assert problems == []
            assert platform.sas_mode() is SasMode.NATIVE
        else:
            assert any("platform.native_sas=on" in p for p in problems), problems

    def test_native_sas_off_is_compat(self) -> None:
        platform = self.make_platform(native_sas="off")
        assert platform.sas_mode() is SasMode.COMPAT
        assert not platform.capabilities.native_sparse_attention

    def test_sas_mode_matches_capabilities(self, platform: Platform) -> None:
        mode = platform.sas_mode()
        assert isinstance(mode, SasMode)
        assert (mode is SasMode.NATIVE) == platform.capabilities.native_sparse_attention
        expected = 128 + 5 - 1 if mode is SasMode.NATIVE else 128 - 1
        assert mode.ori_win_left(128, 5) == expected

    def test_device_holds_tensors(self, platform: Platform) -> None:
        device = platform.device()
        assert isinstance(device, torch.device)
        x = torch.arange(4, device=device)  # [4]
        assert x.device.type == device.type
        assert torch.equal(x.cpu(), torch.arange(4))

    def test_memory_available_is_positive_bytes(self, platform: Platform) -> None:
        free = platform.memory_available()
        assert isinstance(free, int) and free > 0

    def test_synchronize_and_seed(self, platform: Platform) -> None:
        assert platform.synchronize() is None
        platform.manual_seed(1234)
        a = torch.rand(8, device=platform.device())  # [8]
        platform.manual_seed(1234)
        b = torch.rand(8, device=platform.device())  # [8]
        assert torch.equal(a, b), f"max abs diff {(a - b).abs().max().item()}"

    def test_import_does_no_device_work(self, platform: Platform) -> None:
        probe = import_probe(type(platform).__module__)
        assert probe == {"torch_npu": False, "cuda_initialized": False}, probe

    @pytest.mark.parametrize(("method", "gamma"), [("oracle", 3), ("mtp", 2)])
    def test_short_generation_on_device(self, platform: Platform, method: str, gamma: int) -> None:
        """Prefill + decode steps on ``platform.device()``: an accelerator refuses host
        tensors mixed into device ops, so this catches a step that builds drafts, verify
        rows or probabilities on the host. Greedy speculative output equals the baseline."""
        baseline = generate_on(platform, "none", None)
        assert [len(t) for t in baseline] == [GENERATION_TOKENS] * len(GENERATION_PROMPTS)
        assert generate_on(platform, method, gamma) == baseline
