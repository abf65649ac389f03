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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from xspec.models.deepseek_v4.args import DeepseekV4Args

if TYPE_CHECKING:
    from xspec.parallel.expert import ExpertParallel


class Expert(nn.Module):
    """Checkpoint tensors: ``w1, w3 [inter, d]``, ``w2 [d, inter]``."""

    def __init__(
        self, dim: int, inter: int, limit: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype, device=device)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """``x [N, d]``, optional routing ``weights [N, 1]`` fp32 -> ``[N, d]`` (x.dtype)."""
        gate = F.linear(x, self.w1.weight).float()
        up = F.linear(x, self.w3.weight).float()
        return F.linear(swiglu(gate, up, self.limit, weights).to(x.dtype), self.w2.weight)


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


class RemoteExpert(nn.Module):
    """Placeholder of an expert another EP rank holds (no tensors)."""


class MoE(nn.Module):
    """Checkpoint tensors (``layers.{i}.ffn.``): ``gate.*``, ``experts.{e}.w{1,2,3}``,
    ``shared_experts.w{1,2,3}``. ``tag``: the layer id, checked across EP ranks."""

    def __init__(
        self,
        args: DeepseekV4Args,
        hash_routed: bool,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        expert_parallel: ExpertParallel | None = None,
        tag: int = 0,
    ) -> None:
        super().__init__()
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
            Expert(d, inter, limit, dtype=dtype, device=device) if e in local else RemoteExpert()
            for e in range(args.n_routed_experts)
        )
        self.shared_experts = (
            Expert(d, inter * args.n_shared_experts, limit, dtype=dtype, device=device)
            if args.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` (the ``ffn_norm`` output), ``input_ids [T]`` -> ``[T, d]``."""
        weights, experts = self.gate(x, input_ids)  # [T, k] each
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # group the T*k (row, expert) assignments by expert with one stable sort; the one
        # host sync (the group sizes) slices the groups, experts without rows are skipped
        flat = experts.flatten()  # [T*k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts))  # [E]
        rows = order // experts.shape[1]  # token row of each sorted assignment
        ws = weights.flatten()[order].unsqueeze(1)  # [N, 1] routing weight
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

    def _grouped(self, xs: torch.Tensor, ws: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """The routed experts on their groups: ``xs [N, d]`` rows sorted by expert,
        ``ws [N, 1]`` fp32 weights, ``sizes [E]`` group sizes -> ``[N, d]`` (x.dtype).

        Only the matmuls run per expert; the activation runs once on all rows.
        """
        groups: list[tuple[Expert, slice]] = []
        lo = 0
        for e, n in enumerate(sizes):
            if n:
                groups.append((cast(Expert, self.experts[e]), slice(lo, lo + n)))
                lo += n
        gate = torch.cat([F.linear(xs[g], ex.w1.weight) for ex, g in groups]).float()
        up = torch.cat([F.linear(xs[g], ex.w3.weight) for ex, g in groups]).float()
        h = swiglu(gate, up, self.limit, ws).to(xs.dtype)  # [N, inter]
        return torch.cat([F.linear(h[g], ex.w2.weight) for ex, g in groups])
