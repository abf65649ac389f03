"""A checkpoint under the wrong model option is recognised from config.json and named."""

from __future__ import annotations

import pytest

from xspec.errors import CheckpointError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.families import family_of
from xspec.models.qwen3.args import Qwen3Args

QWEN3 = Qwen3Args.tiny(False).to_config()
QWEN3_MOE = Qwen3Args.tiny(True).to_config()
DSV4 = DeepseekV4Args.tiny().to_config()


def test_family_of() -> None:
    assert [family_of(c) for c in (QWEN3, QWEN3_MOE, DSV4)] == ["qwen3", "qwen3", "deepseek_v4"]
    assert family_of({"model_type": "deepseek_v4_mtp"}) == "deepseek_v4_mtp"
    assert family_of({"architectures": ["Qwen3ForCausalLM"]}) == "qwen3"  # no model_type
    assert family_of({"model_type": "llama"}) is None


@pytest.mark.parametrize("config", [QWEN3, QWEN3_MOE])
def test_qwen3_config_under_dsv4(config: dict) -> None:
    with pytest.raises(
        CheckpointError, match=r"this is a Qwen3 checkpoint.*use it with model=qwen3"
    ) as e:
        DeepseekV4Args.from_config(config, "/q/config.json")
    assert e.value.problems == []  # one line, not a list of missing keys


def test_dsv4_config_under_qwen3() -> None:
    with pytest.raises(CheckpointError, match=r"DeepSeek-V4 checkpoint.*model=dsv4_flash"):
        Qwen3Args.from_config(DSV4, "/d/config.json")
    with pytest.raises(CheckpointError, match=r"MTP drafter.*spec.draft_path"):
        Qwen3Args.from_config(DSV4 | {"model_type": "deepseek_v4_mtp"}, "/m/config.json")
