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
  ops in torch, one host sync).

Each returns None for inputs it does not take (not fp32, not contiguous), and the
caller runs the reference torch ops instead. Rows are independent: a row's result
does not depend on what else is in the batch.

``kernels.c`` is plain C over float32 buffers (no Python or torch headers), compiled with
the system C compiler (``$CC``, else ``cc``) into ``$XSPEC_CACHE_DIR/native/`` under a
name that hashes the source and flags, loaded with ctypes, and called with the tensors'
data pointers. Where there is no compiler or the build fails, :func:`load` says why
and the model runs the reference torch ops (``platform.kernels=reference`` forces that).
Nothing here runs at import.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
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

    def by_name(self) -> dict[str, Any]:
        """``StepOptions.kernels`` entries."""
        return {
            "mhc_pre": self.mhc_pre,
            "rms_norm": self.rms_norm,
            "rope": self.rope,
            "index_topk": self.index_topk,
        }


def _takes(t: torch.Tensor) -> bool:
    """A tensor the kernels can read through its data pointer: host memory, fp32,
    contiguous, outside autograd."""
    return (
        t.device.type == "cpu"
        and t.dtype == torch.float32
        and t.is_contiguous()
        and not t.requires_grad
    )


def compiler() -> str | None:
    """The C compiler this build would use, or None."""
    return shutil.which(os.environ.get("CC") or "cc")


def build_dir() -> Path:
    from xspec.models.loading import cache_root

    return cache_root() / "native"


def load() -> tuple[NativeKernels | None, str]:
    """The kernels (built now if not cached) and a one-line account of where they came
    from, or None and why not."""
    cc = compiler()
    if cc is None:
        return None, "no C compiler (set $CC); using the reference torch ops"
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc, *_FLAGS, sys.platform)).encode()).hexdigest()
    path = build_dir() / f"xspec_host_{key[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            cmd = [cc, *_FLAGS, "-o", str(out), str(_SOURCE), "-lm"]
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                err = (done.stderr.strip().splitlines() or ["no output"])[-1]
                return (
                    None,
                    f"building {_SOURCE.name} failed ({err}); using the reference torch ops",
                )
            os.replace(out, path)  # atomic: concurrent builders race harmlessly
    lib = ctypes.CDLL(str(path))
    f = ctypes.c_float
    for name, argtypes in (
        ("xspec_mhc_pre", [_P, _P, _P, _I, _I, _I, f, _P, _I, _P, _P, _P, _P]),
        ("xspec_rms_norm", [_P, _P, _I, _I, f, _P]),
        ("xspec_rope", [_P, _P, _P, _I, _I, _I, _I, _I, _P]),
        ("xspec_index_topk", [_P, _P, _P, _P, _P, _I, _I, _I, _I, _I, f, _P, _P, _P]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return NativeKernels(lib, path), f"native host kernels ({path.name})"
