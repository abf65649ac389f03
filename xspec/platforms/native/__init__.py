"""Fused host kernels of the CPU platform, in C, built on first use and cached.

At decode sizes a host step is dispatch, not arithmetic: every torch op costs a few
microseconds whatever its size, and composite ops cost several. The kernels here fuse
the ones a DeepSeek-V4 step calls most:

* ``mhc_pre``: the mHC mixes of one site (per row a 24-wide sigmoid/softmax and twenty
  Sinkhorn rounds over a 4x4 matrix, about 90 tiny torch ops; DeepSeek's own inference
  fuses them too, ``hc_split_sinkhorn``) and the stream collapse;
* ``rms_norm``: weighted or plain RMS normalisation (``F.rms_norm`` is six ops);
* ``rope``: the rotation of the last ``rd`` dims of every head (ten ops in torch);
* ``index_topk``: the CSA lightning indexer's scores and stable causal top-k (thirty
  ops in torch, one host sync);
* ``sparse_attention``: a decode / verify query's attention over the window and
  compressed rows it selects, with the sink (gathers, masks, two GEMMs and a softmax in
  torch, about thirty ops per layer); the DSpark draft window's too;
* ``moe``: a whole MoE layer, gate, top-k or hash routing, experts and the shared
  expert (about forty ops and a host sync in torch);
* ``compress_pool``: a compressor's softmax pooling of the windows a forward completes
  (gather, concatenations, softmax, product and sum in torch);
* ``quant_linear`` for weights kept as stored (``model.quant_compute=auto|native``), the
  ``native`` semantics of :mod:`xspec.models.quantized` reading the stored bytes: W8A8,
  int8 activations per token (torch) and an int8 x int8 product with exact int32
  accumulation, bit for bit the reference (decode / verify rows; larger calls run the
  same semantics on ``torch._int_mm``); FP8 (128 x 128 blocks) and MXFP4, e4m3
  activation blocks of 128 (torch) and each weight row decoded to fp32 once per call
  for all rows, summed per block (the reference's sums in another order).

The attention and expert products are vectorised explicitly (the GCC / clang vector
extension) and may fuse multiply-adds, as the BLAS behind the reference ops does; the
other kernels round every product and sum as the reference ops do.

Each returns None for inputs it does not take (not fp32, not contiguous, shapes that do
not fit together, an index out of range, a prefill-sized MoE call), and the caller runs
the reference torch ops instead (which raise their own error for a bad shape or index:
the kernels never read outside their buffers; ``test_native.py -m slow -k asan`` runs
the tests under AddressSanitizer). Rows are independent: what a kernel gives a row does
not depend on what else is in the batch.

``kernels.c`` is plain C over float32 buffers (no Python or torch headers), compiled with
the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``, else the
compiler's baseline) into ``$XSPEC_CACHE_DIR/native/`` under a name that hashes the
source, the flags and the CPU, with the library's sha256 recorded beside it; loaded with
ctypes only from bytes that match that record, in a cache only this user can write
(:mod:`.cache`, ``docs/security.md``), and called with the tensors' data pointers.
Where there is no compiler, the build fails or hangs, the cache directory cannot be
created or the library does not load, :func:`load` says why in one line and the model
runs the reference torch ops (``platform.kernels=reference`` forces that). Nothing here
runs at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from xspec.models.ops import ModelOps, MoeRouting
from xspec.models.quantized import (
    ACT_BLOCK,
    E2M1_VALUES,
    QuantizedWeight,
    act_quant_fp8,
    dynamic_quant_int8,
    mxfp4_scale_f32,
    native_linear,
)
from xspec.platforms.native import cache as _cache

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
# The moe kernel runs at 10-35 G multiply-adds/s (more with more rows per expert), the
# reference's grouped GEMMs at BLAS speed after ~0.2 ms of dispatch: measured on dsv4 MoE
# layers (d 256, inter 32 and 128), the kernel is faster up to ~9 M multiply-adds per call
# (decode and verify batches) and no faster above (prefill chunks).
MOE_MAX_MACS = 8_000_000
# rows the int8 GEMV kernel runs (decode and verify); more go to torch._int_mm
W8A8_MAX_ROWS = 16
# decode tables of the low-bit kernel: every e4m3 byte's value, the 16 e2m1 values
_E4M3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
_E2M1 = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# the targets a build tries, in order: this CPU's vector units, then the compiler's baseline
_TARGETS: tuple[tuple[str, ...], ...] = (("-march=native",), ())
_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library's entry points, as torch-level functions. ``path``: its cache
    entry (a private build's own path, gone once loaded, where it was not cached)."""

    lib: ctypes.CDLL
    path: Path

    def mhc_pre(
        self,
        mix: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        hc: int,
        iters: int,
        eps: float,
        x: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``mix [T, (2+hc)*hc]``, ``scale [3]``, ``base [(2+hc)*hc]`` fp32 contiguous
        host tensors -> ``u [T, d]`` (None without ``x [T, hc, d]`` fp32), ``pre, post
        [T, hc]``, ``comb [T, hc, hc]`` (see ``kernels.c``); None if it does not take them."""
        if not (_takes(mix) and _takes(scale) and _takes(base)):
            return None
        width = (2 + hc) * hc  # [pre | post | comb] columns
        if mix.dim() != 2 or mix.shape[1] != width or hc < 1 or iters < 0:
            return None
        if scale.numel() != 3 or base.numel() != width:
            return None
        rows = mix.shape[0]
        if x is not None and not _takes(x):
            x = None
        if x is not None and (x.dim() != 3 or x.shape[:2] != (rows, hc)):
            return None  # the reference's own error
        pre = mix.new_empty(rows, hc)
        post = mix.new_empty(rows, hc)
        comb = mix.new_empty(rows, hc, hc)
        u = None if x is None else mix.new_empty(rows, x.shape[-1])
        self.lib.xspec_mhc_pre(
            mix.data_ptr(),
            scale.data_ptr(),
            base.data_ptr(),
            rows,
            hc,
            iters,
            ctypes.c_float(eps),
            None if x is None else x.data_ptr(),
            0 if x is None else x.shape[-1],
            pre.data_ptr(),
            post.data_ptr(),
            comb.data_ptr(),
            None if u is None else u.data_ptr(),
        )
        return u, pre, post, comb

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None:
        """RMS normalisation over the last dim of fp32 ``x``, times ``weight`` if given."""
        if not _takes(x) or (weight is not None and not _takes(weight)) or x.dim() == 0:
            return None
        n = x.shape[-1]
        if weight is not None and weight.shape != (n,):
            return None
        y = torch.empty_like(x)
        rows = x.numel() // n if n else 0
        wp = None if weight is None else weight.data_ptr()
        self.lib.xspec_rms_norm(x.data_ptr(), wp, rows, n, ctypes.c_float(eps), y.data_ptr())
        return y

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
    ) -> torch.Tensor | None:
        """``rope.rotate`` of fp32 ``x [N, ..., D]`` with ``cos, sin [N, rd]``."""
        if not (_takes(x) and _takes(cos) and _takes(sin)) or x.dim() < 2 or cos.dim() != 2:
            return None
        rows, d, rd = x.shape[0], x.shape[-1], cos.shape[-1]
        if rd % 2 or rd > d or cos.shape != (rows, rd) or sin.shape != cos.shape:
            return None  # pairs of the last d dims, one cos / sin row per x row
        y = torch.empty_like(x)
        heads = x.numel() // (rows * d) if rows and d else 0
        self.lib.xspec_rope(
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            rows,
            heads,
            d,
            rd,
            int(inverse),
            y.data_ptr(),
        )
        return y

    def index_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        key0: torch.Tensor,
        visible: torch.Tensor,
        n: int,
        k: int,
        scale: float,
    ) -> torch.Tensor | None:
        """The lightning indexer's causal top-``k`` (``compressor.Indexer.select``):
        ``q [T, H, c]``, ``weights [T, H]``, ``keys [*, c]`` fp32; ``key0, visible [T]``
        int64 (the row's first key, its causal entry count); ``n`` entries per sequence
        at most -> ``[T, k]`` int64, ascending, -1 = none. None (the reference raises)
        where a row's keys ``key0 .. key0 + visible`` are not all in ``keys`` (the
        kernel checks those values: cheaper than a host-side check)."""
        if not all(_takes(t) for t in (q, weights, keys)) or not all(
            t.dtype == torch.int64 and t.device.type == "cpu" for t in (key0, visible)
        ):
            return None
        if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or n < 0 or k < 0:
            return None
        rows = q.shape[0]
        if weights.shape != q.shape[:2] or key0.shape != (rows,) or visible.shape != (rows,):
            return None
        key0, visible = key0.contiguous(), visible.contiguous()
        out = torch.empty(rows, k, dtype=torch.int64)
        score = torch.empty(max(n, 1))
        heap = torch.empty(max(k, 1), dtype=torch.int64)
        bad = self.lib.xspec_index_topk(
            q.data_ptr(), weights.data_ptr(), keys.data_ptr(), keys.shape[0], key0.data_ptr(),
            visible.data_ptr(), rows, q.shape[1], q.shape[2], n, k, ctypes.c_float(scale),
            score.data_ptr(), heap.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return None if bad else out

    def sparse_attention(
        self,
        q: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None:
        """``attention.sparse_attention`` of fp32 ``q [S, H, D]`` over one or two
        ``(kv [N, D], index [S, K])`` sources (int64 host indices, -1 = none) -> ``[S, H,
        D]`` fp32."""
        if not (_takes(q) and _takes(sink)) or q.dim() != 3 or not 1 <= len(parts) <= 2:
            return None
        rows, heads, d = q.shape
        if sink.shape != (heads,):
            return None
        for kv, index in parts:
            if not (_takes(kv) and kv.dim() == 2 and kv.shape[1] == d and _ids(index)):
                return None
            if index.dim() != 2 or index.shape[0] != rows:
                return None
        (kv0, idx0), (kv1, idx1) = parts[0], parts[-1] if len(parts) == 2 else (None, None)
        k0, k1 = idx0.shape[1], 0 if idx1 is None else idx1.shape[1]
        out = torch.empty_like(q)
        scratch = torch.empty(heads * (k0 + k1 + d))
        rows_at = torch.empty(k0 + k1, dtype=torch.int64)  # row pointers
        bad = self.lib.xspec_sparse_attn(
            q.data_ptr(), rows, heads, d, kv0.data_ptr(), kv0.shape[0], idx0.data_ptr(), k0,
            None if kv1 is None else kv1.data_ptr(), 0 if kv1 is None else kv1.shape[0],
            None if idx1 is None else idx1.data_ptr(), k1, sink.data_ptr(), ctypes.c_float(scale),
            scratch.data_ptr(), rows_at.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return None if bad else out  # an index out of range: the reference op says so

    def moe(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        routing: MoeRouting,
        stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        shared: bool,
        limit: float,
    ) -> torch.Tensor | None:
        """A whole MoE layer (``models.ops.MoeOp``) of fp32 ``x [T, d]``: the ``routing``
        (router ``weight``, ``bias`` or hash table ``tid2eid``, scoring) and the experts'
        stacks ``w1, w3 [G, inter, d]``, ``w2 [G, d, inter]`` (the shared expert last
        when ``shared``) -> ``[T, d]`` fp32. None beyond :data:`MOE_MAX_MACS`."""
        w1, w2, w3 = stacks
        weight, bias, table = routing.weight, routing.bias, routing.tid2eid
        if not all(_takes(t) for t in (x, weight, w1, w2, w3)) or (
            bias is not None and not _takes(bias)
        ):
            return None
        if not (_ids(input_ids) and (table is None or _ids(table))) or x.dim() != 2:
            return None
        rows, d = x.shape
        if weight.dim() != 2 or weight.shape[1] != d or w1.dim() != 3:
            return None
        experts, k, inter = weight.shape[0], routing.top_k, w1.shape[1]
        groups = experts + int(shared)  # the shared expert is the stacks' last row
        if w1.shape != (groups, inter, d) or w3.shape != w1.shape or w2.shape != (groups, d, inter):
            return None
        if not 1 <= k <= experts or input_ids.shape != (rows,):
            return None
        if (bias is not None and bias.shape != (experts,)) or (
            table is not None and (table.dim() != 2 or table.shape[1] != k)
        ):
            return None
        if rows * (k + int(shared)) * 3 * inter * d > MOE_MAX_MACS:
            return None  # prefill-sized: the reference's BLAS grouped GEMMs are faster
        score_fn = {"softmax": 0, "sigmoid": 1}.get(routing.scoring, 2)
        y = torch.empty_like(x)
        most = max(rows * k, rows)  # assignments one expert may have
        scratch = torch.empty(2 * experts + rows * k + most * (3 * inter + d))
        pick = torch.empty(rows * k, dtype=torch.int64)
        members = torch.empty(most, dtype=torch.int64)
        ptrs = torch.empty(2 * most, dtype=torch.int64)  # row pointers
        bad = self.lib.xspec_moe(
            x.data_ptr(), input_ids.data_ptr(), rows, d, inter, weight.data_ptr(),
            None if bias is None else bias.data_ptr(), None if table is None else table.data_ptr(),
            0 if table is None else table.shape[0], experts, k, score_fn,
            int(routing.normalize), ctypes.c_float(routing.scale),
            ctypes.c_float(limit), w1.data_ptr(), w2.data_ptr(), w3.data_ptr(), int(shared),
            scratch.data_ptr(), pick.data_ptr(), members.data_ptr(), ptrs.data_ptr(),
            y.data_ptr(),
        )  # fmt: skip
        return None if bad else y  # a token id or table entry out of range: the reference says so

    def compress_pool(
        self,
        ring: torch.Tensor,
        rows: torch.Tensor,
        index: torch.Tensor,
        ratio: int,
        coff: int,
        width: int,
    ) -> torch.Tensor | None:
        """``compressor.Compressor.pool`` of the entries ``index [E, coff*ratio]`` (rows of
        ``cat(ring, rows, pad)``) of fp32 ``[kv | score]`` rows ``ring [R, 2*coff*width]``
        and ``rows [T, 2*coff*width]`` -> ``[E, width]`` fp32, before norm and rope."""
        if not (_takes(ring) and _takes(rows) and _ids(index)) or index.dim() != 2:
            return None
        if ring.dim() != 2 or rows.dim() != 2 or ratio < 1 or coff < 1 or width < 0:
            return None
        if ring.shape[1] != 2 * coff * width or rows.shape[1] != ring.shape[1]:
            return None
        if index.shape[1] != coff * ratio:
            return None
        out = rows.new_empty(index.shape[0], width)
        scratch = torch.empty(coff * ratio)
        bad = self.lib.xspec_compress_pool(
            ring.data_ptr(), ring.shape[0], rows.data_ptr(), rows.shape[0], index.data_ptr(),
            index.shape[0], ratio, coff, width, scratch.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return None if bad else out  # an index out of range: the reference op says so

    def quant_linear(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """``models.ops.QuantLinearOp``: ``x [..., K]`` -> ``[..., N]`` in x.dtype with the
        ``native`` semantics, reading the stored bytes (see the module docstring). None
        (per weight, whatever the row count: a model's prefill and decode must compute
        alike) for a non-zero W8A8 offset, FP8 blocks other than 128 x 128, K not a
        multiple of 128, non-contiguous storage."""
        data = weight.data
        if not (x.is_cpu and data.is_cpu and data.is_contiguous()) or data.dim() != 2:
            return None
        n, k = weight.shape
        if x.shape[-1] != k:
            return None
        lead, x2 = x.shape[:-1], x.reshape(-1, k)
        if weight.format == "w8a8":
            y = self._w8a8(x, x2, weight)
        elif weight.format in ("fp8", "mxfp4"):
            y = self._lowbit(x2, weight)
        else:
            y = None
        if y is None:
            return None
        if bias is not None:
            y += bias.float()
        return y.to(x.dtype).reshape(*lead, n)

    def _w8a8(
        self, x: torch.Tensor, x2: torch.Tensor, weight: QuantizedWeight
    ) -> torch.Tensor | None:
        """W8A8: int8 codes per token, int8 x int8 with exact int32 sums -> fp32 ``[T, N]``."""
        n, k = weight.shape
        scale = weight.scale
        if scale.numel() != n or scale.dtype is not torch.float32:
            return None
        if weight.offset is not None and bool(weight.offset.ne(0).any()):
            return None
        if x2.shape[0] > W8A8_MAX_ROWS:  # prefill: the same semantics, on torch._int_mm
            plain = QuantizedWeight("w8a8", weight.data, scale, None, torch.float32)
            return native_linear(x2.float(), plain, None)
        xq, xs = dynamic_quant_int8(x2)
        ws = scale.reshape(-1).contiguous()  # [N], alive through the call
        y = torch.empty(x2.shape[0], n)
        self.lib.xspec_w8a8_linear(
            xq.data_ptr(), xs.data_ptr(), weight.data.data_ptr(), ws.data_ptr(),
            x2.shape[0], n, k, y.data_ptr(),
        )  # fmt: skip
        return y

    def _lowbit(self, x2: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor | None:
        """FP8 / MXFP4: e4m3 activation blocks of 128, the weight decoded row by row ->
        fp32 ``[T, N]``."""
        n, k = weight.shape
        if k % ACT_BLOCK:
            return None
        if weight.format == "fp8":
            if tuple(weight.block) != (ACT_BLOCK, ACT_BLOCK):
                return None
            fmt, lut, ws = 0, _E4M3, weight.scale.float().contiguous()
        else:
            fmt, lut, ws = 1, _E2M1, mxfp4_scale_f32(weight.scale).contiguous()
        xq, xs = act_quant_fp8(x2)
        xd = xq.float().contiguous()  # the e4m3 values, unscaled
        xs = xs.contiguous()
        y = torch.empty(x2.shape[0], n)
        scratch = torch.empty(k)
        self.lib.xspec_lowbit_linear(
            xd.data_ptr(), xs.data_ptr(), weight.data.data_ptr(), ws.data_ptr(),
            lut.data_ptr(), fmt, x2.shape[0], n, k, scratch.data_ptr(), y.data_ptr(),
        )  # fmt: skip
        return y

    def ops(self) -> ModelOps:
        """The ops these kernels run for the models (the rest: the models' reference)."""
        return ModelOps(
            quant_linear=self.quant_linear,
            rms_norm=self.rms_norm,
            rope=self.rope,
            mhc_pre=self.mhc_pre,
            sparse_attention=self.sparse_attention,
            moe=self.moe,
            index_topk=self.index_topk,
            compress_pool=self.compress_pool,
        )


def _takes(t: torch.Tensor) -> bool:
    """A tensor the kernels can read through its data pointer: host memory, fp32,
    contiguous, and not one autograd would record (a parameter under no_grad is fine)."""
    return (
        t.is_cpu
        and t.dtype is torch.float32
        and t.is_contiguous()
        and not (t.requires_grad and torch.is_grad_enabled())
    )


def _ids(t: torch.Tensor) -> bool:
    """A contiguous int64 host tensor."""
    return t.is_cpu and t.dtype is torch.int64 and t.is_contiguous()


def compiler() -> str | None:
    """The C compiler this build would use, or None."""
    return shutil.which(os.environ.get("CC") or "cc")


def build_dir() -> Path:
    from xspec.cache import cache_root

    return cache_root() / "native"


def cpu_identity() -> str:
    """What a ``-march=native`` build depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(keys)))


def load() -> tuple[NativeKernels | None, str]:
    """The kernels (built now if not cached) and a one-line account of where they came
    from, or None and why not (the model then runs the reference torch ops). The build
    targets this CPU's vector units (``-march=native``; the cache key names the CPU, so
    a shared cache directory serves different machines), and falls back to the
    compiler's baseline target where the compiler refuses that. What the cache must
    satisfy to be used: :mod:`.cache`."""
    cc = compiler()
    if cc is None:
        return None, f"no C compiler (set $CC); {_REFERENCE}"
    try:
        cache, distrust = _cache.cache_dir(build_dir())
    except OSError as e:
        why = f"the kernel cache {build_dir()} cannot be created ({e.strerror or e})"
        return None, f"{why}; {_REFERENCE}"
    notes = [f"not cached: {distrust}"] if distrust else []
    with _cache.private_dir(cache) as private:
        try:
            found = _find_or_build(cc, cache, private, notes)
        except TimeoutError as e:
            found = str(e)
        if isinstance(found, str):
            return None, f"building {_SOURCE.name} failed ({found}); {_REFERENCE}"
        path, data, target = found
        try:
            lib = _open(data, private / path.name)
        except (OSError, LookupError) as e:
            return None, f"cannot load {path.name} ({_one_line(e)}); {_REFERENCE}"
    built = f"{path.name}, {' '.join(target) or 'baseline target'}"
    return NativeKernels(lib, path), f"native host kernels ({'; '.join([built, *notes])})"


_REFERENCE = "using the reference torch ops"
# verified libraries loaded in this process, by sha256: the same bytes are the same code
_LOADED: dict[str, ctypes.CDLL] = {}


def _find_or_build(
    cc: str, cache: Path | None, private: Path, notes: list[str]
) -> tuple[Path, bytes, tuple[str, ...]] | str:
    """The first target whose library is in the cache (verified) or builds now (into
    ``private``, then cached): ``(its cache path, or its private one where it could not
    be cached; its bytes; the target)``, or the last build error. Adds what it rejected
    or could not cache to ``notes``."""
    source = _SOURCE.read_bytes()
    failed = "no output"
    for target in _TARGETS:
        flags = (*_FLAGS, *target)
        ident = " ".join((cc, *flags, sys.platform, cpu_identity() if target else ""))
        name = f"xspec_host_{hashlib.sha256(source + ident.encode()).hexdigest()[:16]}.so"
        if cache is not None:
            data, rejected = _cache.verified(cache, name)
            if data is not None:
                return cache / name, data, target
            if rejected:  # ours to replace: delete it, build it once more
                notes.append(f"rebuilt: {rejected}")
                _cache.discard(cache, name)
        built = _cache.compile_library(cc, flags, _SOURCE, private / name)
        if isinstance(built, str):
            failed = built
            continue
        if cache is None:
            return private / name, built, target  # loaded from there, then gone
        unsaved = _cache.publish(cache, name, built)
        if unsaved:
            notes.append(unsaved)
            return private / name, built, target
        return cache / name, built, target
    return failed


def _open(data: bytes, copy: Path) -> ctypes.CDLL:
    """The library of the verified bytes ``data``, loaded from ``copy`` in a private
    directory (written there now for a cached library; a build is there already), its
    entry points typed. LookupError if one is missing."""
    digest = hashlib.sha256(data).hexdigest()
    if digest in _LOADED:
        return _LOADED[digest]
    if not copy.exists():
        copy.write_bytes(data)
    lib = ctypes.CDLL(str(copy))
    f, status = ctypes.c_float, ctypes.c_int64  # status: 0, or 1 for an index out of range
    for name, restype, argtypes in (
        ("xspec_mhc_pre", None, [_P, _P, _P, _I, _I, _I, f, _P, _I, _P, _P, _P, _P]),
        ("xspec_rms_norm", None, [_P, _P, _I, _I, f, _P]),
        ("xspec_rope", None, [_P, _P, _P, _I, _I, _I, _I, _I, _P]),
        ("xspec_index_topk", status,
         [_P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, f, _P, _P, _P]),
        ("xspec_sparse_attn", status, [_P, _I, _I, _I, *(_P, _I, _P, _I) * 2, _P, f, *(_P,) * 3]),
        ("xspec_moe", status,
         [_P, _P, *(_I,) * 3, *(_P,) * 3, *(_I,) * 5, f, f, *(_P,) * 3, _I, *(_P,) * 5]),
        ("xspec_compress_pool", status, [_P, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P]),
        ("xspec_w8a8_linear", None, [*(_P,) * 4, _I, _I, _I, _P]),
        ("xspec_lowbit_linear", None, [*(_P,) * 5, *(_I,) * 4, _P, _P]),
    ):  # fmt: skip
        try:
            fn = getattr(lib, name)
        except AttributeError:
            raise LookupError(f"it has no {name}") from None
        fn.restype, fn.argtypes = restype, argtypes
    _LOADED[digest] = lib
    return lib


def _one_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
