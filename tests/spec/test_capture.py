"""Capture points: checkpoint layer ids stay raw; each platform maps them its own way and
the captured hidden states are the same (cpu: output of L; NPU policy: input of L+1)."""

from __future__ import annotations

import pytest
import torch

from xspec.config import PlatformConfig
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.model import DeepseekV4Model
from xspec.platforms import get_platform

LAYER_IDS = [4, 1, 2]  # raw checkpoint ids, in the drafter's configured order (4 = last layer)


@pytest.fixture(scope="module")
def model() -> DeepseekV4Model:
    m = DeepseekV4Model(DeepseekV4Args.tiny())
    m.init_random_(0)
    return m


def captured(model: DeepseekV4Model, platform_name: str, ids: torch.Tensor) -> torch.Tensor:
    platform = get_platform(PlatformConfig(name=platform_name))
    points = [platform.capture_point(i) for i in LAYER_IDS]
    out = model.forward(ForwardBatch(ids, [len(ids)], [model.new_state()], points))
    assert out.aux_hidden is not None
    return out.aux_hidden  # [T, K*d]


def test_npu_policy_captures_the_same_hidden_as_cpu(model: DeepseekV4Model) -> None:
    cpu, npu = (
        get_platform(PlatformConfig(name="cpu")),
        get_platform(PlatformConfig(name="npu_emulated")),
    )
    assert cpu.capture_point(2) != npu.capture_point(2)  # different runtime points...
    ids = torch.randint(2, model.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    a, b = captured(model, "cpu", ids), captured(model, "npu_emulated", ids)
    d = model.hidden_size
    assert a.shape == (40, len(LAYER_IDS) * d)
    assert torch.equal(a, b)  # ...the same hidden states
    # slot order follows the configured ids: slot 0 is layer 4's output = the final residual
    final = model.forward(ForwardBatch(ids, [len(ids)], [model.new_state()])).hidden.mean(dim=1)
    torch.testing.assert_close(a[:, :d], final, rtol=0, atol=0)
    assert not torch.equal(a[:, d : 2 * d], a[:, 2 * d :])  # layers 1 and 2 differ
