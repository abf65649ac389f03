"""The ops a model lets a platform run for it: one typed Protocol per op, plain tensors in
and out, and the :class:`ModelOps` a model receives at construction.

A model owns these interfaces (it defines what each op computes: its reference code);
a platform implements the ones its devices do faster and leaves the rest None, which
means "run the model's reference op". An op may also answer None for inputs it does not
take (a dtype, a device, a shape beyond what it was written for): the model then runs
its reference for that call. Ops run only in eager inference (:func:`eager`): they have
no backward, and a compiler fuses the reference ops itself.

Nothing here imports a platform or a model: ``xspec.platforms`` imports this module and
nothing else of ``xspec.models`` (a test keeps it so).

Also here, because platform and model both name them: :class:`StepOptions` (how the
model runs its stateless steps: ops, compiler) and the DeepSeek-V4 draft window's
sparse-attention types (:class:`SasMode`, :class:`DraftAttentionOp`,
:class:`SasIndicesRejected`; see docs/npu.md).
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from xspec.models.quantized import QuantizedWeight, native_linear

# ---- the op protocols (shapes as the reference ops take them) -------------------------


class RmsNormOp(Protocol):
    """RMS normalisation over the last dim of ``x [..., n]``, times ``weight [n]`` if
    given -> same shape and dtype as ``x``."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float
    ) -> torch.Tensor | None: ...


class RopeOp(Protocol):
    """RoPE (or its inverse) on the last ``rd`` dims of ``x [N, ..., D]`` with ``cos, sin
    [N, rd]`` (pairs of adjacent dims) -> same shape and dtype as ``x``."""

    def __call__(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool
    ) -> torch.Tensor | None: ...


class MhcPreOp(Protocol):
    """The mHC collapse after its ``fn`` projection: ``mix [T, (2+hc)*hc]``, ``scale
    [3]``, ``base [(2+hc)*hc]`` fp32, Sinkhorn ``iters`` and ``eps``, optionally the
    streams ``x [T, hc, d]`` -> ``(u [T, d] or None without x, pre [T, hc], post [T, hc],
    comb [T, hc, hc])``."""

    def __call__(
        self,
        mix: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        hc: int,
        iters: int,
        eps: float,
        x: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor] | None: ...


class SparseAttentionOp(Protocol):
    """Attention of each query ``q [S, H, D]`` over its own rows of one or more ``parts``
    ``(kv [N, D], index [S, K])`` (K = V, index -1 = none), with a value-less ``sink [H]``
    in the softmax denominator -> ``[S, H, D]`` fp32."""

    def __call__(
        self,
        q: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor | None: ...


@dataclass(eq=False, slots=True)  # not frozen: built per MoE call, frozen init costs more
class MoeRouting:
    """What a fused MoE op needs of the router, as tensors and plain values.

    ``weight [E, d]`` fp32 scores the experts; ``scoring``: ``softmax``, ``sigmoid`` or
    ``sqrtsoftplus``; learned routing picks the ``top_k`` of scores + ``bias [E]``, hash
    routing reads ``tid2eid [vocab, top_k]`` at the token ids (then ``bias`` is None);
    the picked scores are renormalised when ``normalize`` and scaled by ``scale``.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    tid2eid: torch.Tensor | None
    scoring: str
    top_k: int
    normalize: bool
    scale: float


class MoeOp(Protocol):
    """A whole MoE layer: ``x [T, d]`` fp32, ``input_ids [T]`` int64, the ``routing``,
    the experts' stacks ``w1, w3 [G, inter, d]``, ``w2 [G, d, inter]`` (the shared
    expert last when ``shared``) and the SwiGLU clamp ``limit`` -> ``[T, d]`` fp32.
    Float stacks only: a layer with resident quantized experts does not call it."""

    def __call__(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        routing: MoeRouting,
        stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        shared: bool,
        limit: float,
    ) -> torch.Tensor | None: ...


class IndexTopkOp(Protocol):
    """The lightning indexer's causal top-``k``: ``q [T, H, c]``, head ``weights [T, H]``,
    ``keys [*, c]`` fp32; ``key0, visible [T]`` int64 (each row's first key and its
    causal entry count); ``n`` entries per sequence at most -> ``[T, k]`` int64 entry
    ids, ascending, -1 = none."""

    def __call__(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        key0: torch.Tensor,
        visible: torch.Tensor,
        n: int,
        k: int,
        scale: float,
    ) -> torch.Tensor | None: ...


class CompressPoolOp(Protocol):
    """Softmax pooling of compressed entries: the rows ``index [E, coff*ratio]`` of
    ``cat(ring [R, 2*coff*width], rows [T, 2*coff*width], pad)`` (``[kv | score]``
    halves) -> ``[E, width]`` fp32, before norm and rope."""

    def __call__(
        self,
        ring: torch.Tensor,
        rows: torch.Tensor,
        index: torch.Tensor,
        ratio: int,
        coff: int,
        width: int,
    ) -> torch.Tensor | None: ...


class LinearOp(Protocol):
    """``x [..., in] @ weight [out, in].T (+ bias [out])`` -> ``[..., out]`` in x.dtype
    (reference: ``torch.nn.functional.linear``; quantized weights extend this op)."""

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None: ...


class QuantLinearOp(Protocol):
    """``x [..., in] @ W.T (+ bias [out])`` for a resident quantized ``weight``
    (:class:`~xspec.models.quantized.QuantizedWeight`) with the format's *native*
    semantics (activations quantized as the format prescribes:
    :func:`~xspec.models.quantized.native_linear` states them) -> ``[..., out]`` in
    x.dtype, or None for a format / shape it does not take."""

    def __call__(
        self, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor | None: ...


@dataclass(frozen=True, eq=False)
class ModelOps:
    """The ops a platform runs for a model; None = the model's reference op.

    ``grouped_mm_dtypes``: the weight dtypes ``torch._grouped_mm`` serves on the device
    (MoE experts as grouped GEMMs); ``grouped_mm_eager``: eager steps use them always
    (no host sync per MoE layer) rather than picking per call where a sync is free.
    """

    rms_norm: RmsNormOp | None = None
    rope: RopeOp | None = None
    mhc_pre: MhcPreOp | None = None
    sparse_attention: SparseAttentionOp | None = None
    moe: MoeOp | None = None
    index_topk: IndexTopkOp | None = None
    compress_pool: CompressPoolOp | None = None
    linear: LinearOp | None = None
    quant_linear: QuantLinearOp | None = None
    grouped_mm_dtypes: frozenset[str] = frozenset()
    grouped_mm_eager: bool = False


REFERENCE_OPS = ModelOps()

_Op = TypeVar("_Op")


def eager(op: _Op | None) -> _Op | None:
    """``op`` where it may run: not under autograd (ops have no backward) and not while a
    compiler traces (it fuses the reference ops itself). None: run the reference."""
    if op is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    return op


def linear(
    ops: ModelOps,
    x: torch.Tensor,
    weight: torch.Tensor | QuantizedWeight,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``ops.linear`` where it runs and takes the inputs, else ``F.linear``; a quantized
    weight goes through :func:`quant_native` first (``dequant`` mode comes back here with
    the dequantized weight, so it runs exactly the float model's op)."""
    if isinstance(weight, QuantizedWeight):
        y = quant_native(ops, x, weight, bias)
        if y is not None:
            return y
        weight = weight.dequantize()
    op = eager(ops.linear)
    if op is not None and (y := op(x, weight, bias)) is not None:
        return y
    return torch.nn.functional.linear(x, weight, bias)


def dense(ops: ModelOps, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    """``F.linear(x, weight)`` for call sites that never delegate a float weight (the MoE
    experts): a quantized weight computes natively (see :func:`quant_native`) or is
    dequantized for this call only."""
    if isinstance(weight, QuantizedWeight):
        y = quant_native(ops, x, weight, None)
        if y is not None:
            return y
        weight = weight.dequantize()
    return torch.nn.functional.linear(x, weight)


def quant_native(
    ops: ModelOps, x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None
) -> torch.Tensor | None:
    """The native result for ``weight.compute``, or None for the ``dequant`` path:
    ``native``: the platform's ``quant_linear`` where it takes the call, else the
    plain-torch semantics; ``auto``: the platform's op or None; ``dequant``: None."""
    if weight.compute == "dequant":
        return None
    op = eager(ops.quant_linear)
    if op is not None and (y := op(x, weight, bias)) is not None:
        return y
    return native_linear(x, weight, bias) if weight.compute == "native" else None


@dataclass(frozen=True, eq=False)
class StepOptions:
    """How a model runs its stateless step functions, decided by the platform
    (``Platform.step_options``) and given to the model's constructor.

    ``ops``: the platform's ops (:class:`ModelOps`). ``compile``: wraps a pure step
    function into its compiled form (memoised per function, so every layer shares the
    graphs), or None to run eagerly. ``describe``: one line for the run report.
    """

    ops: ModelOps = REFERENCE_OPS
    compile: Any = None
    describe: str = "eager, reference torch ops"
    # GEMM rows padded to a multiple of this in the target's forward (1: as they come;
    # ``platform.batch_invariant``, :mod:`xspec.models.invariant`)
    row_tile: int = 1

    def rows(self) -> contextlib.AbstractContextManager[Any]:
        """The context a target's forward runs in: :class:`~xspec.models.invariant.
        PaddedRows` where ``row_tile`` > 1 (every row's logits independent of the rows
        sharing its forward), else nothing."""
        if self.row_tile <= 1:
            return contextlib.nullcontext()
        from xspec.models.invariant import PaddedRows

        return PaddedRows(self.row_tile)

    def summary(self) -> str:
        """``describe``, plus what compiling has cost so far (graphs, seconds)."""
        if self.compile is None:
            return self.describe
        return f"{self.describe}; {self.compile.describe()}"


EAGER_STEPS = StepOptions()


# ---- the DeepSeek-V4 draft window's sparse attention (docs/npu.md) ---------------------


class SasMode(str, enum.Enum):
    """Which key window the DSv4 draft's sliding-window attention sees (docs/npu.md).

    NATIVE: context positions ``[p - window, p)`` plus the whole draft block, given to the
    kernel as explicit ``ori_sparse_indices``. COMPAT: the last ``window`` positions ending
    at the block end (loses gamma context positions; every kernel supports it).
    """

    NATIVE = "native"
    COMPAT = "compat"

    def ori_win_left(self, window: int, gamma: int) -> int:
        """Left extent of the sparse-attention window the kernel is tiled for.

        native: ``window + gamma - 1`` (the block's keys sit beyond the window);
        compat, or a native block of width 0: ``window - 1``.
        """
        if window < 1 or gamma < 0:
            raise ValueError(
                f"ori_win_left needs window >= 1 and gamma >= 0, got {window}, {gamma}"
            )
        if self is SasMode.NATIVE and gamma > 0:
            return window + gamma - 1
        return window - 1


class SasIndicesRejected(RuntimeError):
    """The installed sparse attention operator refused explicit (native) window indices."""


class DraftAttentionOp(Protocol):
    """The DSpark draft window's attention: :class:`SparseAttentionOp`'s arguments, and
    ``explicit_indices`` (the native layout's explicit index set) -> ``[S, H, D]`` fp32,
    or None to run the model's reference. Raises :class:`SasIndicesRejected` where the
    operator cannot take explicit indices (the draft then falls back to COMPAT)."""

    def __call__(
        self,
        q: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        sink: torch.Tensor,
        scale: float,
        *,
        explicit_indices: bool,
    ) -> torch.Tensor | None: ...


__all__ = [
    "EAGER_STEPS",
    "REFERENCE_OPS",
    "CompressPoolOp",
    "DraftAttentionOp",
    "IndexTopkOp",
    "LinearOp",
    "MhcPreOp",
    "ModelOps",
    "MoeOp",
    "MoeRouting",
    "QuantLinearOp",
    "QuantizedWeight",
    "RmsNormOp",
    "RopeOp",
    "SasIndicesRejected",
    "SasMode",
    "SparseAttentionOp",
    "StepOptions",
    "dense",
    "eager",
    "linear",
    "quant_native",
]
