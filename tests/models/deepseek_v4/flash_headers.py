"""Header-only DeepSeek-V4-Flash-0731 checkpoints: every shard's safetensors header is
complete, its data section a sparse hole (the file is truncated up to its full size, so
nothing is written and reading a tensor would give zeros). Only a reader that never
touches tensor data can use them: the memory planner.

The geometry is the official Flash-0731 config.json: 43 layers (SWA, SWA, then CSA /
HCA alternating, CSA last), 256 routed experts x 2048, hidden 4096, 64 heads x 512,
three DSpark stages ``mtp.0..2``. Storage:

* ``w8a8`` (msModelSlim W8A8_DYNAMIC): the attention projections ``wq_a``, ``wq_b``,
  ``wkv``, ``indexer.wq_b`` and every expert / shared-expert ``w1..w3`` int8 with fp32
  ``weight_scale`` / ``weight_offset`` ``[N, 1]``;
* ``fp8_mxfp4`` (the official release): routed experts MXFP4 (int8 ``[N, K/2]`` + ue8m0
  ``[N, K/32]``), the other attention / shared-expert projections (``wo_a``, ``wo_b``
  too) FP8 e4m3 + one ue8m0 scale per 128 x 128 block;

and in both: ``attn_sink``, the mHC tensors, ``gate.bias`` and the compressors' ``ape``
fp32, index tables (``tid2eid``) int32, everything else bf16.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from pathlib import Path

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.synthetic import flash_geometry
from xspec.models.deepseek_v4.weights import DEFAULT_QUANTIZED, expected_tensors

STAGES = 3
BLOCK_SIZE = 5
MARKOV_RANK = 256
ITEMSIZE = {"BF16": 2, "F32": 4, "I32": 4, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}
FP32 = re.compile(r"(attn_sink|hc_\w+|gate\.bias|\.ape)$")
EXPERT = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
LINEAR = re.compile(
    r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)


def flash_0731_config(layers: int = 43) -> dict:
    """config.json of DeepSeek-V4-Flash-0731 (the official values): the target + DSpark keys;
    ``layers`` < 43: the first layers alone (a slice, without DSpark stages)."""
    ratios = ([0, 0] + [4, 128] * 20 + [4])[:layers]
    stages = STAGES if layers == 43 else 0
    args = DeepseekV4Args(
        **flash_geometry()
        | {
            "num_hidden_layers": layers,
            "compress_ratios": ratios + [0] * max(stages, 1),
            "num_nextn_predict_layers": max(stages, 1),
        }
    )
    cfg = args.to_config()
    if stages:
        cfg.update(
            dspark_block_size=BLOCK_SIZE,
            dspark_noise_token_id=128799,
            dspark_target_layer_ids=[40, 41, 42],
            dspark_markov_rank=MARKOV_RANK,
        )
    return cfg


def _stage_tensors(config: dict) -> dict[str, list[int]]:
    from xspec.models.deepseek_v4.dspark import expected_tensors as stage_tensors

    args = DeepseekV4Args.from_config(config, "flash_0731_config")
    return stage_tensors(
        args,
        num_stages=STAGES,
        markov_rank=MARKOV_RANK,
        confidence=True,
        own_embed=False,
        own_head=False,
    )


def _stored(name: str, shape: list[int], fmt: str) -> dict[str, tuple[str, list[int]]]:
    """The tensors ``name`` is stored as: itself (maybe quantised) + its siblings."""
    base = name.removesuffix(".weight")
    if name.endswith("tid2eid"):
        return {name: ("I32", shape)}
    if FP32.search(name):
        return {name: ("F32", shape)}
    if fmt == "w8a8" and DEFAULT_QUANTIZED.match(name):
        n = shape[0]
        return {
            name: ("I8", shape),
            f"{base}.weight_scale": ("F32", [n, 1]),
            f"{base}.weight_offset": ("F32", [n, 1]),
        }
    if fmt == "fp8_mxfp4" and EXPERT.search(name):
        n, k = shape
        return {name: ("I8", [n, k // 2]), f"{base}.scale": ("F8_E8M0", [n, k // 32])}
    if fmt == "fp8_mxfp4" and LINEAR.search(name):
        n, k = shape
        grid = [math.ceil(n / 128), math.ceil(k / 128)]
        return {name: ("F8_E4M3", shape), f"{base}.scale": ("F8_E8M0", grid)}
    return {name: ("BF16", shape)}


def _shard_of(name: str) -> str:
    m = re.match(r"(layers|mtp)\.(\d+)\.", name)
    return "top" if m is None else f"{m.group(1)}-{int(m.group(2)):02d}"


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """Shards of ``tensors`` (name -> (dtype code, shape)) with complete headers and sparse
    data sections, plus the index; returns the total data bytes the headers describe."""
    shards: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for name, meta in tensors.items():
        shards.setdefault(_shard_of(name), {})[name] = meta
    weight_map, total = {}, 0
    for shard, members in shards.items():
        file = f"model-{shard}.safetensors"
        header, offset = {}, 0
        for name, (code, shape) in members.items():
            nbytes = math.prod(shape) * ITEMSIZE[code]
            header[name] = {
                "dtype": code,
                "shape": shape,
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
            weight_map[name] = file
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path / file, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)  # a hole: no data is ever written
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def write_flash_0731(path: Path, fmt: str, layers: int = 43) -> Path:
    """The header-only Flash-0731 checkpoint in ``fmt`` ("w8a8" or "fp8_mxfp4") at
    ``path``; ``layers`` < 43: a slice of the first layers, without DSpark stages."""
    path.mkdir(parents=True, exist_ok=True)
    config = flash_0731_config(layers)
    names = expected_tensors(DeepseekV4Args.from_config(config, "flash"))
    if layers == 43:
        names |= _stage_tensors(config)
    tensors: dict[str, tuple[str, list[int]]] = {}
    for name, shape in names.items():
        tensors |= _stored(name, shape, fmt)
    if fmt == "w8a8":
        desc = {"model_quant_type": "W8A8_DYNAMIC"}
        desc |= {
            n: "W8A8_DYNAMIC" if code == "I8" else "FLOAT"
            for n, (code, _) in tensors.items()
            if n.endswith(".weight")
        }
        (path / "quant_model_description.json").write_text(json.dumps(desc))
    else:
        config["expert_dtype"] = "fp4"
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    write_header_only(path, tensors)
    return path


def allocated_bytes(path: Path) -> int:
    """Bytes the files under ``path`` really occupy on disk (sparse holes excluded)."""
    return sum(os.stat(p).st_blocks * 512 for p in path.iterdir())
