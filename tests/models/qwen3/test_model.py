"""Qwen3Model behaviour without a reference: rollback, capture, cache growth, presets."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from xspec.config import DType, ModelConfig
from xspec.errors import ConfigError, RequestError
from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch, TargetModel
from xspec.models.loading import Checkpoint
from xspec.models.qwen3 import Qwen3Args, load_model
from xspec.models.qwen3.model import KV_BLOCK, Qwen3Model
from xspec.models.qwen3.tiny import generate_tiny, tiny_dir

IN, OUT = CaptureSite.INPUT, CaptureSite.OUTPUT


@pytest.fixture(scope="module", params=[False, True], ids=["dense", "moe"])
def model(request) -> Qwen3Model:
    return Qwen3Model(Qwen3Args.tiny(request.param)).init_random_(seed=3)


def _ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))  # [n]


def _run(model: Qwen3Model, state, ids: torch.Tensor, capture=()):
    return model(ForwardBatch(ids, [len(ids)], [state], list(capture)))


def test_is_a_target_model(model):
    assert isinstance(model, TargetModel)
    assert (model.vocab_size, model.hidden_size, model.num_layers) == (512, 128, 4)
    assert model.max_context == 2048


def test_logit_rows_score_those_rows_only(model):
    """Only the named rows get logits (a prefill reads each prompt's last row)."""
    ids = _ids(4, 20)
    full = _run(model, model.new_state(), ids)
    some = model(ForwardBatch(ids, [20], [model.new_state()], logit_rows=[0, 7, 19]))
    assert some.logits.shape == (3, 512)
    assert (some.logits - full.logits[[0, 7, 19]]).abs().max().item() <= 1e-5
    assert torch.equal(some.hidden, full.hidden)


def test_truncate_then_continue_equals_never_scored(model):
    """Score k=6 speculative rows, keep j=2, continue: same as scoring only those 2."""
    prompt, spec, cont = _ids(0, 20), _ids(1, 6), _ids(2, 5)
    a = model.new_state()
    _run(model, a, prompt)
    _run(model, a, spec)
    model.truncate(a, 22)
    got = _run(model, a, cont).logits
    b = model.new_state()
    _run(model, b, prompt)
    _run(model, b, spec[:2])
    want = _run(model, b, cont).logits
    diff = (got - want).abs().max().item()
    # kept rows' K/V were computed in a 6-row vs 2-row GEMM: equal up to BLAS blocking
    assert diff <= 1e-5, f"continuation after truncate: max abs diff {diff:.3g}"
    assert a.num_tokens == b.num_tokens == 27


def test_rescoring_after_truncate_is_bitwise_identical(model):
    state = model.new_state()
    _run(model, state, _ids(0, 20))
    rows = _ids(1, 5)
    first = _run(model, state, rows).logits
    model.truncate(state, 20)
    again = _run(model, state, rows).logits
    assert torch.equal(first, again), f"max abs diff {(first - again).abs().max().item():.3g}"


def test_truncate_rejects_growing(model):
    state = model.new_state()
    _run(model, state, _ids(0, 4))
    with pytest.raises(ValueError, match="cannot truncate a state of 4 tokens to 5"):
        model.truncate(state, 5)


def test_capture_points(model):
    L, d, ids = model.num_layers, model.hidden_size, _ids(4, 9)
    points = [CapturePoint(layer, OUT) for layer in range(L)] + [
        CapturePoint(layer, IN) for layer in range(L + 1)
    ]
    out = _run(model, model.new_state(), ids, points)
    assert out.aux_hidden.shape == (9, len(points) * d)
    parts = out.aux_hidden.view(9, len(points), d)
    outputs, inputs = parts[:, :L], parts[:, L:]
    for layer in range(L):  # INPUT of layer+1 is exactly OUTPUT of layer
        assert torch.equal(inputs[:, layer + 1], outputs[:, layer]), layer
    assert torch.equal(inputs[:, 0], model.model.embed_tokens.weight[ids])
    assert torch.equal(inputs[:, L], out.hidden)  # final residual, before the norm
    assert not torch.equal(inputs[:, 1], inputs[:, 2])  # layers do change the residual
    assert _run(model, model.new_state(), ids).aux_hidden is None


@pytest.mark.parametrize(
    "point", [CapturePoint(4, OUT), CapturePoint(5, IN), CapturePoint(-1, OUT)]
)
def test_capture_point_outside_model(model, point):
    with pytest.raises(ConfigError, match=f"layer={point.layer}, site={point.site.value}"):
        _run(model, model.new_state(), _ids(0, 3), [point])


def test_cache_grows_in_blocks_and_doubles(model):
    state = model.new_state()
    assert state.capacity == 0
    _run(model, state, _ids(0, 3))
    assert state.capacity == KV_BLOCK
    _run(model, state, _ids(1, KV_BLOCK))  # 19 tokens: doubles to 32
    assert state.capacity == 2 * KV_BLOCK
    _run(model, state, _ids(2, 40))  # 59 tokens: more than double needed
    assert state.capacity == 64


def test_max_context_and_bad_ids_raise_request_error():
    model = Qwen3Model(Qwen3Args.tiny(False), max_context=24).init_random_(0)
    state = model.new_state()
    _run(model, state, _ids(0, 20))
    with pytest.raises(RequestError, match="would hold 25 tokens, more than max_context=24"):
        _run(model, state, _ids(1, 5))
    assert state.num_tokens == 20  # untouched
    assert state.capacity <= 24
    with pytest.raises(RequestError, match=r"0\.\.511"):
        _run(model, model.new_state(), torch.tensor([1, 512]))
    with pytest.raises(ConfigError, match="max_position_embeddings \\(2048\\)"):
        Qwen3Model(Qwen3Args.tiny(False), max_context=4096)


def test_empty_rows_for_one_sequence(model):
    a, b = model.new_state(), model.new_state()
    _run(model, a, _ids(0, 5))
    out = model(ForwardBatch(_ids(1, 3), [0, 3], [a, b]))
    assert out.logits.shape == (3, 512) and a.num_tokens == 5 and b.num_tokens == 3


def test_init_random_is_deterministic_and_well_conditioned():
    args = Qwen3Args.tiny(True)
    a, b = Qwen3Model(args).init_random_(7), Qwen3Model(args).init_random_(7)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k
    other = Qwen3Model(args).init_random_(8)
    assert not torch.equal(a.model.embed_tokens.weight, other.model.embed_tokens.weight)
    logits = _run(a, a.new_state(), _ids(0, 64)).logits
    top = logits.softmax(-1).max(-1).values
    assert 1.0 < logits.std().item() < 4.0, logits.std().item()
    assert top.mean().item() < 0.5, "near one-hot distributions"
    assert logits.argmax(-1).unique().numel() > 16, "argmax collapses to a few tokens"


def test_moe_routing():
    model = Qwen3Model(Qwen3Args.tiny(True)).init_random_(seed=3)
    moe = model.model.layers[0].mlp
    x = torch.randn(10, 128, generator=torch.Generator().manual_seed(0))
    weights, ids = moe.route(x)
    probs = torch.softmax(x @ moe.gate.weight.T, -1)
    want = probs.gather(-1, ids)
    torch.testing.assert_close(weights, want / want.sum(-1, keepdim=True), rtol=0, atol=1e-6)
    assert (probs.gather(-1, ids).min(-1).values >= probs.topk(2).values[:, -1] - 1e-7).all()
    # the MoE output is the weighted sum of the chosen experts
    ref = torch.stack(
        [
            sum(weights[t, j] * moe.experts[int(ids[t, j])](x[t : t + 1])[0] for j in range(2))
            for t in range(10)
        ]
    )
    diff = (moe(x) - ref).abs().max().item()
    assert diff <= 1e-6, f"MoE combine: max abs diff {diff:.3g}"


def test_bfloat16_runs_close_to_float32():
    args = Qwen3Args.tiny(True)
    f32 = Qwen3Model(args).init_random_(0)
    bf16 = Qwen3Model(args, dtype=torch.bfloat16).init_random_(0)
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    ids = _ids(0, 16)
    a, b = _run(f32, f32.new_state(), ids), _run(bf16, bf16.new_state(), ids)
    assert b.logits.dtype == torch.float32 and b.hidden.dtype == torch.bfloat16
    diff = (a.logits - b.logits).abs().max().item()
    assert diff < 0.5, f"bf16 vs fp32 logits: max abs diff {diff:.3g}"  # bf16 has 8 mantissa bits


def test_args_round_trip_through_transformers_config():
    transformers = pytest.importorskip("transformers")
    for moe in (False, True):
        args = Qwen3Args.tiny(moe)
        assert Qwen3Args.from_config(args.to_config(), "x") == args
        cls = transformers.Qwen3MoeConfig if moe else transformers.Qwen3Config
        hf = cls.from_dict(args.to_config())
        assert hf.rope_parameters == {"rope_theta": 10_000.0, "rope_type": "default"}
        assert (hf.num_key_value_heads, hf.tie_word_embeddings) == (2, not moe)
        if moe:
            assert (hf.num_experts, hf.num_experts_per_tok, hf.norm_topk_prob) == (8, 2, True)
        else:
            assert hf.head_dim == 32
        # transformers' own saved format (rope_parameters, num_local_experts) reads back
        assert Qwen3Args.from_config(hf.to_dict(), "x") == args


def test_args_head_dim_defaults():
    moe = Qwen3Args.tiny(True).to_config()
    del moe["head_dim"]
    assert Qwen3Args.from_config(moe, "x").head_dim == 128 // 4
    dense = Qwen3Args.tiny(False).to_config() | {"hidden_size": 512}
    del dense["head_dim"]
    assert Qwen3Args.from_config(dense, "x").head_dim == 128  # 512/4 == transformers' default


def test_import_is_light():
    code = (
        "import sys, xspec.models.qwen3 as q; q.Qwen3Args.tiny(True); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_presets_load_generated_weights_exactly(tmp_path, monkeypatch):
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    for preset, moe in (("tiny", False), ("moe_tiny", True)):
        cfg = ModelConfig(arch="qwen3", preset=preset, dtype=DType.float32)
        loaded = load_model(cfg, device=torch.device("cpu"), max_rollback=4)
        path = tiny_dir(moe)
        assert path.parent == tmp_path / "cache" / "presets"
        assert (path / "model.safetensors.index.json").is_file()
        assert len(list(path.glob("*.safetensors"))) >= 2
        want = Qwen3Model(Qwen3Args.tiny(moe)).init_random_(0).state_dict()
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        assert ("lm_head.weight" in got) == moe  # dense preset is tied
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert not loaded.training


def test_preset_generation_is_deterministic(tmp_path):
    generate_tiny(tmp_path / "a", moe=True)
    generate_tiny(tmp_path / "b", moe=True)
    a, b = Checkpoint(tmp_path / "a"), Checkpoint(tmp_path / "b")
    assert a.config == b.config and sorted(a.names()) == sorted(b.names())
    tb = dict(b.iter_tensors())
    for name, t in a.iter_tensors():
        assert torch.equal(t, tb[name]), name
    for f in sorted((tmp_path / "a").iterdir()):  # byte-identical files
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name


def test_load_model_dtype_and_max_context(tmp_path, monkeypatch):
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path))
    cfg = ModelConfig(arch="qwen3", preset="tiny", dtype=DType.bfloat16, max_context=100)
    model = load_model(cfg, device=torch.device("cpu"), max_rollback=0)
    assert model.dtype == torch.bfloat16 and model.max_context == 100
    f32 = Qwen3Model(Qwen3Args.tiny(False)).init_random_(0)
    w = f32.model.layers[1].mlp.up_proj.weight
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, w.to(torch.bfloat16))
    assert dataclasses.is_dataclass(model.new_state())
