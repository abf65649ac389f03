"""DeepSeek-V4 checkpoint loading: official layout, W8A8 (msModelSlim), FP8 blocks, MXFP4
experts, QuaRot.

Layouts (all safetensors; sharded ``*.index.json`` honoured by :class:`Checkpoint`):

* **Official** DeepSeek names (``embed.weight``, ``layers.{i}.attn.wq_a.weight``,
  ``layers.{i}.ffn.gate.tid2eid``, ...): they equal the model's state_dict keys, so the
  map is the identity. :func:`expected_tensors` is the declarative name/shape table.
  ``mtp.*`` tensors belong to drafters: skipped here, never rejected.
* **W8A8** (msModelSlim, e.g. ``DeepSeek-V4-Flash-w8a8``): ``X.weight`` int8 ``[N, K]``
  + ``X.weight_scale`` ``[N, 1]`` + ``X.weight_offset`` ``[N, 1]``; the per-tensor type
  (``W8A8_DYNAMIC``, ``W8A8``, ``FLOAT``) comes from ``quant_model_description.json``.
  ``w = (q - offset) * scale``. Static W8A8 activation tensors (``input_scale``,
  ``deq_scale``, ...) are skipped.
* **FP8** (official ``quantization_config: fp8``): ``X.weight`` e4m3 + ``X.scale`` with one
  (ue8m0 / fp32) scale per ``weight_block_size`` block (128x128).
* **MXFP4** routed experts (official Flash, ``expert_dtype: "fp4"``): ``X.weight`` int8
  ``[N, K/2]`` (two e2m1 codes per byte) + ue8m0 ``X.scale`` ``[N, K/32]``; recognised
  by the int8 dtype and the ``.scale`` sibling (no W8A8 description entry)
  (:mod:`xspec.models.deepseek_v4.quant`).

Quantized linear weights stay resident as stored (:func:`load_resident`: the module is
built on the meta device, those linears become
:class:`~xspec.models.resident.QuantLinear`, then memory is allocated and the stored
bytes streamed in); they compute per ``model.quant_compute``
(:mod:`xspec.models.quantized`). A quantized tensor that is not a plain linear weight is
dequantised while streaming into the model dtype.

:mod:`xspec.models.deepseek_v4.convert` writes such checkpoints from a float one
(``quantize_w8a8``, ``quantize_fp8`` with optional MXFP4 experts, ``quarot_rotate``) for
tests and toy models.

QuaRot contract (for drafters; the target needs nothing special):

* A QuaRot checkpoint stores *already rotated* values under the usual names and shapes
  (``embed' = embed R``, residual readers ``W diag(g) R``, writers ``R^T W``, norm gains
  folded to ones, ``hc_*_fn`` columns times ``blockdiag(R, .., R)``), so the target loads
  it unchanged and its logits equal the unrotated model's.
* An optional top-level ``rot.weight`` ``[d, d]`` is not a target parameter;
  :func:`load_rot` returns it. Per xLLM, the drafter applies it as a linear to the target
  hidden *before* ``hnorm`` (``h = hnorm(rot(H))``).
* Dedicated drafter vocab tensors ``mtp.0.embed.weight`` / ``mtp.2.head.weight`` (the
  draft's basis) win over the target's ``embed`` / ``head`` whenever present.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from xspec.errors import CheckpointError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.loading import (
    CONFIG_NAME,
    SAFETENSORS_DTYPES,
    Checkpoint,
    held_bytes,
    load_params,
    require_tensors_for,
)
from xspec.models.ops import EAGER_STEPS, StepOptions
from xspec.models.quantized import (
    dequant_fp8,
    dequant_mxfp4,
    dequant_w8a8,
    mxfp4_shape_problem,
)
from xspec.models.resident import SIBLINGS, StoredWeight, make_resident

if TYPE_CHECKING:
    from xspec.models.deepseek_v4.model import DeepseekV4Model
    from xspec.parallel.expert import ExpertParallel

QUANT_DESCRIPTION = "quant_model_description.json"
W8A8_TYPES = ("W8A8", "W8A8_DYNAMIC")
SUPPORTED_QUANT_TYPES = ("FLOAT", *W8A8_TYPES)
FLOAT_CODES = ("F32", "BF16", "F16")
INDEX_CODES = ("I64", "I32", "I16")  # tid2eid expert ids
FP8_SCALE_CODES = ("F8_E8M0", "F32", "BF16")
MXFP4_SCALE_CODES = ("F8_E8M0", "U8")  # ue8m0, or its raw exponent bytes
# Tensors msModelSlim writes next to a quantised X.weight; consumed or ignored here.
W8A8_SIBLINGS = (
    "weight_scale",
    "weight_offset",
    "input_scale",
    "input_offset",
    "quant_bias",
    "deq_scale",
)
# The linears the reference W8A8 release quantises (docs/checkpoints.md); the rest stay FLOAT.
DEFAULT_QUANTIZED = re.compile(
    r"^(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|indexer\.wq_b)|"
    r"ffn\.(experts\.\d+|shared_experts)\.w[123])\.weight$"
)


# -- the official layout -----------------------------------------------------------------


def expected_tensors(args: DeepseekV4Args) -> dict[str, list[int]]:
    """Every target tensor of the official layout with its shape (no ``mtp.*``)."""
    d, hc, vocab = args.hidden_size, args.hc_mult, args.vocab_size
    out = {
        "embed.weight": [vocab, d],
        "head.weight": [vocab, d],
        "norm.weight": [d],
        "hc_head_fn": [hc, hc * d],
        "hc_head_base": [hc],
        "hc_head_scale": [1],
    }
    for i in range(args.num_hidden_layers):
        out.update({f"layers.{i}.{k}": v for k, v in _layer_tensors(args, i).items()})
    return out


def _layer_tensors(a: DeepseekV4Args, i: int) -> dict[str, list[int]]:
    d, hd, heads, qr = a.hidden_size, a.head_dim, a.num_attention_heads, a.q_lora_rank
    mix = (2 + a.hc_mult) * a.hc_mult  # pre weights, post weights, hc x hc comb logits
    t: dict[str, list[int]] = {"attn_norm.weight": [d], "ffn_norm.weight": [d]}
    for site in ("attn", "ffn"):
        t |= {
            f"hc_{site}_fn": [mix, a.hc_mult * d],
            f"hc_{site}_base": [mix],
            f"hc_{site}_scale": [3],
        }
    t |= {
        "attn.wq_a.weight": [qr, d],
        "attn.q_norm.weight": [qr],
        "attn.wq_b.weight": [heads * hd, qr],
        "attn.wkv.weight": [hd, d],
        "attn.kv_norm.weight": [hd],
        "attn.wo_a.weight": [a.o_groups * a.o_lora_rank, heads * hd // a.o_groups],
        "attn.wo_b.weight": [d, a.o_groups * a.o_lora_rank],
        "attn.attn_sink": [heads],
    }
    ratio = a.compress_ratios[i]
    if ratio:
        t |= _compressor("attn.compressor", ratio, hd, d)
    if ratio == 4:  # CSA: the lightning indexer with its own (head-dim) compressor
        ih = a.index_n_heads * a.index_head_dim
        t |= {
            "attn.indexer.wq_b.weight": [ih, qr],
            "attn.indexer.weights_proj.weight": [a.index_n_heads, d],
        }
        t |= _compressor("attn.indexer.compressor", ratio, a.index_head_dim, d)
    experts, inter = a.n_routed_experts, a.moe_intermediate_size
    t["ffn.gate.weight"] = [experts, d]
    if a.is_hash_layer(i):
        t["ffn.gate.tid2eid"] = [a.vocab_size, a.num_experts_per_tok]
    else:
        t["ffn.gate.bias"] = [experts]
    for e in range(experts):
        t |= _ffn(f"ffn.experts.{e}", inter, d)
    t |= _ffn("ffn.shared_experts", a.n_shared_experts * inter, d)
    return t


def _compressor(prefix: str, ratio: int, dim: int, d: int) -> dict[str, list[int]]:
    coff = 2 if ratio == 4 else 1  # ratio-4 windows overlap: two sets of rows per entry
    return {
        f"{prefix}.wkv.weight": [coff * dim, d],
        f"{prefix}.wgate.weight": [coff * dim, d],
        f"{prefix}.ape": [ratio, coff * dim],
        f"{prefix}.norm.weight": [dim],
    }


def _ffn(prefix: str, inter: int, d: int) -> dict[str, list[int]]:
    return {
        f"{prefix}.w1.weight": [inter, d],
        f"{prefix}.w2.weight": [d, inter],
        f"{prefix}.w3.weight": [inter, d],
    }


def local_tensors(
    names: Iterable[str], expert_parallel: ExpertParallel | None, args: DeepseekV4Args
) -> set[str]:
    """The names this rank loads: all, or all but other EP ranks' experts."""
    if expert_parallel is None:
        return set(names)
    return {n for n in names if expert_parallel.holds(n, args.n_routed_experts)}


Drafter = TypeVar("Drafter", bound=nn.Module)


def load_drafter(
    build: Callable[[torch.device | str], Drafter],
    ckpt: Checkpoint,
    names: dict[str, str],
    dequant: dict[str, str],
    args: DeepseekV4Args,
    expert_parallel: ExpertParallel | None,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    steps: StepOptions = EAGER_STEPS,
    quant_compute: str = "auto",
) -> Drafter:
    """Build a planned drafter with ``build(device)`` and stream its tensors (``names``:
    checkpoint name -> module key, from
    :func:`~xspec.models.deepseek_v4.draft_plan.plan_tensors`) into it, keeping quantized
    linears resident (:func:`load_resident`) and skipping other EP ranks' experts ->
    ``module.eval()``."""
    if expert_parallel is not None:
        names = {n: k for n, k in names.items() if expert_parallel.holds(k, args.n_routed_experts)}
    dequant = {n: s for n, s in dequant.items() if n in names}
    module = load_resident(
        build,
        ckpt,
        names,
        dequant,
        device=device,
        dtype=dtype,
        steps=steps,
        compute=quant_compute,
        check=value_check(dequant, args),
    )
    return module.eval()


def is_drafter_tensor(name: str) -> bool:
    """``mtp.*`` (MTP / DSpark stages) and QuaRot's ``rot.weight``: not target parameters."""
    return name.startswith("mtp.") or name == "rot.weight"


def load_rot(ckpt: Checkpoint) -> torch.Tensor | None:
    """QuaRot's ``rot.weight [d, d]`` if the checkpoint has one (see the module docstring)."""
    return ckpt.get("rot.weight") if "rot.weight" in ckpt else None


# -- validation from headers ---------------------------------------------------------------


def check_checkpoint(ckpt: Checkpoint, args: DeepseekV4Args) -> dict[str, str]:
    """Validate names, shapes, dtypes and quant types from headers only (no tensor data).

    Returns ``{weight name: "w8a8" | "fp8" | "mxfp4"}`` for tensors that need dequantising.
    Raises one CheckpointError listing every problem (tensor, shard file, config key).
    """
    require_tensors_for(
        ckpt,
        {"num_hidden_layers": args.num_hidden_layers, "n_routed_experts": args.n_routed_experts},
    )
    v = _Validator(ckpt, args)
    for name, shape in v.expected.items():
        if name in ckpt:
            v.check_tensor(name, shape)
    v.check_layout()
    if v.problems:
        raise CheckpointError(
            f"DeepSeek-V4 checkpoint {ckpt.path} does not match its config.json "
            f"({args.num_hidden_layers} layers; {len(v.problems)} problem(s))",
            problems=v.problems,
        )
    return v.dequant


class _Validator:
    """Collects the problems of one checkpoint; fills ``dequant`` and ``consumed``."""

    def __init__(self, ckpt: Checkpoint, args: DeepseekV4Args) -> None:
        self.ckpt, self.args = ckpt, args
        self.expected = expected_tensors(args)
        self.problems: list[str] = []
        self.dequant: dict[str, str] = {}
        self.consumed: set[str] = set()  # scale / offset siblings of quantised weights
        self.block = fp8_block(ckpt)
        self.desc_file = ckpt.path / QUANT_DESCRIPTION
        self.qtypes = self._quant_types()  # None: no description file

    def _quant_types(self) -> dict[str, str] | None:
        desc = self.ckpt.read_json(QUANT_DESCRIPTION)
        if desc is None:
            return None
        top = desc.get("model_quant_type")
        if top is not None and top not in SUPPORTED_QUANT_TYPES:
            self.problems.append(
                f"{self.desc_file}: model_quant_type {top!r} is not supported; "
                f"supported: {list(SUPPORTED_QUANT_TYPES)}"
            )
        return {k: v for k, v in desc.items() if k in self.ckpt and isinstance(v, str)}

    def _where(self, name: str) -> str:
        return f"tensor {name!r} in {self.ckpt.file_of(name).name}"

    def check_tensor(self, name: str, want: list[int]) -> None:
        """Shape, dtype and quant type of one expected tensor."""
        shape, code = self.ckpt.meta(name)
        base = name.removesuffix(".weight")
        qtype = None if self.qtypes is None else self.qtypes.get(name)
        if qtype is not None and qtype not in SUPPORTED_QUANT_TYPES:
            self.consumed.update(f"{base}.{s}" for s in (*W8A8_SIBLINGS, "scale"))
            self.problems.append(
                f"{self._where(name)}: quant type {qtype!r} in {self.desc_file} is not supported; "
                f"supported: {list(SUPPORTED_QUANT_TYPES)}"
            )
        elif is_mxfp4(self.ckpt, name, qtype):
            self.consumed.add(f"{base}.scale")
            if problem := mxfp4_problem(self.ckpt, name, want):
                self.problems.append(problem)
            else:
                self.dequant[name] = "mxfp4"
        elif shape != want:
            self.problems.append(
                f"{self._where(name)} has shape {shape}, expected {want} (from config.json)"
            )
        elif name.endswith("tid2eid"):
            if code not in INDEX_CODES:
                self.problems.append(
                    f"{self._where(name)} is {code}; tid2eid must hold integer expert ids "
                    f"({list(INDEX_CODES)})"
                )
        elif qtype in W8A8_TYPES:
            self._check_w8a8(name, want, code, qtype)
        elif code == "F8_E4M3" and f"{base}.scale" in self.ckpt:
            self._check_fp8(name, want)
        elif code == "I8":
            why = (
                "is absent" if self.qtypes is None else f"marks it {qtype}" if qtype else "omits it"
            )
            self.problems.append(
                f"{self._where(name)} is int8 but {QUANT_DESCRIPTION} {why}; a W8A8 checkpoint "
                f"needs the description marking it {' or '.join(W8A8_TYPES)} (and "
                "X.weight_scale / X.weight_offset)"
            )
        elif code not in FLOAT_CODES:
            self.problems.append(
                f"{self._where(name)} has unsupported dtype {code}; supported: {list(FLOAT_CODES)}, "
                "I8 (W8A8 with weight_scale/weight_offset, or MXFP4 with its per-32 '.scale'), "
                "F8_E4M3 (with its block '.scale')"
            )

    def _check_w8a8(self, name: str, want: list[int], code: str, qtype: str) -> None:
        base = name.removesuffix(".weight")
        self.consumed.update(f"{base}.{s}" for s in W8A8_SIBLINGS if f"{base}.{s}" in self.ckpt)
        if code != "I8" or len(want) != 2:
            self.problems.append(
                f"{self._where(name)} is {code}{want} but {QUANT_DESCRIPTION} marks it {qtype} "
                "(a 2-D int8 linear weight expected)"
            )
            return
        ok = True
        for sib, required in (("weight_scale", True), ("weight_offset", False)):
            sname = f"{base}.{sib}"
            if sname not in self.ckpt:
                if required:
                    self.problems.append(f"{self._where(name)} is W8A8 but {sname!r} is missing")
                    ok = False
                continue
            sshape, scode = self.ckpt.meta(sname)
            if sshape not in ([want[0], 1], [want[0]]) or scode not in FLOAT_CODES:
                self.problems.append(
                    f"{self._where(sname)} is {scode}{sshape}; expected float per-channel "
                    f"[{want[0]}, 1]"
                )
                ok = False
        if ok:
            self.dequant[name] = "w8a8"

    def _check_fp8(self, name: str, want: list[int]) -> None:
        sname = name.removesuffix(".weight") + ".scale"
        self.consumed.add(sname)
        grid = [math.ceil(want[0] / self.block[0]), math.ceil(want[1] / self.block[1])]
        sshape, scode = self.ckpt.meta(sname)
        if sshape != grid or scode not in FP8_SCALE_CODES:
            self.problems.append(
                f"{self._where(sname)} is {scode}{sshape}; FP8 {name!r} (blocks {self.block}) "
                f"needs {grid} scales in {list(FP8_SCALE_CODES)}"
            )
        else:
            self.dequant[name] = "fp8"

    def check_layout(self) -> None:
        """Missing / unexpected tensors, summarised per layer when a whole layer is off."""
        n = self.args.num_hidden_layers
        extra_layers: dict[int, str] = {}
        for name in self.ckpt.names():
            if name in self.expected or name in self.consumed or is_drafter_tensor(name):
                continue
            layer = _layer_of(name)
            if layer is not None and layer >= n:
                extra_layers.setdefault(layer, name)
            else:
                self.problems.append(
                    f"unexpected {self._where(name)}: not part of the DeepSeek-V4 official "
                    "layout for this config.json"
                )
        for i, name in sorted(extra_layers.items()):
            self.problems.append(
                f"tensors for layers.{i} exist (e.g. {self._where(name)}) but config.json "
                f"num_hidden_layers = {n}; fix num_hidden_layers / compress_ratios"
            )
        present = {_layer_of(k) for k in self.expected if k in self.ckpt}
        for i in sorted(set(range(n)) - present):
            self.problems.append(
                f"no tensors for layers.{i} at all, but config.json num_hidden_layers = {n} "
                f"needs layers 0..{n - 1}; fix num_hidden_layers or use the complete checkpoint"
            )
        self.problems += [
            f"missing tensor {k!r} (expected shape {v}) in {self.ckpt.path}"
            for k, v in self.expected.items()
            if k not in self.ckpt and _layer_of(k) in present | {None}
        ]


def _layer_of(name: str) -> int | None:
    m = re.match(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def is_mxfp4(ckpt: Checkpoint, name: str, qtype: str | None) -> bool:
    """Packed MXFP4: an int8 weight with a ``.scale`` sibling that no W8A8 description
    entry claims (msModelSlim's int8 uses ``weight_scale``)."""
    base = name.removesuffix(".weight")
    return (
        name.endswith(".weight")
        and ckpt.meta(name)[1] == "I8"
        and qtype not in W8A8_TYPES
        and f"{base}.scale" in ckpt
    )


def mxfp4_problem(ckpt: Checkpoint, name: str, want: list[int]) -> str | None:
    """Why MXFP4 ``name`` (and its ``.scale``) cannot hold the config's ``want = [N, K]``,
    naming the tensor and its file (None when it can)."""
    sname = name.removesuffix(".weight") + ".scale"
    (shape, _), (sshape, scode) = ckpt.meta(name), ckpt.meta(sname)
    problem = mxfp4_shape_problem(shape, sshape, want)
    if problem is None and scode not in MXFP4_SCALE_CODES:
        problem = f"MXFP4 scale is {scode}, expected one of {list(MXFP4_SCALE_CODES)}"
    if problem is None:
        return None
    return (
        f"tensor {name!r} in {ckpt.file_of(name).name} (scale {sname!r} in "
        f"{ckpt.file_of(sname).name}) is packed MXFP4 for {want}: {problem}"
    )


def fp8_block(ckpt: Checkpoint) -> list[int]:
    """FP8's scale block ``[rows, columns]``: config.json's
    ``quantization_config.weight_block_size`` (default 128 x 128), two positive integers."""
    where = ckpt.path / CONFIG_NAME
    qc = ckpt.config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise CheckpointError(f"{where}: quantization_config must be an object, got {qc!r}")
    block = qc.get("weight_block_size", [128, 128])
    if not (
        isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"{where}: quantization_config.weight_block_size must be two positive integers "
            f"[rows, columns] (the FP8 scale block, e.g. [128, 128]), got {block!r}"
        )
    return block


# -- what the loaded tensors hold (the memory plan) ---------------------------------------

# a quantised weight's siblings that are loaded with it (the others are skipped)
HELD_SIBLINGS = {"w8a8": ("weight_scale", "weight_offset"), "fp8": ("scale",), "mxfp4": ("scale",)}


def stored_footprint(
    ckpt: Checkpoint, names: Iterable[str], dequant: dict[str, str], itemsize: int
) -> dict[str, tuple[str, int]]:
    """Checkpoint tensor -> (format, bytes it holds once loaded), from headers only.

    ``names``: the tensors the loader reads; ``dequant``: their schemes as
    :func:`check_checkpoint` / the drafters' plans detect them. A quantised weight holds
    its stored bytes plus its scale / offset siblings (``fp8``, ``mxfp4``, ``w8a8``:
    quantised weights stay resident as stored); any other tensor what
    :func:`~xspec.models.loading.held_bytes` says at the model dtype's ``itemsize``."""
    out: dict[str, tuple[str, int]] = {}
    for name in names:
        scheme = dequant.get(name)
        if scheme is None:
            out[name] = held_bytes(ckpt, name, itemsize)
            continue
        base = name.removesuffix(".weight")
        siblings = [f"{base}.{s}" for s in HELD_SIBLINGS[scheme] if f"{base}.{s}" in ckpt]
        out[name] = (scheme, ckpt.nbytes(name) + sum(ckpt.nbytes(s) for s in siblings))
    return out


# -- dequantisation (what is not kept resident) and resident loading ---------------------------

__all__ = ["dequant_fp8", "dequant_mxfp4", "dequant_w8a8"]  # re-exported (models.quantized)


def unpacked_shape(dequant: dict[str, str]) -> Callable[[str, list[int]], list[int]]:
    """Stored -> loaded shape: MXFP4 packs two values per byte (``[N, K/2]`` -> ``[N, K]``)."""

    def shape(name: str, stored: list[int]) -> list[int]:
        return [stored[0], 2 * stored[1]] if dequant.get(name) == "mxfp4" else stored

    return shape


def make_converter(
    ckpt: Checkpoint, dequant: dict[str, str]
) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """The load_params ``convert`` hook: dequantise while streaming, siblings via ckpt.get."""
    block = fp8_block(ckpt)

    def convert(name: str, tensor: torch.Tensor) -> torch.Tensor:
        scheme = dequant.get(name)
        base = name.removesuffix(".weight")
        if scheme == "w8a8":
            offset = ckpt.get(f"{base}.weight_offset") if f"{base}.weight_offset" in ckpt else None
            return dequant_w8a8(tensor, ckpt.get(f"{base}.weight_scale"), offset)
        if scheme == "fp8":
            return dequant_fp8(tensor, ckpt.get(f"{base}.scale"), block)
        if scheme == "mxfp4":
            return dequant_mxfp4(tensor, ckpt.get(f"{base}.scale"))
        return tensor

    return convert


def value_check(
    dequant: dict[str, str], args: DeepseekV4Args
) -> Callable[[str, torch.Tensor], str | None]:
    """The ``check`` of :func:`~xspec.models.loading.load_params`: what the headers cannot
    show, one pass over each tensor as it streams in. A hash-routing table (``tid2eid``)
    must hold expert ids in ``[0, n_routed_experts)`` (one outside would index past the
    experts at the first prompt holding its token); an MXFP4 scale stored as raw bytes must
    not hold 0xFF, ue8m0's NaN (``float8_e8m0fnu`` scales are checked as every 8-bit float
    is, after the copy)."""
    raw_scales = {n.removesuffix(".weight") + ".scale" for n, s in dequant.items() if s == "mxfp4"}

    def check(name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith(".ffn.gate.tid2eid"):
            return expert_ids_problem(tensor, args.n_routed_experts)
        if name in raw_scales and tensor.dtype == torch.uint8 and bool((tensor == 0xFF).any()):
            return (
                "holds 0xFF, ue8m0's NaN, as an MXFP4 scale; the file is corrupt: re-download "
                "or re-convert it"
            )
        return None

    return check


def expert_ids_problem(table: torch.Tensor, n_experts: int) -> str | None:
    """Why ``table [vocab, k]`` (integer expert ids per token) is not a routing table for
    ``n_experts`` experts, naming the first entry outside ``[0, n_experts)``; None if it is."""
    if table.numel() == 0:
        return None
    low, high = torch.aminmax(table)
    if low >= 0 and high < n_experts:
        return None
    token, col = (((table < 0) | (table >= n_experts)).nonzero()[0]).tolist()
    return (
        f"routes token {token} to expert {int(table[token, col])} (entry [{token}, {col}]); "
        f"every entry must be an expert id in [0, {n_experts}) (n_routed_experts in "
        "config.json)"
    )


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    max_rollback: int = 8,
    max_context: int | None = None,
    expert_parallel: ExpertParallel | None = None,
    steps: StepOptions = EAGER_STEPS,
    quant_compute: str = "auto",
) -> DeepseekV4Model:
    """Validate everything from headers, then allocate the model and stream the weights in.
    With ``expert_parallel`` only this rank's experts are allocated and read; ``steps``:
    the platform's ops and compiler (``Platform.step_options``); quantized linears stay
    resident as stored, computed per ``quant_compute`` (``auto | dequant | native``,
    :mod:`xspec.models.quantized`)."""
    from xspec.models.deepseek_v4.model import DeepseekV4Model

    ckpt = Checkpoint(path)
    args = DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME)
    dequant = check_checkpoint(ckpt, args)
    wanted = local_tensors(expected_tensors(args), expert_parallel, args)

    def build(on: torch.device | str) -> DeepseekV4Model:
        return DeepseekV4Model(
            args,
            dtype=dtype,
            device=on,
            max_rollback=max_rollback,
            max_context=max_context,
            expert_parallel=expert_parallel,
            steps=steps,
        )

    names = {n: n for n in ckpt.names() if n in wanted}
    dequant = {n: s for n, s in dequant.items() if n in wanted}
    model = load_resident(
        build,
        ckpt,
        names,
        dequant,
        device=device,
        dtype=dtype,
        steps=steps,
        compute=quant_compute,
        check=value_check(dequant, args),
    )
    # drafters (MTP, DSpark) and the tokenizer read the same dir; nn.Module's __setattr__
    # is typed for tensors and modules only, hence the ignore
    model.checkpoint_dir = ckpt.path
    model.quant_compute = quant_compute
    return model.eval()


M = TypeVar("M", bound=nn.Module)


def stored_weights(
    ckpt: Checkpoint, names: dict[str, str], dequant: dict[str, str]
) -> dict[str, StoredWeight]:
    """Module path (``layers.0.attn.wq_b``) -> how its quantized weight is stored (formats,
    shapes and dtypes of the weight and its scale / offset siblings, from the headers)."""
    block = tuple(fp8_block(ckpt))
    out: dict[str, StoredWeight] = {}
    for name, scheme in dequant.items():
        base, key = name.removesuffix(".weight"), names[name].removesuffix(".weight")
        tensors: dict[str, tuple[list[int], torch.dtype]] = {}
        for buffer in SIBLINGS[scheme]:
            if buffer is not None and f"{base}.{buffer}" in ckpt:
                shape, code = ckpt.meta(f"{base}.{buffer}")
                tensors[buffer] = (shape, SAFETENSORS_DTYPES[code])
        out[key] = StoredWeight(scheme, tensors, (block[0], block[1]))
    return out


def load_resident(
    build: Callable[[torch.device | str], M],
    ckpt: Checkpoint,
    names: dict[str, str],
    dequant: dict[str, str],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    steps: StepOptions,
    compute: str,
    check: Callable[[str, torch.Tensor], str | None] | None = None,
) -> M:
    """Build a module with ``build(device)`` and stream ``names`` (checkpoint name -> key)
    into it. Quantized weights (``dequant``: name -> scheme) of plain linears stay as stored
    (:class:`~xspec.models.resident.QuantLinear`): the module is built on the meta device,
    those linears are swapped, and only then is memory allocated, so no float copy of them
    ever exists. Any other quantized tensor is dequantized while streaming, as before.
    A checkpoint without quantized tensors loads exactly as a float one always did.
    ``check``: :func:`~xspec.models.loading.load_params`' value check (:func:`value_check`)."""
    if not dequant:
        module = build(device)
        load_params(module, ckpt, names.get, convert=make_converter(ckpt, {}), check=check)
        return module
    module = build("meta")
    stored = stored_weights(ckpt, names, dequant)
    resident = make_resident(module, stored, dtype=dtype, compute=compute, ops=steps.ops)
    module.to("meta")  # modules that derive buffers (MoE stacks) redo them for the swap
    module.to_empty(device=device)  # untouched until loaded: no float pages are resident
    rename = dict(names)
    for name, scheme in dequant.items():
        key = names[name].removesuffix(".weight")
        if key in resident:  # the scale / offset siblings load into the QuantLinear too
            base = name.removesuffix(".weight")
            for buffer in SIBLINGS[scheme][1:]:
                if buffer is not None and f"{base}.{buffer}" in ckpt:
                    rename[f"{base}.{buffer}"] = f"{key}.{buffer}"
    converted = {
        n: s for n, s in dequant.items() if names[n].removesuffix(".weight") not in resident
    }
    load_params(
        module,
        ckpt,
        rename.get,
        convert=make_converter(ckpt, converted),
        logical_shape=unpacked_shape(converted),
        check=check,
    )
    return module
