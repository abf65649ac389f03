"""Random DeepSeek-V4 checkpoints at real geometry, written shard by shard.

For memory tests and benchmarks at DeepSeek-V4-Flash scale (hidden 4096, 64 heads x 512,
256 experts x 2048, indexer 64 x 128 top-512) without the real weights: :func:`flash_args`
is the Flash config with fewer layers, :func:`write_random` writes its official-layout
tensors in one of the stored formats (``fp8``: FP8 dense + MXFP4 routed experts, as the
Flash release; ``w8a8``: msModelSlim int8, as DeepSeek-V4-Flash-w8a8; ``bf16``) holding
at most one shard (``shard_bytes``) in memory, so writing a 13 GiB checkpoint needs
about one shard of RAM. Values are random but well scaled (the model decodes finite
logits); nothing here is a trained model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.convert import ROUTED_EXPERTS
from xspec.models.deepseek_v4.weights import DEFAULT_QUANTIZED, QUANT_DESCRIPTION, expected_tensors
from xspec.models.loading import CONFIG_NAME, INDEX_NAME, atomic_dir

FORMATS = ("fp8", "w8a8", "bf16")
# The linears the official FP8 release stores in e4m3 (docs/checkpoints.md): attention,
# indexer wq_b, experts; compressors, weights_proj, gates and vocab stay bf16 / fp32.
FP8_LINEARS = DEFAULT_QUANTIZED.pattern.replace("wq_a|wq_b|wkv|", "wq_a|wq_b|wkv|wo_a|wo_b|")


def flash_geometry() -> dict:
    """DeepSeek-V4-Flash's shape fields as the official config.json gives them (layers and
    their compress ratios, MTP / DSpark and hash routing aside): the one statement of the
    geometry that :func:`flash_args` and the header-only 0731 checkpoints of the tests use."""
    return {
        "vocab_size": 129280,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 2048,
        "hc_mult": 4,
        "torch_dtype": "bfloat16",
    }


def flash_args(num_layers: int = 2, *, vocab_size: int = 129280) -> DeepseekV4Args:
    """DeepSeek-V4-Flash's config (:func:`flash_geometry`) with ``num_layers`` main layers:
    CSA and HCA alternate from layer 0 (so both kinds, and the lightning indexer, are
    present), layer 0 hash-routed."""
    ratios = [(4, 128)[i % 2] for i in range(num_layers)]
    return DeepseekV4Args(
        **flash_geometry()
        | {
            "vocab_size": vocab_size,
            "num_hidden_layers": num_layers,
            "compress_ratios": [*ratios, 0],  # + the MTP layer's entry (no MTP tensors)
            "num_hash_layers": 1,
        }
    )


def _float(name: str, shape: list[int], gen: torch.Generator, args: DeepseekV4Args) -> torch.Tensor:
    """A well-scaled random float tensor for ``name``."""
    if name.endswith("tid2eid"):  # distinct valid expert ids per token
        k, e = args.num_experts_per_tok, args.n_routed_experts
        tok = torch.arange(shape[0]).unsqueeze(1)
        return (tok * 7 + torch.arange(k) * 37) % e
    if len(shape) == 1 or name.endswith(("_scale", "_base", "attn_sink", "ape", ".bias")):
        ones = name.endswith(("norm.weight", "_scale"))
        return torch.ones(shape) if ones else torch.zeros(shape)
    std = 0.02 if name.endswith(("embed.weight", "_fn")) else shape[-1] ** -0.5
    w = torch.randn(shape, generator=gen) * std
    return w if name.endswith(("_fn", "gate.weight")) else w.to(torch.bfloat16)


def _tensors(
    args: DeepseekV4Args, fmt: str, seed: int
) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    """(weight name, its stored tensors, their quant-description types), one at a time."""
    gen = torch.Generator().manual_seed(seed)
    fp8 = re.compile(FP8_LINEARS)
    for name, shape in expected_tensors(args).items():
        base = name.removesuffix(".weight")
        n = shape[0]
        if fmt == "fp8" and ROUTED_EXPERTS.match(name):  # MXFP4: random codes, 2^-8 scales
            packed = torch.randint(-128, 128, (n, shape[1] // 2), generator=gen, dtype=torch.int8)
            scale = torch.full((n, shape[1] // 32), 127 - 8, dtype=torch.uint8)
            yield name, {name: packed, f"{base}.scale": scale.view(torch.float8_e8m0fnu)}, {}
        elif fmt == "fp8" and fp8.match(name):  # e4m3 blocks with power-of-two scales
            w = (torch.randn(shape, generator=gen) * 64).to(torch.float8_e4m3fn)
            grid = [math.ceil(n / 128), math.ceil(shape[1] / 128)]
            scale = torch.full(grid, 2.0**-6 * shape[1] ** -0.5).to(torch.float8_e8m0fnu)
            yield name, {name: w, f"{base}.scale": scale}, {}
        elif fmt == "w8a8" and DEFAULT_QUANTIZED.match(name):
            q = torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)
            scale = torch.full((n, 1), 1.0 / 127 * 1.7 * shape[1] ** -0.5)
            out = {name: q, f"{base}.weight_scale": scale, f"{base}.weight_offset": scale * 0}
            yield name, out, dict.fromkeys(out, "W8A8_DYNAMIC")
        else:
            t = _float(name, shape, gen, args)
            yield name, {name: t}, {name: "FLOAT"}


def write_random(
    path: str | Path, args: DeepseekV4Args, fmt: str, *, seed: int = 0, shard_bytes: int = 1 << 29
) -> int:
    """Write a random official-layout checkpoint of ``args`` in ``fmt`` (``fp8`` = FP8 +
    MXFP4 experts, ``w8a8``, ``bf16``) to ``path``, atomically, one shard in memory at a
    time -> the stored tensor bytes."""
    from safetensors.torch import save_file

    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {list(FORMATS)}, got {fmt!r}")
    config = args.to_config()
    if fmt == "fp8":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
        }
        config["expert_dtype"] = "fp4"
    weight_map: dict[str, str] = {}
    desc: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}
    total = 0
    with atomic_dir(Path(path)) as tmp:
        shard: dict[str, torch.Tensor] = {}
        size = 0

        def flush() -> None:
            nonlocal shard, size
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0

        for _, tensors, types in _tensors(args, fmt, seed):
            desc.update(types)
            for key, t in tensors.items():
                shard[key] = t.contiguous()
                size += t.numel() * t.element_size()
            if size >= shard_bytes:
                flush()
        if shard:
            flush()
        for file in set(weight_map.values()):
            total += (tmp / file).stat().st_size
        files: dict[str, dict] = {
            CONFIG_NAME: config,
            INDEX_NAME: {"metadata": {}, "weight_map": weight_map},
        }
        if fmt == "w8a8":
            files[QUANT_DESCRIPTION] = desc
        for fname, content in files.items():
            (tmp / fname).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    return total
