"""Offline DeepSeek-V4 checkpoint writers: W8A8, FP8 blocks, QuaRot rotation.

For tests and toy checkpoints; every function reads a float official-layout directory
and writes a new one shard by shard (one source shard in memory at a time), atomically.
:mod:`xspec.models.deepseek_v4.weights` loads all of them.

* :func:`quantize_w8a8`: msModelSlim layout (int8 ``X.weight`` + ``weight_scale`` +
  ``weight_offset``, ``quant_model_description.json``).
* :func:`quantize_fp8`: official layout, e4m3 weights + ue8m0 ``X.scale`` per 128x128 block;
  with ``expert_dtype="fp4"`` the routed experts are MXFP4 instead (the Flash release).
* :func:`quarot_rotate`: rotate the residual basis by an orthogonal ``R`` with the norm
  gains folded into the next linears; the target's logits are unchanged.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from xspec.models.deepseek_v4.quant import quant_mxfp4
from xspec.models.deepseek_v4.weights import DEFAULT_QUANTIZED, QUANT_DESCRIPTION
from xspec.models.loading import CONFIG_NAME, INDEX_NAME, Checkpoint, atomic_dir

Transform = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
# Routed experts of the target and of the MTP / DSpark stages: MXFP4 in the Flash release.
ROUTED_EXPERTS = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")


def _rewrite(
    src: Checkpoint,
    dst_dir: str | Path,
    transform: Transform,
    config: dict,
    extra_json: dict,
    extra_tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Copy ``src`` through ``transform`` into ``dst_dir``, keeping its shard names;
    ``extra_tensors`` go to one more shard."""
    from safetensors.torch import save_file

    by_shard: dict[Path, list[str]] = {}
    for name in src.names():
        by_shard.setdefault(src.file_of(name), []).append(name)
    with atomic_dir(Path(dst_dir)) as tmp:
        weight_map: dict[str, str] = {}
        for shard, names in sorted(by_shard.items()):
            out: dict[str, torch.Tensor] = {}
            for name, tensor in src.iter_tensors(names):
                out.update(transform(name, tensor))
            save_file(
                {k: v.contiguous() for k, v in out.items()},
                str(tmp / shard.name),
                metadata={"format": "pt"},
            )
            weight_map.update(dict.fromkeys(out, shard.name))
        if extra_tensors:
            save_file(
                extra_tensors, str(tmp / "model-extra.safetensors"), metadata={"format": "pt"}
            )
            weight_map.update(dict.fromkeys(extra_tensors, "model-extra.safetensors"))
        files = {
            CONFIG_NAME: config,
            INDEX_NAME: {"metadata": {}, "weight_map": weight_map},
            **extra_json,
        }
        for fname, content in files.items():
            (tmp / fname).write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        for other in src.path.iterdir():  # tokenizer files etc. travel along
            skip = other.name.endswith((".safetensors", ".index.json")) or other.name in files
            if other.is_file() and not skip:
                shutil.copy2(other, tmp / other.name)


def _selector(names_predicate: Callable[[str], bool] | None) -> Callable[[str, torch.Tensor], bool]:
    select = names_predicate or (lambda n: DEFAULT_QUANTIZED.match(n) is not None)
    return lambda n, t: (
        select(n) and n.endswith(".weight") and t.dim() == 2 and t.is_floating_point()
    )


# -- W8A8 ----------------------------------------------------------------------------------


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``w [N, K]`` -> ``(q int8 [N, K], scale fp32 [N, 1])``.

    ``|q * scale - w| <= scale / 2`` per element (round to nearest, no clipping since
    ``scale = max|w_row| / 127``).
    """
    w = w.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # all-zero rows: q = 0
    return torch.round(w / scale).clamp(-127, 127).to(torch.int8), scale


def quantize_w8a8(
    src_dir: str | Path, dst_dir: str | Path, names_predicate: Callable[[str], bool] | None = None
) -> None:
    """Write an msModelSlim-style W8A8 copy of a float checkpoint.

    ``names_predicate(name)`` selects the 2-D ``*.weight`` tensors to quantise (default:
    the Huawei reference set ``weights.DEFAULT_QUANTIZED``: ``wq_a, wq_b, wkv,
    indexer.wq_b`` and every expert / shared-expert ``w1/w2/w3``, also under ``mtp.*``).
    Those become :func:`quantize_int8` with ``weight_scale`` fp32 ``[N, 1]`` and a zero
    ``weight_offset``, typed ``W8A8_DYNAMIC``; everything else is ``FLOAT``.
    """
    quantized = _selector(names_predicate)
    desc: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}

    def transform(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not quantized(name, t):
            desc[name] = "FLOAT"
            return {name: t}
        q, scale = quantize_int8(t)
        base = name.removesuffix(".weight")
        out = {
            name: q,
            f"{base}.weight_scale": scale,
            f"{base}.weight_offset": torch.zeros_like(scale),
        }
        desc.update(dict.fromkeys(out, "W8A8_DYNAMIC"))
        return out

    src = Checkpoint(src_dir)
    # desc is filled while the shards are written, before the json files are
    _rewrite(src, dst_dir, transform, dict(src.config), {QUANT_DESCRIPTION: desc})


# -- FP8 -----------------------------------------------------------------------------------


def quantize_fp8_blocks(w: torch.Tensor, block: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block e4m3 with power-of-two (ue8m0) scales.

    ``w [N, K]`` -> ``(q e4m3 [N, K], scale e8m0 [ceil(N/bn), ceil(K/bk)])``; each block's
    scale is the smallest power of two with ``max|w_block| / scale <= 448`` (e4m3's max).
    """
    n, k = w.shape
    gn, gk = math.ceil(n / block[0]), math.ceil(k / block[1])
    padded = torch.zeros(gn * block[0], gk * block[1])
    padded[:n, :k] = w.to(torch.float32)
    amax = padded.reshape(gn, block[0], gk, block[1]).abs().amax(dim=(1, 3))
    scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax, min=1e-30) / 448.0)))
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:n, :k]
    return (w.to(torch.float32) / full).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp8(
    src_dir: str | Path,
    dst_dir: str | Path,
    names_predicate: Callable[[str], bool] | None = None,
    *,
    expert_dtype: str = "fp8",
) -> None:
    """Write an official-style FP8 copy: e4m3 weights + ``X.scale`` per 128x128 block, and
    ``quantization_config`` in config.json (same default selection as quantize_w8a8).

    ``expert_dtype="fp4"``: the selected routed experts (:data:`ROUTED_EXPERTS`) are
    MXFP4 instead, int8 ``[N, K/2]`` + ue8m0 ``X.scale [N, K/32]``
    (:func:`~xspec.models.deepseek_v4.quant.quant_mxfp4`), and config.json says
    ``expert_dtype: "fp4"``, as in the official Flash release."""
    if expert_dtype not in ("fp8", "fp4"):
        raise ValueError(f"expert_dtype must be 'fp8' or 'fp4', got {expert_dtype!r}")
    quantized = _selector(names_predicate)
    block = [128, 128]

    def transform(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if not quantized(name, t):
            return {name: t}
        if expert_dtype == "fp4" and ROUTED_EXPERTS.match(name):
            q, scale = quant_mxfp4(t)
        else:
            q, scale = quantize_fp8_blocks(t, block)
        return {name: q, name.removesuffix(".weight") + ".scale": scale}

    src = Checkpoint(src_dir)
    config = dict(src.config)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "scale_fmt": "ue8m0",
        "weight_block_size": block,
    }
    config["expert_dtype"] = expert_dtype
    _rewrite(src, dst_dir, transform, config, {})


# -- QuaRot --------------------------------------------------------------------------------

# Linears reading the attn_norm / ffn_norm output (the residual basis) of layer i.
_ATTN_READERS = re.compile(
    r"^layers\.(\d+)\.attn\.(wq_a|wkv|compressor\.(wkv|wgate)|indexer\.weights_proj|"
    r"indexer\.compressor\.(wkv|wgate))\.weight$"
)
_FFN_READERS = re.compile(
    r"^layers\.(\d+)\.ffn\.(gate\.weight|(experts\.\d+|shared_experts)\.w[13]\.weight)$"
)
_WRITERS = re.compile(r"^layers\.\d+\.(attn\.wo_b|ffn\.(experts\.\d+|shared_experts)\.w2)\.weight$")
_NORMS = re.compile(r"^(layers\.\d+\.(attn|ffn)_norm\.weight|norm\.weight)$")
_HC_FN = re.compile(r"^(layers\.\d+\.hc_(attn|ffn)_fn|hc_head_fn)$")


def random_rotation(d: int, seed: int) -> torch.Tensor:
    """QuaRot's randomised Hadamard ``H diag(±1) / sqrt(d)`` when ``d`` is a power of two,
    else a random orthogonal matrix (QR of a Gaussian): ``[d, d]`` fp32, ``R R^T = I``."""
    gen = torch.Generator().manual_seed(seed)
    if d & (d - 1):
        q, r = torch.linalg.qr(torch.randn(d, d, generator=gen, dtype=torch.float64))
        return (q * torch.sign(torch.diagonal(r))).float()
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:  # Sylvester construction
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=gen).double() * 2 - 1
    return (h * signs / math.sqrt(d)).float()


def quarot_rotate(
    src_dir: str | Path,
    dst_dir: str | Path,
    *,
    seed: int = 0,
    rotation: torch.Tensor | None = None,
    write_rot: bool = True,
) -> torch.Tensor:
    """Rotate the target's residual basis by an orthogonal ``R`` (row vectors ``x' = x R``).

    ``embed' = embed R``; every linear reading a norm output ``W' = W diag(g) R`` with
    the gain ``g`` set to ones; residual writers (``wo_b``, expert ``w2``) ``W' = R^T W``;
    ``head' = head diag(g_final) R``; mHC ``hc_*_fn' = fn blockdiag(R, .., R)`` (the
    flattened RMS and the stream mixing commute with a per-stream rotation). Internal
    attention spaces (KV, q_lora, indexer) are untouched. The target's logits are
    unchanged (up to rounding). ``mtp.*`` tensors are copied as they are (still in the
    original basis); with ``write_rot`` ``rot.weight = R`` is added, so a drafter's
    ``F.linear(H', rot.weight) = H' R^T`` recovers the hidden it was trained on (it also
    needs dedicated ``mtp.*`` embed / head tensors in that basis, which this does not
    write). Returns ``R``.
    """
    src = Checkpoint(src_dir)
    d, hc = int(src.config["hidden_size"]), int(src.config["hc_mult"])
    rot = (rotation if rotation is not None else random_rotation(d, seed)).double()
    block = torch.block_diag(*[rot] * hc)  # [hc*d, hc*d]

    def gain(name: str) -> torch.Tensor:
        return src.get(name).double()

    def transform(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        w = t.double()
        if m := _ATTN_READERS.match(name):
            w = w * gain(f"layers.{m.group(1)}.attn_norm.weight") @ rot
        elif m := _FFN_READERS.match(name):
            w = w * gain(f"layers.{m.group(1)}.ffn_norm.weight") @ rot
        elif name == "head.weight":
            w = w * gain("norm.weight") @ rot
        elif name == "embed.weight":
            w = w @ rot
        elif _WRITERS.match(name):
            w = rot.T @ w
        elif _HC_FN.match(name):
            w = w @ block
        elif _NORMS.match(name):
            w = torch.ones_like(w)
        else:
            return {name: t}
        return {name: w.to(t.dtype)}

    extra = {"rot.weight": rot.float().contiguous()} if write_rot else None
    _rewrite(src, dst_dir, transform, dict(src.config), {}, extra)
    return rot.float()
