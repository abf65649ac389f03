"""Quantised and rotated DeepSeek-V4 checkpoints: W8A8, FP8 blocks, QuaRot (MXFP4 experts:
test_mxfp4.py)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from xspec.errors import CheckpointError
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.convert import quantize_fp8, quantize_w8a8, quarot_rotate
from xspec.models.deepseek_v4.tiny import generate_tiny
from xspec.models.deepseek_v4.weights import DEFAULT_QUANTIZED, load_checkpoint, load_rot
from xspec.models.loading import Checkpoint, load_params, write_checkpoint
from xspec.models.resident import QuantLinear

CPU = torch.device("cpu")
IDS = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1))


def dequantized_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every resident quantized linear's ``X.weight``
    dequantized (model dtype) and its scale / offset siblings dropped."""
    sd = dict(model.state_dict())
    for key, module in model.named_modules():
        if isinstance(module, QuantLinear):
            for sib in ("scale", "weight_scale", "weight_offset"):
                sd.pop(f"{key}.{sib}", None)
            sd[f"{key}.weight"] = module.quantized().dequantize()
    return sd


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsv4q")
    generate_tiny(root / "float")
    quantize_w8a8(root / "float", root / "w8a8")
    return {"float": root / "float", "w8a8": root / "w8a8", "root": root}


def _run(model) -> torch.Tensor:
    return model(ForwardBatch(IDS, [IDS.shape[0]], [model.new_state()])).logits  # [T, V]


def _load(path: Path):
    return load_checkpoint(path, dtype=torch.float32, device=CPU)


def test_w8a8_layout(dirs) -> None:
    desc = json.loads((dirs["w8a8"] / "quant_model_description.json").read_text())
    ckpt = Checkpoint(dirs["w8a8"])
    quantized = {n for n in Checkpoint(dirs["float"]).names() if DEFAULT_QUANTIZED.match(n)}
    assert "layers.2.attn.indexer.wq_b.weight" in quantized
    assert "layers.2.attn.compressor.wkv.weight" not in quantized  # compressor stays FLOAT
    assert desc["model_quant_type"] == "W8A8_DYNAMIC"
    for name in quantized:
        base = name.removesuffix(".weight")
        assert ckpt.meta(name)[1] == "I8" and desc[name] == "W8A8_DYNAMIC", name
        assert ckpt.meta(f"{base}.weight_scale") == ([ckpt.meta(name)[0][0], 1], "F32")
        assert desc[f"{base}.weight_offset"] == "W8A8_DYNAMIC"
    assert desc["layers.0.attn.wo_a.weight"] == "FLOAT" and desc["head.weight"] == "FLOAT"


def test_w8a8_dequantises_within_half_a_step(dirs) -> None:
    """Each dequantised weight is within scale/2 of the float one and equals
    (q - offset) * scale computed here independently; the FLOAT tensors are exact."""
    floats = dict(Checkpoint(dirs["float"]).iter_tensors())
    qckpt = Checkpoint(dirs["w8a8"])
    model = _load(dirs["w8a8"])
    assert model.layers[0].attn.wq_a.weight.dtype == torch.int8  # resident as stored
    sd = dequantized_state(model)
    worst = 0.0
    for name, w in floats.items():
        if name.startswith("mtp."):  # the drafter's, not loaded into the target
            continue
        if not DEFAULT_QUANTIZED.match(name):
            assert torch.equal(sd[name], w), name
            continue
        base = name.removesuffix(".weight")
        scale = qckpt.get(f"{base}.weight_scale")  # [N, 1]
        ratio = ((sd[name] - w).abs() / scale).max().item()
        worst = max(worst, ratio)
        assert ratio <= 0.5 + 1e-5, f"{name}: max |dequant - w| = {ratio} * scale (> scale/2)"
        manual = (qckpt.get(name).float() - qckpt.get(f"{base}.weight_offset")) * scale
        assert torch.equal(sd[name], manual), name
    assert worst > 0.4  # real rounding happened


def test_w8a8_logits_within_quantisation_error(dirs) -> None:
    """Bound: per-channel int8 gives |dw| <= scale/2 = max|w_row|/254, i.e. an rms weight
    error of ~0.9% here; the random tiny model amplifies it ~6x through its discrete
    choices (MoE top-k, indexer top-k: same-size Gaussian noise does the same).
    Measured ~5.3% relative logit error, bound 10%; the top-1 token mostly agrees."""
    ref, quant = _run(_load(dirs["float"])), _run(_load(dirs["w8a8"]))
    rel = ((quant - ref).norm() / ref.norm()).item()
    agree = (quant.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert 0 < rel < 0.10, (
        f"relative logit error {rel}, max abs diff {(quant - ref).abs().max().item()}"
    )
    assert agree >= 0.8, f"top-1 agreement {agree}"


def test_float_loading_of_w8a8_never_silently_succeeds(dirs, tmp_path: Path) -> None:
    bare = tmp_path / "no_desc"
    shutil.copytree(dirs["w8a8"], bare)
    (bare / "quant_model_description.json").unlink()
    with pytest.raises(CheckpointError) as info:
        _load(bare)
    msg = str(info.value)
    assert (
        "'layers.0.attn.wq_a.weight' in model-" in msg
        and "is int8 but quant_model_description.json is absent" in msg
    )
    # The generic identity loader refuses too: int8 into float and unexpected scale tensors.
    from xspec.models.deepseek_v4.args import DeepseekV4Args
    from xspec.models.deepseek_v4.model import DeepseekV4Model

    model = DeepseekV4Model(DeepseekV4Args.tiny())
    with pytest.raises(CheckpointError, match=r"'layers\.0\.attn\.wq_a\.weight' in .* is I8"):
        load_params(model, Checkpoint(dirs["w8a8"]), lambda n: n)


def _edited(dirs, tmp_path: Path, edit) -> Path:
    path = tmp_path / "edited"
    shutil.copytree(dirs["w8a8"], path)
    desc_file = path / "quant_model_description.json"
    desc = json.loads(desc_file.read_text())
    edit(desc)
    desc_file.write_text(json.dumps(desc))
    return path


def test_unknown_quant_type_is_named(dirs, tmp_path: Path) -> None:
    def edit(desc: dict) -> None:
        desc["layers.3.attn.wq_b.weight"] = "W4A8_DYNAMIC"
        desc["model_quant_type"] = "W4A16"

    path = _edited(dirs, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        _load(path)
    msg = str(info.value)
    file = re.escape(str(path / "quant_model_description.json"))
    assert re.search(
        rf"tensor 'layers\.3\.attn\.wq_b\.weight' in model-\d+-of-\d+\.safetensors: quant type 'W4A8_DYNAMIC' in {file} "
        r"is not supported; supported: \['FLOAT', 'W8A8', 'W8A8_DYNAMIC'\]",
        msg,
    ), msg
    assert "model_quant_type 'W4A16' is not supported" in msg


def test_inconsistent_w8a8_is_named(dirs, tmp_path: Path) -> None:
    def edit(desc: dict) -> None:
        desc["layers.1.attn.wkv.weight"] = "FLOAT"  # stored int8
        desc["layers.0.attn.wo_a.weight"] = "W8A8"  # stored float

    path = _edited(dirs, tmp_path, edit)
    with pytest.raises(CheckpointError) as info:
        _load(path)
    msg = str(info.value)
    assert (
        "'layers.1.attn.wkv.weight' in" in msg
        and "quant_model_description.json marks it FLOAT" in msg
    )
    assert (
        "'layers.0.attn.wo_a.weight' in" in msg
        and "but quant_model_description.json marks it W8A8" in msg
    )


def test_w8a8_missing_scale_is_named(dirs, tmp_path: Path) -> None:
    ckpt = Checkpoint(dirs["w8a8"])
    tensors = {
        n: t for n, t in ckpt.iter_tensors() if n != "layers.2.ffn.experts.3.w2.weight_scale"
    }
    path = tmp_path / "no_scale"
    write_checkpoint(
        path,
        tensors,
        ckpt.config,
        extra_json={"quant_model_description.json": ckpt.read_json("quant_model_description.json")},
    )
    with pytest.raises(
        CheckpointError, match=r"'layers\.2\.ffn\.experts\.3\.w2\.weight_scale' is missing"
    ):
        _load(path)


def test_fp8_blocks_dequantise(dirs) -> None:
    """e4m3 keeps 3 mantissa bits: |dw| <= 2^-4 |w| (normal range) or scale * 2^-10 (subnormal)."""
    path = dirs["root"] / "fp8"
    quantize_fp8(dirs["float"], path)
    ckpt = Checkpoint(path)
    assert ckpt.meta("layers.0.attn.wq_a.weight") == ([128, 256], "F8_E4M3")
    assert ckpt.meta("layers.0.attn.wq_a.scale") == ([1, 2], "F8_E8M0")
    assert ckpt.meta("layers.0.attn.wkv.scale") == ([1, 2], "F8_E8M0")  # partial 64-row block
    model = _load(path)
    assert model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn  # resident as stored
    sd = dequantized_state(model)
    for name, w in Checkpoint(dirs["float"]).iter_tensors():
        if name.startswith("mtp."):
            continue
        if not DEFAULT_QUANTIZED.match(name):
            assert torch.equal(sd[name], w), name
            continue
        scale = ckpt.get(name.removesuffix(".weight") + ".scale").float()
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        bound = torch.maximum(w.abs() * 2**-4, full * 2**-10)
        excess = ((sd[name] - w).abs() - bound).max().item()
        assert excess <= 1e-7, f"{name}: error exceeds the e4m3 half-ulp bound by {excess}"
        assert torch.equal(sd[name], ckpt.get(name).float() * full), name
    ref = _run(_load(dirs["float"]))
    rel = ((_run(model) - ref).norm() / ref.norm()).item()
    # 128x128 blocks with 3 mantissa bits are coarser than per-channel int8: measured ~14%
    assert 0 < rel < 0.25, f"relative logit error {rel}"


def test_quarot_rotation_keeps_logits(dirs) -> None:
    """An offline QuaRot transform (orthogonal R, gains folded) loads with the same names and
    gives the same logits over 200 tokens (window wrap, C4 and C128 emissions)."""
    path = dirs["root"] / "quarot"
    rot = quarot_rotate(dirs["float"], path, seed=3)
    assert torch.allclose(rot @ rot.T, torch.eye(256), atol=1e-6)
    ids = torch.randint(0, 512, (200,), generator=torch.Generator().manual_seed(2))
    outs = []
    for p in (dirs["float"], path):
        model = _load(p)
        outs.append(model(ForwardBatch(ids, [200], [model.new_state()])))
    diff = (outs[0].logits - outs[1].logits).abs().max().item()
    assert diff <= 1e-4, f"max abs logit diff after rotation {diff}"
    hidden = (outs[1].hidden - outs[0].hidden @ rot).abs().max().item()  # streams rotated
    assert hidden <= 1e-4, f"rotated hidden max abs diff {hidden}"
    rotated = Checkpoint(path)
    assert torch.equal(load_rot(rotated), rot)
    assert torch.equal(rotated.get("layers.1.attn_norm.weight"), torch.ones(256))
    embed_change = (
        (rotated.get("embed.weight") - Checkpoint(dirs["float"]).get("embed.weight")).abs().max()
    )
    assert embed_change > 1  # values really changed
