"""MXFP4 routed experts (the official DeepSeek-V4-Flash layout): the e2m1 codec against
transformers' reference dequantiser, the round trip, loading a converted FP8 + MXFP4
checkpoint (target and DSpark / MTP stages), and malformed scales."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import xspec
from xspec.config import DType
from xspec.errors import CheckpointError
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.convert import ROUTED_EXPERTS, quantize_fp8
from xspec.models.deepseek_v4.quant import E2M1_VALUES, dequant_mxfp4, quant_mxfp4
from xspec.models.deepseek_v4.tiny import tiny_dir, tiny_dspark_dir
from xspec.models.deepseek_v4.weights import dequant_fp8, load_checkpoint
from xspec.models.loading import Checkpoint, write_checkpoint

CPU = torch.device("cpu")
IDS = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1))


def reference_dequant(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """transformers' FP4 path of ``Fp8Dequantize`` (integrations/finegrained_fp8.py), fp32."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    return fp8.Fp8Dequantize(None)._dequantize_one(packed, scale, output_dtype=torch.float32)


def random_packed(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bytes (every code in both nibbles) and ue8m0 exponents from 2^-40 to 2^40."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-128, 128, (n, k // 2), generator=gen, dtype=torch.int8)
    scale = torch.randint(127 - 40, 127 + 41, (n, k // 32), generator=gen).to(torch.uint8)
    return packed, scale


@pytest.mark.parametrize("as_e8m0", [True, False])
def test_dequant_matches_transformers_bit_for_bit(as_e8m0: bool) -> None:
    packed, scale = random_packed(96, 512, seed=0)
    if as_e8m0:
        scale = scale.view(torch.float8_e8m0fnu)
    mine, ref = dequant_mxfp4(packed, scale), reference_dequant(packed, scale)
    assert mine.dtype == torch.float32 and mine.shape == (96, 512)
    assert torch.equal(mine.view(torch.int32), ref.view(torch.int32))  # the bits, -0.0 too


def test_nibble_order_and_value_table() -> None:
    """Byte ``hi << 4 | lo`` holds column 2j in ``lo`` and 2j+1 in ``hi``."""
    codes = torch.arange(16)
    packed = (codes | (codes.flip(0) << 4)).to(torch.uint8).view(torch.int8)  # [16]
    packed = packed.repeat(2).reshape(1, 32)  # K = 64: two scale blocks
    scale = torch.tensor([[127, 128]], dtype=torch.uint8)  # 2^0, 2^1
    got = dequant_mxfp4(packed, scale)[0]  # [64]
    table = torch.tensor(E2M1_VALUES)
    want = torch.stack([table, table.flip(0)], dim=-1).reshape(-1)  # [32] interleaved
    assert torch.equal(
        got, torch.cat([want[:32], want[:32]]) * torch.tensor([1.0, 2.0]).repeat_interleave(32)
    )


def test_round_trip_exact_on_representable_values() -> None:
    """A value the format holds comes back unchanged (packed codes may differ: a block
    whose max rounded down re-quantises at a finer scale, to the same values)."""
    packed, scale = random_packed(64, 256, seed=1)
    w = dequant_mxfp4(packed, scale)
    assert torch.equal(dequant_mxfp4(*quant_mxfp4(w)), w)


def test_round_trip_error_within_half_a_step() -> None:
    """Off the grid: |dequant - w| <= half the e2m1 step at |w| / 2^e, times 2^e; blocks
    spanning magnitudes from 2^-20 to 2^20; the scale is the smallest power of two fitting 6."""
    gen = torch.Generator().manual_seed(2)
    mag = torch.exp2(torch.randint(-20, 21, (128, 16), generator=gen).float())
    w = torch.randn(128, 512, generator=gen) * mag.repeat_interleave(32, 1)
    w[0, :32] = 0.0  # an all-zero block
    packed, scale = quant_mxfp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (128, 256)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (128, 16)
    s = scale.float().repeat_interleave(32, 1)  # [N, K]
    amax = w.abs().reshape(128, 16, 32).amax(-1).repeat_interleave(32, 1)
    assert (amax <= 6 * s).all() and ((amax > 3 * s) | (amax == 0)).all()  # smallest fitting 2^e
    x = w.abs() / s
    half_step = torch.where(x <= 2, 0.25, torch.where(x <= 4, 0.5, 1.0))
    err = (dequant_mxfp4(packed, scale) - w).abs()
    assert (err <= half_step * s).all(), f"worst {(err / (half_step * s)).max().item()} half-steps"
    assert (err / s).max() > 0.2  # real rounding happened
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])  # scale 2^0
    assert dequant_mxfp4(*quant_mxfp4(ties))[0, :8].tolist() == [0, 1, 1, 2, 2, 4, 4, 6]


# -- checkpoints ------------------------------------------------------------------------------


def float_twin(quantized: Path, dst: Path) -> Path:
    """The same checkpoint with every weight dequantised to float32: MXFP4 experts through
    transformers' dequantiser, FP8 blocks through xspec's (tested in test_quant.py)."""
    ckpt = Checkpoint(quantized)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in ckpt.iter_tensors():
        base = name.removesuffix(".weight")
        if name.endswith(".scale"):
            continue
        if t.dtype == torch.int8:
            t = reference_dequant(t, ckpt.get(f"{base}.scale"))
        elif t.dtype == torch.float8_e4m3fn:
            t = dequant_fp8(t, ckpt.get(f"{base}.scale"), [128, 128])
        tensors[name] = t
    write_checkpoint(
        dst, tensors, {k: v for k, v in ckpt.config.items() if k != "quantization_config"}
    )
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mxfp4")
    quantize_fp8(tiny_dir(), root / "fp4", expert_dtype="fp4")
    return {"fp4": root / "fp4", "root": root}


def test_converter_writes_the_flash_layout(dirs) -> None:
    ckpt = Checkpoint(dirs["fp4"])
    assert ckpt.config["expert_dtype"] == "fp4"
    assert ckpt.meta("layers.0.ffn.experts.0.w1.weight") == ([128, 128], "I8")  # [N, K/2]
    assert ckpt.meta("layers.0.ffn.experts.0.w1.scale") == ([128, 8], "F8_E8M0")  # [N, K/32]
    assert ckpt.meta("layers.0.ffn.experts.0.w2.weight") == ([256, 64], "I8")
    assert ckpt.meta("mtp.0.ffn.experts.7.w3.scale") == ([128, 8], "F8_E8M0")
    assert ckpt.meta("layers.0.ffn.shared_experts.w1.weight")[1] == "F8_E4M3"  # FP8 stays
    assert ckpt.meta("layers.0.attn.wq_a.weight")[1] == "F8_E4M3"
    assert ckpt.meta("layers.0.ffn.gate.weight")[1] == "F32"
    assert sum(1 for n in ckpt.names() if ROUTED_EXPERTS.match(n)) == 6 * 8 * 3


def _logits(path: Path) -> torch.Tensor:
    model = load_checkpoint(path, dtype=torch.float32, device=CPU)
    return model(ForwardBatch(IDS, [IDS.shape[0]], [model.new_state()])).logits  # [T, V]


def test_logits_equal_the_dequantised_float_checkpoint(dirs) -> None:
    twin = float_twin(dirs["fp4"], dirs["root"] / "twin")
    quant, ref = _logits(dirs["fp4"]), _logits(twin)
    assert torch.equal(quant, ref), f"max abs diff {(quant - ref).abs().max().item()}"


def test_mxfp4_logits_stay_near_the_float_model(dirs) -> None:
    """Sanity on the converter: e2m1 with a per-32 scale moves the logits by quantisation
    noise only, and not by nothing. Measured ~28% relative logit error (FP8 everywhere:
    ~14%, test_quant.py): 1 mantissa bit on random weights, amplified by the tiny model's
    discrete choices (MoE and indexer top-k); bound 50%."""
    ref, quant = _logits(tiny_dir()), _logits(dirs["fp4"])
    rel = ((quant - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.5, f"relative logit error {rel}"


def _greedy(path: Path, spec: str) -> list[list[int]]:
    llm = xspec.LLM(
        model="dsv4_flash",
        spec=spec,
        platform="cpu",
        overrides={"model.path": str(path), "model.dtype": "float32", "model.tokenizer": "byte"},
    )
    prompts = [IDS[:40].tolist(), IDS[:7].tolist()]
    return [g.token_ids for g in llm.generate(prompts, 12, ignore_eos=True, concurrency=2)]


@pytest.mark.parametrize("spec", ["mtp", "dspark"])
def test_speculative_greedy_equals_baseline(dirs, spec: str) -> None:
    """The drafter's MXFP4 experts (mtp.*.ffn.experts) load too; greedy output is the
    target's whatever they draft."""
    path = dirs["fp4"]
    if spec == "dspark":
        path = dirs["root"] / "dspark_fp4"
        if not path.exists():
            quantize_fp8(tiny_dspark_dir(), path, expert_dtype="fp4")
    assert Checkpoint(path).meta("mtp.0.ffn.experts.0.w1.weight")[1] == "I8"
    assert _greedy(path, spec) == _greedy(path, "none")


def _with(dirs, tmp_path: Path, name: str, tensor: torch.Tensor) -> Path:
    src = Checkpoint(dirs["fp4"])
    tensors = dict(src.iter_tensors()) | {name: tensor}
    write_checkpoint(tmp_path / "bad", tensors, src.config)
    return tmp_path / "bad"


@pytest.mark.parametrize(
    ("name", "tensor", "why"),
    [
        (
            "layers.3.ffn.experts.2.w1.scale",
            torch.zeros(128, 4, dtype=torch.float8_e8m0fnu),
            r"MXFP4 scale is \[128, 4\], expected one per 32 values: \[128, 8\]",
        ),
        (
            "layers.3.ffn.experts.2.w1.weight",
            torch.zeros(128, 256, dtype=torch.int8),
            r"packed MXFP4 weight is \[128, 256\], expected \[N, K/2\] = \[128, 128\]",
        ),
        (
            "layers.3.ffn.experts.2.w1.scale",
            torch.zeros(128, 8, dtype=torch.float32),
            r"MXFP4 scale is F32, expected one of \['F8_E8M0', 'U8'\]",
        ),
    ],
)
def test_malformed_mxfp4_is_named(dirs, tmp_path: Path, name: str, tensor, why: str) -> None:
    path = _with(dirs, tmp_path, name, tensor)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, dtype=torch.float32, device=CPU)
    assert len(info.value.problems) == 1, info.value.problems
    assert re.search(
        r"tensor 'layers\.3\.ffn\.experts\.2\.w1\.weight' in model\.safetensors \(scale "
        r"'layers\.3\.ffn\.experts\.2\.w1\.scale' in model\.safetensors\) is packed MXFP4 for "
        r"\[128, 256\]: " + why,
        str(info.value),
    ), str(info.value)


def test_malformed_drafter_mxfp4_is_named(dirs, tmp_path: Path) -> None:
    from xspec.models.deepseek_v4.args import DeepseekV4Args
    from xspec.models.deepseek_v4.mtp import plan_mtp

    path = _with(
        dirs, tmp_path, "mtp.0.ffn.experts.1.w2.scale", torch.zeros(256, 2, dtype=torch.uint8)
    )
    with pytest.raises(
        CheckpointError,
        match=r"'mtp\.0\.ffn\.experts\.1\.w2\.weight' in .*MXFP4 scale is \[256, 2\]",
    ):
        plan_mtp(path, DeepseekV4Args.tiny())


def _poisoned(t: torch.Tensor, code: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` (8-bit, as stored) with its second byte set to ``code``, viewed as ``dtype``."""
    raw = t.clone().view(torch.uint8)
    raw.view(-1)[1] = code
    return raw.view(dtype or t.dtype)


@pytest.mark.parametrize(
    ("name", "code", "as_bytes", "why"),
    [
        ("layers.1.attn.wq_a.weight", 0x7F, False, "holds NaN or Inf codes"),  # e4m3 NaN
        ("layers.1.attn.wq_a.scale", 0xFF, False, "holds NaN or Inf codes"),  # FP8 block scale
        ("layers.3.ffn.experts.2.w1.scale", 0xFF, False, "holds NaN or Inf codes"),  # ue8m0
        ("layers.3.ffn.experts.2.w1.scale", 0xFF, True, "holds 0xFF, ue8m0's NaN, as an MXFP4"),
        ("mtp.0.ffn.experts.1.w2.scale", 0xFF, False, "holds NaN or Inf codes"),  # the drafter's
    ],
)
def test_nan_codes_in_resident_weights_and_scales_are_refused(
    dirs, tmp_path: Path, name: str, code: int, as_bytes: bool, why: str
) -> None:
    """Quantized weights stay resident as stored, so their NaN codes (e4m3 S.1111.111,
    ue8m0 0xFF, also as raw uint8 scale bytes) are refused as they load, naming the tensor
    and the file, before the model (or drafter) is returned."""
    from xspec.models.deepseek_v4.mtp import load_mtp, plan_mtp

    stored = Checkpoint(dirs["fp4"]).get(name)
    path = _with(dirs, tmp_path, name, _poisoned(stored, code, torch.uint8 if as_bytes else None))
    pattern = rf"tensor '{re.escape(name)}' in {re.escape(str(path))}/model\.safetensors {why}"
    if not name.startswith("mtp."):
        with pytest.raises(CheckpointError, match=pattern):
            load_checkpoint(path, dtype=torch.float32, device=CPU)
        return
    target = load_checkpoint(path, dtype=torch.float32, device=CPU)  # mtp.* is not its
    with pytest.raises(CheckpointError, match=pattern):
        load_mtp(plan_mtp(path, target.args), embed=target.embed, head=target.head,
                 dtype=torch.float32, device=CPU)  # fmt: skip


@pytest.mark.parametrize("block", [[0, 128], [128], "128", [128.0, 128]])
def test_an_fp8_block_size_that_is_not_two_positive_integers_is_refused(
    dirs, tmp_path: Path, block
) -> None:
    """``quantization_config.weight_block_size`` sizes every FP8 scale grid: refused with
    its key (target, drafter and the header-only plan), never a ZeroDivisionError."""
    from xspec.models.deepseek_v4 import footprint
    from xspec.models.deepseek_v4.args import DeepseekV4Args
    from xspec.models.deepseek_v4.mtp import plan_mtp

    path = tmp_path / "block"
    path.mkdir()
    for file in dirs["fp4"].iterdir():
        os.link(file, path / file.name)
    config = dict(Checkpoint(dirs["fp4"]).config)
    config["quantization_config"] = config["quantization_config"] | {"weight_block_size": block}
    (path / "config.json").unlink()
    (path / "config.json").write_text(json.dumps(config))
    cfg = SimpleNamespace(path=str(path), preset=None, dtype=DType.float32, max_context=None)
    why = rf"{re.escape(str(path))}/config\.json: quantization_config\.weight_block_size must be two positive integers"
    for attempt in (
        lambda: load_checkpoint(path, dtype=torch.float32, device=CPU),
        lambda: footprint(cfg, max_rollback=4),
        lambda: plan_mtp(path, DeepseekV4Args.tiny()),
    ):
        with pytest.raises(CheckpointError, match=why):
            attempt()
