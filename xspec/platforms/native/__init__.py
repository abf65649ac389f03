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
  (gather, concatenations, softmax, product and sum in torch).

The attention and expert products are vectorised explicitly (the GCC / clang vector
extension) and may fuse multiply-adds, as the BLAS behind the reference ops does; the
other kernels round every product and sum as the reference ops do.

Each returns None for inputs it does not take (not fp32, not contiguous, an index out
of range, a prefill-sized MoE call), and the caller runs the reference torch ops
instead (which raise their own error for a bad index: the kernels never read outside
their buffers). Rows are independent: what a kernel gives a row does not depend on what
else is in the batch.

``kernels.c`` is plain C over float32 buffers (no Python or torch headers), compiled with
the system C compiler (``$CC``, else ``cc``) for this CPU (``-march=native``, else the
compiler's baseline) into ``$XSPEC_CACHE_DIR/native/`` under a name that hashes the
source, the flags and the CPU, loaded with ctypes, and called with the tensors' data
pointers. Where there is no compiler or the build fails, :func:`load` says why
and the model runs the reference torch ops (``platform.kernels=reference`` forces that).
Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

_SOURCE = Path(__file__).with_name("kernels.c")
_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
# The moe kernel runs at 10-35 G multiply-adds/s (more with more rows per expert), the
# reference's grouped GEMMs at BLAS speed after ~0.2 ms of dispatch: measured on dsv4 MoE
# layers (d 256, inter 32 and 128), the kernel is faster up to ~9 M multiply-adds per call
# (decode and verify batches) and no faster above (prefill chunks).
MOE_MAX_MACS = 8_000_000
# the targets a build tries, in order: this CPU's vector units, then the compiler's baseline
_TARGETS: tuple[tuple[str, ...], ...] = (("-march=native",), ())
_P = ctypes.c_void_p
_I = ctypes.c_int64


@dataclass(frozen=True)
class NativeKernels:
    """The loaded library's entry points, as torch-level functions."""

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
        if x is not None and not _takes(x):
            x = None
        rows = mix.shape[0]
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
        if not _takes(x) or (weight is not None and not _takes(weight)):
            return None
        y = torch.empty_like(x)
        n = x.shape[-1]
        rows = x.numel() // n if n else 0
        wp = None if weight is None else weight.data_ptr()
        self.lib.xspec_rms_norm(x.data_ptr(), wp, rows, n, ctypes.c_float(eps), y.data_ptr())
        return y

    def rope(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
    ) -> torch.Tensor | None:
        """``rope.rotate`` of fp32 ``x [N, ..., D]`` with ``cos, sin [N, rd]``."""
        if not (_takes(x) and _takes(cos) and _takes(sin)) or x.dim() < 2:
            return None
        rows, d, rd = x.shape[0], x.shape[-1], cos.shape[-1]
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
        at most -> ``[T, k]`` int64, ascending, -1 = none."""
        if not all(_takes(t) for t in (q, weights, keys)) or not all(
            t.dtype == torch.int64 and t.device.type == "cpu" for t in (key0, visible)
        ):
            return None
        key0, visible = key0.contiguous(), visible.contiguous()
        out = torch.empty(q.shape[0], k, dtype=torch.int64)
        score = torch.empty(max(n, 1))
        heap = torch.empty(max(k, 1), dtype=torch.int64)
        self.lib.xspec_index_topk(
            q.data_ptr(), weights.data_ptr(), keys.data_ptr(), key0.data_ptr(),
            visible.data_ptr(), q.shape[0], q.shape[1], q.shape[2], n, k, ctypes.c_float(scale),
            score.data_ptr(), heap.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        return out

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
        gate: Any,
        stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        shared: bool,
        limit: float,
    ) -> torch.Tensor | None:
        """``moe.MoE.forward`` of fp32 ``x [T, d]``: the gate (``moe.Gate``: its
        ``weight``, ``bias`` or hash table ``tid2eid``, and ``args``' scoring) and the
        experts' stacks ``w1, w3 [G, inter, d]``, ``w2 [G, d, inter]`` (the shared expert
        last when ``shared``) -> ``[T, d]`` fp32. None beyond :data:`MOE_MAX_MACS`."""
        w1, w2, w3 = stacks
        args = gate.args
        table = gate.tid2eid if gate.hash_routed else None
        bias = gate.bias
        if not all(_takes(t) for t in (x, gate.weight, w1, w2, w3)) or (
            bias is not None and not _takes(bias)
        ):
            return None
        if not (_ids(input_ids) and (table is None or _ids(table))) or x.dim() != 2:
            return None
        rows, d = x.shape
        experts, k, inter = gate.weight.shape[0], args.num_experts_per_tok, w1.shape[1]
        if w1.shape[0] != experts + int(shared) or w1.shape[2] != d:
            return None
        if rows * (k + int(shared)) * 3 * inter * d > MOE_MAX_MACS:
            return None  # prefill-sized: the reference's BLAS grouped GEMMs are faster
        score_fn = {"softmax": 0, "sigmoid": 1}.get(args.scoring_func, 2)
        y = torch.empty_like(x)
        most = max(rows * k, rows)  # assignments one expert may have
        scratch = torch.empty(2 * experts + rows * k + most * (3 * inter + d))
        pick = torch.empty(rows * k, dtype=torch.int64)
        members = torch.empty(most, dtype=torch.int64)
        ptrs = torch.empty(2 * most, dtype=torch.int64)  # row pointers
        bad = self.lib.xspec_moe(
            x.data_ptr(), input_ids.data_ptr(), rows, d, inter, gate.weight.data_ptr(),
            None if bias is None else bias.data_ptr(), None if table is None else table.data_ptr(),
            0 if table is None else table.shape[0], experts, k, score_fn,
            int(args.norm_topk_prob), ctypes.c_float(args.routed_scaling_factor),
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

    def by_name(self) -> dict[str, Any]:
        """``StepOptions.kernels`` entries."""
        return {
            "mhc_pre": self.mhc_pre,
            "rms_norm": self.rms_norm,
            "rope": self.rope,
            "index_topk": self.index_topk,
            "sparse_attention": self.sparse_attention,
            "moe": self.moe,
            "compress_pool": self.compress_pool,
        }


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
    from xspec.models.loading import cache_root

    return cache_root() / "native"


def cpu_identity() -> str:
    """What a ``-march=native`` build depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    keys = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    return "\n".join(dict.fromkeys(line for line in lines if line.startswith(keys)))


def _build(cc: str, flags: tuple[str, ...], path: Path) -> str | None:
    """Compile ``kernels.c`` into ``path`` (atomically); the compiler's last error line
    on failure, else None."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        out = Path(tmp) / path.name
        cmd = [cc, *flags, "-o", str(out), str(_SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["no output"])[-1]
        os.replace(out, path)  # atomic: concurrent builders race harmlessly
    return None


def load() -> tuple[NativeKernels | None, str]:
    """The kernels (built now if not cached) and a one-line account of where they came
    from, or None and why not. The build targets this CPU's vector units
    (``-march=native``; the cache key names the CPU, so a shared cache directory serves
    different machines), and falls back to the compiler's baseline target where the
    compiler refuses that."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (set $CC); using the reference torch ops"
    source = _SOURCE.read_bytes()
    failed = "no output"
    for target in _TARGETS:
        flags = (*_FLAGS, *target)
        ident = " ".join((cc, *flags, sys.platform, cpu_identity() if target else ""))
        key = hashlib.sha256(source + ident.encode()).hexdigest()
        path = build_dir() / f"xspec_host_{key[:16]}.so"
        if path.exists():
            break
        error = _build(cc, flags, path)
        if error is None:
            break
        failed = error
    else:
        return None, f"building {_SOURCE.name} failed ({failed}); using the reference torch ops"
    lib = ctypes.CDLL(str(path))
    f, status = ctypes.c_float, ctypes.c_int64  # status: 0, or 1 for an index out of range
    for name, restype, argtypes in (
        ("xspec_mhc_pre", None, [_P, _P, _P, _I, _I, _I, f, _P, _I, _P, _P, _P, _P]),
        ("xspec_rms_norm", None, [_P, _P, _I, _I, f, _P]),
        ("xspec_rope", None, [_P, _P, _P, _I, _I, _I, _I, _I, _P]),
        ("xspec_index_topk", None, [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, f, _P, _P, _P]),
        ("xspec_sparse_attn", status, [_P, _I, _I, _I, *(_P, _I, _P, _I) * 2, _P, f, *(_P,) * 3]),
        ("xspec_moe", status,
         [_P, _P, *(_I,) * 3, *(_P,) * 3, *(_I,) * 5, f, f, *(_P,) * 3, _I, *(_P,) * 5]),
        ("xspec_compress_pool", status, [_P, _I, _P, _I, _P, _I, _I, _I, _I, _P, _P]),
    ):  # fmt: skip
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    built = f"{path.name}, {' '.join(target) or 'baseline target'}"
    return NativeKernels(lib, path), f"native host kernels ({built})"
