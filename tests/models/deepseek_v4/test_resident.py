"""Resident quantized DeepSeek-V4 weights (FP8 + MXFP4, W8A8): stored as the checkpoint
stores them, counted at their stored bytes, the DSpark stages' logits equal to their
dequantized float twin in ``dequant`` mode, greedy speculative output equal to the
baseline's (W8A8, on the CPU and on the emulated NPU's int8 op), ``native`` mode near
``dequant``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import xspec
from tests.models.deepseek_v4.test_mxfp4 import float_twin
from tests.platforms.conformance import PlatformCfg
from xspec.engine.memory import weight_bytes
from xspec.models.base import ForwardBatch
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.convert import quantize_fp8, quantize_w8a8
from xspec.models.deepseek_v4.dspark import DraftWindow, load_dspark, plan_dspark
from xspec.models.deepseek_v4.tiny import tiny_dir, tiny_dspark_dir
from xspec.models.deepseek_v4.weights import load_checkpoint
from xspec.models.loading import Checkpoint
from xspec.models.resident import QuantLinear
from xspec.platforms.cpu import CpuPlatform

IDS = torch.randint(0, 512, (48,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("resident")
    quantize_w8a8(tiny_dir(), root / "w8a8")
    quantize_w8a8(tiny_dspark_dir(), root / "w8a8_dspark")
    quantize_fp8(tiny_dspark_dir(), root / "fp4_dspark", expert_dtype="fp4")
    return {
        "root": root,
        "w8a8": root / "w8a8",
        "w8a8_dspark": root / "w8a8_dspark",
        "fp4_dspark": root / "fp4_dspark",
    }


def _load(path: Path, quant_compute: str = "auto"):  # type: ignore[no-untyped-def]
    return load_checkpoint(path, dtype=torch.float32, device="cpu", quant_compute=quant_compute)


def _logits(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return model(ForwardBatch(IDS, [IDS.shape[0]], [model.new_state()])).logits


def test_weights_stay_stored_and_count_their_stored_bytes(dirs) -> None:
    """Every quantized linear is a QuantLinear holding the stored dtypes; the model's
    weight bytes are the checkpoint's target tensors' bytes (plus the rope tables)."""
    for path, data in ((dirs["w8a8"], torch.int8), (dirs["fp4_dspark"], torch.int8)):
        model = _load(path)
        experts = model.layers[1].ffn.experts[0]
        assert isinstance(experts.w1, QuantLinear) and experts.w1.weight.dtype == data
        assert model.layers[1].ffn.w1 is None  # no float expert stacks
        ckpt = Checkpoint(path)
        stored = sum(
            t.numel() * t.element_size() for n, t in ckpt.iter_tensors() if not n.startswith("mtp.")
        )
        rope = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "rope" in n)
        assert weight_bytes(model) == stored + rope
    fp4 = _load(dirs["fp4_dspark"])
    assert fp4.layers[0].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert fp4.layers[0].ffn.experts[0].w2.quantized().format == "mxfp4"


def _draft_logits(path: Path) -> torch.Tensor:
    """The DSpark stages of ``path`` on fixed captures and a fixed block: ``[B, W, V]``."""
    args = DeepseekV4Args.tiny()
    plan = plan_dspark(path, args)
    gen = torch.Generator().manual_seed(0)
    embed, head = nn.Embedding(512, 256), nn.Linear(256, 512, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(512, 256, generator=gen))
        head.weight.copy_(torch.randn(512, 256, generator=gen) / 16)
    draft = load_dspark(
        plan, embed=embed, head=head, window=None, dtype=torch.float32, device="cpu"
    )
    draft.set_window(DraftWindow(CpuPlatform(PlatformCfg(name="cpu"))))
    caches = [draft.new_cache(5) for _ in range(2)]
    with torch.no_grad():
        aux = torch.randn(30, 3 * 256, generator=gen)
        draft.write_context(caches, aux, [20, 10])
        return draft.forward_block(caches, torch.randint(0, 511, (2, 5), generator=gen))[1]


def test_dspark_stages_with_fp4_experts_equal_their_float_twin(dirs) -> None:
    """``dequant`` mode: the stages (FP8 attention, MXFP4 experts, resident) give the
    logits of the same weights dequantized to float32 at load, bit for bit."""
    twin = float_twin(dirs["fp4_dspark"], dirs["root"] / "fp4_dspark_twin")
    quant, ref = _draft_logits(dirs["fp4_dspark"]), _draft_logits(twin)
    assert torch.equal(quant, ref), f"max abs diff {(quant - ref).abs().max().item()}"


def test_w8a8_native_is_near_dequant_and_not_equal(dirs) -> None:
    """``native`` quantizes the activations per token to int8: the logits move by that
    rounding only (measured ~1% relative on the tiny model; bound 10%)."""
    with torch.no_grad():
        exact, native = (
            _logits(_load(dirs["w8a8"], "dequant")),
            _logits(_load(dirs["w8a8"], "native")),
        )
    rel = ((native - exact).norm() / exact.norm()).item()
    assert 0 < rel < 0.1, rel


def _greedy(path: Path, spec: str, platform: str = "cpu", compute: str = "auto") -> list[list[int]]:
    llm = xspec.LLM(
        model="dsv4_flash",
        spec=spec,
        platform=platform,
        overrides={
            "model.path": str(path),
            "model.dtype": "float32",
            "model.tokenizer": "byte",
            "model.quant_compute": compute,
        },
    )
    prompts = [IDS[:40].tolist(), IDS[:7].tolist()]
    return [g.token_ids for g in llm.generate(prompts, 12, ignore_eos=True, concurrency=2)]


@pytest.mark.parametrize("spec", ["mtp", "dspark"])
def test_w8a8_speculative_greedy_equals_baseline(dirs, spec: str) -> None:
    path = dirs["w8a8_dspark"] if spec == "dspark" else dirs["w8a8"]
    assert Checkpoint(path).meta("mtp.0.ffn.experts.0.w1.weight")[1] == "I8"
    assert _greedy(path, spec) == _greedy(path, "none")


def test_w8a8_on_the_emulated_npu_int8_op(dirs) -> None:
    """platform=npu_emulated, quant_compute=auto: the int8 op (npu_dynamic_quant +
    npu_quant_matmul) runs every W8A8 linear of target and MTP; greedy output is the
    baseline's, and equals the CPU's plain-torch ``native`` semantics."""
    npu = _greedy(dirs["w8a8"], "mtp", "npu_emulated")
    assert npu == _greedy(dirs["w8a8"], "none", "npu_emulated")
    assert npu == _greedy(dirs["w8a8"], "none", "cpu", "native")
