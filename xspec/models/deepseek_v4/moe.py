"""DeepSeek-V4 mixture of experts: sqrtsoftplus routing (learned top-k or hash) and
clamped SwiGLU experts.

Router (fp32): ``s = sqrt(softplus(x @ Wg^T))``. Learned layers pick ``topk(s + bias)``
(``bias`` only affects the selection); hash layers (``layer_id < num_hash_layers``) take
the experts from ``tid2eid[token_id]``. Weights ``s[idx]``, renormalised when
``norm_topk_prob``, times ``routed_scaling_factor``. Expert: ``w2((silu(min(w1 x, L)) *
clamp(w3 x, -L, L)) * weight)`` in fp32 (the routing weight is applied before ``w2``, as
officially); the shared expert is the same module, added unweighted.

Expert parallelism (``expert_parallel``, :mod:`xspec.parallel.expert`): the layer holds
only its rank's experts (the others are empty placeholders, so ids stay global and the
state_dict names only the local ones) and routes its assignments through the EP group;
the per-row sum stays the single-process one.

The local experts' weights are stacked ``[E, out, in]`` (each expert's ``w1/w2/w3``
parameter is a view of its row of the stack, so the checkpoint names and in-place
loading are unchanged and nothing is stored twice). A platform's ``moe`` op
(``ModelOps.moe``, given the router as :class:`~xspec.models.ops.MoeRouting`; the CPU's
native one) runs the whole layer, gate included, where
it takes the inputs and the experts are one stack. Otherwise, two ways to run the routed
experts:

* grouped GEMMs (``torch._grouped_mm``: one op per projection for all experts, group
  offsets computed on the device, so no host sync): where the platform prefers them
  (``ModelOps.grouped_mm_eager``) and in compiled steps, which cannot
  sync;
* with one host sync that reads the group sizes (free on the host): grouped GEMMs
  when more than two experts have rows, else the experts one after another (the
  reference, and what autograd runs).

Grouped GEMMs run only where ``ModelOps.grouped_mm_dtypes`` lists the dtype and the
kernel takes the shapes; a layer built without a platform's ops runs the reference.

Experts held quantized as stored (FP8, MXFP4, W8A8: :mod:`xspec.models.resident`) are not
stacked: the layer runs the reference, one expert after another, and each expert's
weights go through ``models.ops.dense`` (dequantized for that call, or the platform's
``quant_linear``), so only the experts that received rows are touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.ops import (
    EAGER_STEPS,
    REFERENCE_OPS,
    ModelOps,
    MoeRouting,
    StepOptions,
    dense,
    eager,
)
from xspec.models.resident import QuantLinear, weight_of

if TYPE_CHECKING:
    from xspec.parallel.expert import ExpertParallel


class Expert(nn.Module):
    """Checkpoint tensors: ``w1, w3 [inter, d]``, ``w2 [d, inter]`` (float, or resident
    quantized :class:`~xspec.models.resident.QuantLinear`); ``ops``: the platform's (its
    ``quant_linear`` computes quantized weights)."""

    def __init__(
        self,
        dim: int,
        inter: int,
        limit: float,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: ModelOps = REFERENCE_OPS,
    ) -> None:
        super().__init__()
        self.limit = limit
        self.ops = ops
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, d]``, optional routing ``weights [N, 1]`` fp32 -> ``[N, d]`` (x.dtype)."""
        gate = dense(self.ops, x, weight_of(self.w1)).float()
        up = dense(self.ops, x, weight_of(self.w3)).float()
        h = swiglu(gate, up, self.limit, weights).to(x.dtype)
        return dense(self.ops, h, weight_of(self.w2))


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, weights: torch.Tensor | None
) -> torch.Tensor:
    """``(silu(min(gate, L)) * clamp(up, -L, L)) * weights`` (fp32, any leading shape)."""
    if limit > 0:  # clamps keep the bf16 activations of big experts in range
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    h = F.silu(gate) * up
    return h if weights is None else weights * h


class Gate(nn.Module):
    """Checkpoint tensors: ``weight [E, d]`` fp32 and ``bias [E]`` fp32 (learned layers)
    or ``tid2eid [vocab, k]`` int64 (hash layers; a persistent buffer)."""

    tid2eid: torch.Tensor

    def __init__(
        self, args: DeepseekV4Args, hash_routed: bool, *, device: torch.device | str
    ) -> None:
        super().__init__()
        self.args = args
        self.hash_routed = hash_routed
        e, k = args.n_routed_experts, args.num_experts_per_tok
        self.weight = nn.Parameter(
            torch.zeros(e, args.hidden_size, dtype=torch.float32, device=device)
        )
        if hash_routed:
            self.bias = None
            tid2eid = torch.arange(k, device=device).repeat(args.vocab_size, 1)
            self.register_buffer("tid2eid", tid2eid, persistent=True)
        else:
            self.bias = nn.Parameter(torch.zeros(e, dtype=torch.float32, device=device))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, d]``, ``input_ids [T]`` -> ``weights [T, k]`` fp32, ``experts [T, k]`` int64."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        func = self.args.scoring_func
        if func == "softmax":
            scores = logits.softmax(dim=-1)
        elif func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hash_routed:
            experts = self.tid2eid[input_ids].long()
        else:
            biased = scores if self.bias is None else scores + self.bias
            experts = biased.topk(self.args.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.args.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.args.routed_scaling_factor, experts

    def routing(self) -> MoeRouting:
        """This router as a fused MoE op takes it (tensors and plain values)."""
        args = self.args
        return MoeRouting(
            self.weight,
            self.bias,
            self.tid2eid if self.hash_routed else None,
            args.scoring_func,
            args.num_experts_per_tok,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        )


class RemoteExpert(nn.Module):
    """Placeholder of an expert another EP rank holds (no tensors)."""


def grouped_mm_serves(dtype: torch.dtype, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` takes operands of ``dtype`` whose rows are ``widths``
    elements long (its kernels need 16-byte aligned strides)."""
    return hasattr(torch, "_grouped_mm") and all(w * dtype.itemsize % 16 == 0 for w in widths)


class MoE(nn.Module):
    """Checkpoint tensors (``layers.{i}.ffn.``): ``gate.*``, ``experts.{e}.w{1,2,3}``,
    ``shared_experts.w{1,2,3}``. ``tag``: the layer id, checked across EP ranks.
    ``steps``: the platform's ops and compiler. ``can_group`` / ``grouped`` (set with
    the stacks): grouped GEMMs serve this layer / run its routed experts always (no
    host sync).
    """

    w1: torch.Tensor | None  # the expert stacks (non-persistent buffers), see _stack_experts
    w2: torch.Tensor | None
    w3: torch.Tensor | None

    def __init__(
        self,
        args: DeepseekV4Args,
        hash_routed: bool,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        expert_parallel: ExpertParallel | None = None,
        tag: int = 0,
        steps: StepOptions = EAGER_STEPS,
    ) -> None:
        super().__init__()
        self.ops = steps.ops
        self.compiled = steps.compile is not None
        d, inter, limit = args.hidden_size, args.moe_intermediate_size, args.swiglu_limit
        self.limit = limit
        self.tag = tag
        self.dtype = dtype
        self.expert_parallel = expert_parallel
        self.gate = Gate(args, hash_routed, device=device)
        local = (
            range(args.n_routed_experts)
            if expert_parallel is None
            else expert_parallel.local(args.n_routed_experts)
        )
        self.experts = nn.ModuleList(
            Expert(d, inter, limit, dtype=dtype, device=device, ops=self.ops)
            if e in local
            else RemoteExpert()
            for e in range(args.n_routed_experts)
        )
        self.first_local = local.start if isinstance(local, range) else 0
        self.num_local = len(local)
        self.shared_experts = (
            Expert(
                d, inter * args.n_shared_experts, limit, dtype=dtype, device=device, ops=self.ops
            )
            if args.n_shared_experts
            else None
        )
        # one shared expert has the routed experts' shape: it joins the stack as its last
        # row and runs as one more group (all rows, weight 1) in the same grouped GEMMs
        self.shared_in_stack = args.n_shared_experts == 1
        self._stack_experts()

    @property
    def quantized(self) -> bool:
        """Whether the experts hold resident quantized weights (no float stacks then)."""
        return any(
            isinstance(getattr(ex, n), QuantLinear)
            for ex in [*self._local(), *([self.shared_experts] if self.shared_experts else [])]
            for n in ("w1", "w2", "w3")
        )

    def _local(self) -> list[Expert]:
        return [e for e in self.experts if isinstance(e, Expert)]

    def _stack_experts(self) -> None:
        """Make the local experts' weights views of ``[E_local (+1), out, in]`` stacks,
        the non-persistent buffers ``w1, w2, w3`` (one copy now; afterwards loading writes
        through the views; the shared expert is the last row when ``shared_in_stack``).
        Buffers, so a compiler treats them like parameters."""
        local: list[Expert] = self._local()
        # resident quantized experts (QuantLinear) are not stacked: the reference runs
        # them one at a time, dequantizing only the experts that have rows
        stacked = bool(local) and not self.quantized

        if stacked and self.shared_in_stack:
            assert self.shared_experts is not None
            local = [*local, self.shared_experts]
        for name in ("w1", "w2", "w3"):
            stack = None
            if stacked:
                linears = [getattr(ex, name) for ex in local]
                stack = torch.stack([lin.weight.detach() for lin in linears])
                for lin, row in zip(linears, stack.unbind(0)):
                    lin.weight = nn.Parameter(row, requires_grad=lin.weight.requires_grad)
            self.register_buffer(name, stack, persistent=False)
        # the first expert's linears: _stacked checks they still view the stacks
        self.__dict__["_first"] = (
            tuple(getattr(local[0], n) for n in ("w1", "w2", "w3")) if stacked else ()
        )
        self._choose_grouping()

    def _choose_grouping(self) -> None:
        """Grouped GEMMs where the platform's kernel takes the stacks' dtype and shapes;
        always where it prefers them or the steps are compiled."""
        w1, ops = self._buffers["w1"], self.ops
        self.can_group = (
            w1 is not None
            and str(w1.dtype).removeprefix("torch.") in ops.grouped_mm_dtypes
            and grouped_mm_serves(w1.dtype, w1.shape[1], w1.shape[2])
        )
        self.grouped = self.can_group and (self.compiled or ops.grouped_mm_eager)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoE:
        # .to() / .cuda() / to_empty() give every parameter new storage: restack
        out = super()._apply(fn, recurse)
        self._stack_experts()
        return out

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The weight stacks, if the experts' parameters still view them (a parameter
        replaced from outside, e.g. ``load_state_dict(assign=True)``, makes it restack;
        a compiled step trusts them)."""
        if self.w1 is None or torch.is_grad_enabled():
            return None
        stacks = self._buffers["w1"], self._buffers["w2"], self._buffers["w3"]
        if not torch.compiler.is_compiling() and any(
            lin._parameters["weight"].data_ptr() != stack.data_ptr()  # type: ignore[union-attr]
            for lin, stack in zip(self.__dict__["_first"], stacks)
        ):
            self._stack_experts()
            stacks = self._buffers["w1"], self._buffers["w2"], self._buffers["w3"]
        return stacks  # type: ignore[return-value]

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` (the ``ffn_norm`` output), ``input_ids [T]`` -> ``[T, d]``."""
        kernel = eager(self.ops.moe)  # the whole layer fused (no expert parallelism)
        one_stack = self.shared_experts is None or self.shared_in_stack
        if kernel is not None and self.expert_parallel is None and one_stack:
            stacks = self._stacked()
            if stacks is not None:
                routing = self.gate.routing()
                y = kernel(x, input_ids, routing, stacks, self.shared_in_stack, self.limit)
                if y is not None:
                    return y
        weights, experts = self.gate(x, input_ids)  # [T, k] each
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        stacks = self._stacked() if self.grouped else None
        if self.expert_parallel is None and stacks is not None:
            if x.shape[0]:
                y.index_add_(0, *self._routed(x, weights, experts, stacks))
            if self.shared_experts is not None and not self.shared_in_stack:
                y += self.shared_experts(x).float()
            return y.to(x.dtype)
        # group the T*k (row, expert) assignments by expert with one stable sort; the one
        # host sync (the group sizes) slices the groups, experts without rows are skipped
        flat = experts.flatten()  # [T*k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts))  # [E]
        rows = order // experts.shape[1]  # token row of each sorted assignment
        ws = weights.flatten()[order].unsqueeze(1)  # [N, 1] routing weight
        stacks = self._stacked() if self.can_group and self.shared_in_stack else None
        if self.expert_parallel is None and stacks is not None and x.shape[0]:
            # the routed groups and the shared expert as a last group: per row the same
            # sum in the same order (routed experts ascending, then the shared one)
            rows, ws = self._with_shared(rows, ws, x.shape[0])
            sizes = torch.tensor([*counts.tolist(), x.shape[0]])
            offs = sizes.cumsum(0, dtype=torch.int32).to(x.device)
            out = _grouped_swiglu(x.index_select(0, rows), ws, offs, stacks, self.limit)
            return y.index_add_(0, rows, out.float()).to(x.dtype)
        if self.expert_parallel is not None:  # every EP rank enters, with or without rows
            out = self.expert_parallel.run(
                x.index_select(0, rows), ws, counts, self._grouped, self.tag
            )  # [N, d]
            y.index_add_(0, rows, out.float())  # per row: ascending expert order
        elif rows.numel():
            out = self._grouped(x.index_select(0, rows), ws, counts.tolist())  # [N, d]
            y.index_add_(0, rows, out.float())  # per row: ascending expert order
        if self.shared_experts is not None:
            y += self.shared_experts(x).float()
        return y.to(x.dtype)

    def idle(self) -> None:
        """This layer with no rows: an EP rank with nothing to compute still serves the
        rows other ranks route to its experts (no-op without expert parallelism)."""
        if self.expert_parallel is not None:
            d, device = self.gate.weight.shape[1], self.gate.weight.device
            empty = torch.empty(0, d, dtype=self.dtype, device=device)
            self(empty, torch.empty(0, dtype=torch.long, device=empty.device))

    def _routed(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        experts: torch.Tensor,
        stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All routed assignments as grouped GEMMs, without a host sync: ``x [T, d]``,
        ``weights, experts [T, k]`` -> (token row of each assignment ``[T*k]``, its
        weighted expert output ``[T*k, d]`` fp32), for ``index_add_``."""
        flat = experts.flatten()  # [T*k]
        order = flat.argsort(stable=True)  # assignments grouped by expert, rows ascending
        ones = torch.ones_like(flat, dtype=torch.int32)
        groups = len(self.experts) + int(self.shared_in_stack)
        counts = torch.zeros(groups, dtype=torch.int32, device=x.device)
        counts = counts.scatter_add_(0, flat, ones)
        rows = order // experts.shape[1]
        ws = weights.flatten()[order].unsqueeze(1)  # [N, 1]
        if self.shared_in_stack:  # the shared expert: a last group of every row
            counts[-1] = x.shape[0]
            rows, ws = self._with_shared(rows, ws, x.shape[0])
        offs = counts.cumsum(0, dtype=torch.int32)
        out = _grouped_swiglu(x.index_select(0, rows), ws, offs, stacks, self.limit)
        return rows, out.float()

    @staticmethod
    def _with_shared(
        rows: torch.Tensor, ws: torch.Tensor, num_rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed assignments ``rows [N]``, ``ws [N, 1]`` plus the shared expert's:
        every row once, weight 1 (``weights * h`` is then ``h`` exactly)."""
        every = torch.arange(num_rows, device=rows.device)
        return torch.cat([rows, every]), torch.cat([ws, ws.new_ones(num_rows, 1)])

    def _grouped(self, xs: torch.Tensor, ws: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The routed experts on their groups: ``xs [N, d]`` rows sorted by expert,
        ``ws [N, 1]`` fp32 weights, ``sizes [E]`` group sizes -> ``[N, d]`` (x.dtype).

        Grouped GEMMs where they serve and more than two experts have rows; otherwise
        the reference: only the matmuls run per expert, the activation once on all rows.
        """
        stacks = self._stacked()
        if stacks is not None and xs.shape[0]:  # this rank's experts: a contiguous range
            e = self.num_local
            stacks = (stacks[0][:e], stacks[1][:e], stacks[2][:e])  # routed rows only
            local = sizes[self.first_local :][:e]
            # one grouped GEMM per projection beats one GEMM per expert from 3 experts
            # on (measured on the host: equal at 2, 1.6x at 4, 2x at 8)
            if self.grouped or (self.can_group and sum(1 for n in local if n) > 2):
                offs = torch.tensor(local).cumsum(0, dtype=torch.int32).to(xs.device)
                return _grouped_swiglu(xs, ws, offs, stacks, self.limit)
        experts = [cast(Expert, self.experts[e]) for e, n in enumerate(sizes) if n]
        counts = [n for n in sizes if n]
        ops = self.ops  # a quantized expert is dequantized (or computed natively) per call
        # the groups as split views (under autograd a slice's backward writes all N rows)
        rows = list(zip(experts, xs.split(counts)))
        gate = torch.cat([dense(ops, x, weight_of(ex.w1)) for ex, x in rows]).float()
        up = torch.cat([dense(ops, x, weight_of(ex.w3)) for ex, x in rows]).float()
        h = swiglu(gate, up, self.limit, ws).to(xs.dtype)  # [N, inter]
        return torch.cat(
            [dense(ops, x, weight_of(ex.w2)) for ex, x in zip(experts, h.split(counts))]
        )


def _grouped_swiglu(
    xs: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor,
    stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    limit: float,
) -> torch.Tensor:
    """Expert ``g`` on rows ``offs[g-1]:offs[g]`` of ``xs [N, d]`` (sorted by expert),
    three grouped GEMMs over the stacks ``w1, w2, w3 [E, out, in]`` -> ``[N, d]``."""
    w1, w2, w3 = stacks
    mm = grouped_mm if torch.compiler.is_compiling() else _grouped_mm
    gate = mm(xs, w1.transpose(1, 2), offs).float()
    up = mm(xs, w3.transpose(1, 2), offs).float()
    h = swiglu(gate, up, limit, ws).to(xs.dtype)
    return mm(h, w2.transpose(1, 2), offs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@torch.library.custom_op("xspec::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` as an opaque op for compiled steps: ``a [N, k]`` rows
    sorted by group, ``b [G, k, n]``, ``offs [G]`` int32 group ends -> ``[N, n]``. (The
    compiler's shape function of ``_grouped_mm`` accepts only bf16; the kernels take
    fp32 too.)"""
    return torch._grouped_mm(a, b, offs=offs)


@grouped_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])
