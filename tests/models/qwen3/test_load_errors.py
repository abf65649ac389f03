"""Bad checkpoints and bad model config: each a clear error naming key / tensor / file."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from xspec.config import ModelConfig
from xspec.errors import CheckpointError, ConfigError
from xspec.models.loading import write_checkpoint
from xspec.models.qwen3 import Qwen3Args, load_model
from xspec.models.qwen3.model import Qwen3Model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    return dict(Qwen3Model(Qwen3Args.tiny(True)).init_random_(0).state_dict())


def _write(path: Path, tensors: dict, *, config: dict | None = None) -> Path:
    """Tiny MoE checkpoint, sharded (so errors can name a shard file)."""
    config = Qwen3Args.tiny(True).to_config() if config is None else config
    write_checkpoint(path, tensors, config, max_shard_bytes=1 << 20)
    return path


def _load(path: Path | None, **kw):
    cfg = ModelConfig(arch="qwen3", path=None if path is None else str(path), **kw)
    return load_model(cfg, device=CPU, max_rollback=0)


def _shard_of(path: Path, name: str) -> str:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return index["weight_map"][name]


def test_valid_checkpoint_loads(tmp_path, tensors):
    model = _load(_write(tmp_path / "ok", tensors))
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'nope'} does not exist"):
        _load(tmp_path / "nope")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_unreadable_dir_chmod(tmp_path, tensors):
    path = _write(tmp_path / "ck", tensors)
    path.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=f"{path}.*not readable"):
            _load(path)
    finally:
        path.chmod(0o755)


def test_unreadable_dir(tmp_path, tensors, monkeypatch):
    """Same check when running as root (where chmod 0 does not block reads)."""
    path = _write(tmp_path / "ck", tensors)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != path and real_access(p, mode))
    with pytest.raises(CheckpointError, match=f"{path} is not readable"):
        _load(path)


def test_unreadable_shard(tmp_path, tensors):
    path = _write(tmp_path / "ck", tensors)
    shard = _shard_of(path, "model.norm.weight")
    (path / shard).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match=f"{shard} is not a readable safetensors file"):
        _load(path)


def test_config_missing_and_invalid_keys_listed_together(tmp_path, tensors):
    config = Qwen3Args.tiny(True).to_config()
    del config["num_key_value_heads"], config["num_experts"]
    config["hidden_size"] = -5
    path = _write(tmp_path / "ck", tensors, config=config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert str(path / "config.json") in msg
    for needle in (
        "missing key 'num_key_value_heads'",
        "missing key 'num_experts'",
        "'hidden_size' must be",
    ):
        assert needle in msg, msg
    assert len(err.value.problems) == 3


def test_config_wrong_model_type_and_unsupported_features(tmp_path, tensors):
    config = Qwen3Args.tiny(True).to_config() | {
        "model_type": "llama",
        "attention_bias": True,
        "rope_scaling": {"rope_type": "dynamic", "factor": 2.0},
    }
    with pytest.raises(CheckpointError) as err:
        _load(_write(tmp_path / "ck", tensors, config=config))
    msg = str(err.value)
    assert "model_type is 'llama'" in msg and "attention_bias" in msg and "'dynamic'" in msg


_YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"layer_types": 5}, "'layer_types' must be a list of layer types, got 5"),
        ({"rope_theta": float("nan")}, "'rope_theta' must be a number > 1, got nan"),
        (
            {"rope_scaling": _YARN | {"beta_slow": "1"}},
            "rope_scaling.beta_slow must be a positive number, got '1'",
        ),
        (
            {"rope_scaling": _YARN | {"attention_factor": [1]}},
            r"rope_scaling.attention_factor must be a positive number, got \[1\]",
        ),
        ({"vocab_size": 10**30}, "'vocab_size' must be a positive integer up to 2147483647"),
        ({"bos_token_id": 512}, r"bos_token_id \(512\) is outside the vocabulary"),
        (  # each expert has tensors of its own: the headers cannot hold this many
            {"num_experts": 10_000},
            r"num_experts = 10000, but the checkpoint holds \d+ tensors in all",
        ),
    ],
)
def test_config_fields_of_the_wrong_type_or_size_are_named(tmp_path, tensors, changes, why):
    """One CheckpointError naming config.json and the key, from the load and from the
    header-only footprint, never a traceback from the RoPE tables or module shapes."""
    from xspec.models.qwen3 import footprint

    path = _write(tmp_path / "ck", tensors, config=Qwen3Args.tiny(True).to_config() | changes)
    for attempt in (
        lambda: _load(path),
        lambda: footprint(ModelConfig(arch="qwen3", path=str(path))),
    ):
        with pytest.raises(CheckpointError, match=why) as err:
            attempt()
        assert str(path / "config.json") in str(err.value)


def test_config_invalid_json(tmp_path, tensors):
    path = _write(tmp_path / "ck", tensors)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape("config.json is not valid JSON")):
        _load(path)


def test_missing_tensor(tmp_path, tensors):
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    path = _write(tmp_path / "ck", {k: v for k, v in tensors.items() if k != name})
    with pytest.raises(
        CheckpointError, match=f"missing tensor '{name}' \\(shape \\[128, 64\\]\\)"
    ) as err:
        _load(path)
    assert str(path) in str(err.value) and len(err.value.problems) == 1


def test_misshapen_tensor_names_its_shard(tmp_path, tensors):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _write(tmp_path / "ck", tensors | {name: torch.zeros(32, 128)})
    shard = _shard_of(path, name)
    with pytest.raises(
        CheckpointError,
        match=f"'{name}' in {shard} has shape \\[32, 128\\], expected \\[64, 128\\]",
    ):
        _load(path)


def test_unexpected_and_quantised_tensors(tmp_path, tensors):
    extra = {
        "model.layers.9.mlp.gate.weight": torch.zeros(8, 128),
        "model.layers.0.self_attn.q_proj.weight": torch.zeros(128, 128, dtype=torch.int8),
    }
    path = _write(tmp_path / "ck", tensors | extra)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert "unexpected tensor 'model.layers.9.mlp.gate.weight' in model-0000" in msg
    assert "'model.layers.0.self_attn.q_proj.weight' in model-0000" in msg and "is I8" in msg
    assert len(err.value.problems) == 2


def test_untied_needs_lm_head_tied_ignores_it(tmp_path, tensors):
    no_head = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    with pytest.raises(CheckpointError, match=re.escape("missing tensor 'lm_head.weight'")):
        _load(_write(tmp_path / "untied", no_head))
    tied = Qwen3Args.tiny(True).to_config() | {"tie_word_embeddings": True}
    model = _load(_write(tmp_path / "tied", tensors, config=tied))  # stored head skipped, as in HF
    assert model.lm_head is None
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_index_naming_missing_shard(tmp_path, tensors):
    path = _write(tmp_path / "ck", tensors)
    shard = _shard_of(path, "model.norm.weight")
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard}.*is missing"):
        _load(path)


def test_no_path_and_no_preset():
    with pytest.raises(CheckpointError, match=re.escape("set model.path=")):
        _load(None)


def test_bad_preset_dtype_rollback(tmp_path, monkeypatch):
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(
        ConfigError,
        match=re.escape("model.preset='huge' is not a Qwen3 preset; known: tiny, moe_tiny"),
    ):
        _load(None, preset="huge")
    cfg = ModelConfig(arch="qwen3", preset="tiny")
    cfg.dtype = "float8"  # bypass the enum, as a plugin's config could
    with pytest.raises(ConfigError, match=re.escape("model.dtype='float8' is not supported")):
        load_model(cfg, device=CPU, max_rollback=0)
    with pytest.raises(ConfigError, match=re.escape("model.max_context=5000")):
        _load(None, preset="tiny", max_context=5000)
    with pytest.raises(ValueError, match="max_rollback"):
        load_model(ModelConfig(arch="qwen3", preset="tiny"), device=CPU, max_rollback=-1)


def test_dense_head_dim_ambiguity(tmp_path, tensors):
    config = Qwen3Args.tiny(False).to_config()
    del config["head_dim"]  # 128/4 = 32, but transformers' Qwen3Config would use 128
    with pytest.raises(CheckpointError, match="add 'head_dim' explicitly"):
        _load(_write(tmp_path / "ck", tensors, config=config))
