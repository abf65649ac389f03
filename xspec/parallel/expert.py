"""Expert parallelism: one rank's share of every MoE layer, and how token rows move.

EP rank ``r`` of a group of ``ep`` ranks holds the experts ``[r * E / ep, (r+1) * E / ep)``
of every MoE layer (target, MTP block, DSpark stages); gates, shared experts and
attention are replicated. One MoE layer on every rank of the group, each with its own
tokens (:meth:`ExpertParallel.run`):

1. the rank sorts its ``(token, expert)`` assignments by expert (the single-process MoE
   does the same), so the rows for each owner are contiguous;
2. **counts** (one ``all_gather`` of ``[tag, counts per expert]``): every rank learns how
   many rows each rank sends each expert; the tag (the layer id) catches ranks that are
   out of step with a clear error instead of mixing layers;
3. **dispatch**: the rows and their routing weights go to the owners;
4. each owner runs its experts on all the rows it received, grouped by expert;
5. **combine**: the per-assignment outputs go back in the sender's order, and the
   sender sums them exactly as the single-process MoE does (same order, fp32), so only
   the experts' matmuls see a different batch.

Row exchange: ``all_to_all_single`` (gloo, nccl, hccl), or, where a backend lacks it
(``parallel.moe_exchange=all_gather``), an ``all_gather`` of every rank's rows padded to
the longest, from which each rank slices its part: exact, at ``ep`` times the traffic
and memory of the rows.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.distributed as dist

from xspec.parallel.runtime import Parallel, PeerFailure, all_gather_tensor
from xspec.parallel.topology import expert_range

# a routed expert's tensor, checkpoint name or state_dict key: ...ffn.experts.{e}.w1.weight
_EXPERT_TENSOR = re.compile(r"(?:^|\.)ffn\.experts\.(\d+)\.")

# compute(rows [N, d], weights [N, 1] fp32, group sizes per global expert) -> [N, d]
ExpertCompute = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def expert_of(name: str) -> int | None:
    """The routed expert a tensor belongs to (checkpoint name or state_dict key), or None
    for every tensor EP ranks replicate."""
    m = _EXPERT_TENSOR.search(name)
    return None if m is None else int(m.group(1))


class ExpertParallel:
    """This rank's place in its EP group (``parallel.ep > 1``)."""

    def __init__(self, parallel: Parallel) -> None:
        topo = parallel.topology
        self.rank, self.size = topo.ep_rank, topo.ep
        self.global_rank = topo.rank
        self.group = parallel.ep_group
        self.exchange = parallel.exchange
        self._parallel = parallel

    def local(self, num_experts: int) -> range:
        """The expert ids this rank holds."""
        return expert_range(self.rank, self.size, num_experts)

    def holds(self, name: str, num_experts: int) -> bool:
        """Whether tensor ``name`` is loaded here: everything but other ranks' experts."""
        expert = expert_of(name)
        return expert is None or expert in self.local(num_experts)

    def run(
        self,
        xs: torch.Tensor,
        ws: torch.Tensor,
        counts: torch.Tensor,
        compute: ExpertCompute,
        tag: int,
    ) -> torch.Tensor:
        """One MoE layer's routed experts across the group.

        ``xs [N, d]`` this rank's assignment rows sorted by expert, ``ws [N, 1]`` fp32 their
        routing weights, ``counts [E]`` rows per expert -> ``[N, d]`` the expert outputs
        of the same rows, in the same order. Every rank of the group calls it once per
        layer call, with or without rows."""
        num_experts = counts.numel()
        per = num_experts // self.size
        table = self._counts(counts, tag)  # [ep][E]
        # matrix[s][r]: rows rank s sends rank r
        matrix = [[sum(row[r * per : (r + 1) * per]) for r in range(self.size)] for row in table]
        rows_in = self._exchange(xs, matrix)  # [R, d] source-major, expert-sorted per source
        ws_in = self._exchange(ws, matrix)  # [R, 1]
        mine = self.local(num_experts)
        chunks = [row[mine.start : mine.stop] for row in table]  # [ep][per] rows per source, expert
        perm = _expert_major(chunks).to(rows_in.device)  # [R] received rows regrouped by expert
        sizes = [0] * num_experts
        for j, e in enumerate(mine):
            sizes[e] = sum(c[j] for c in chunks)
        out = rows_in.new_empty(rows_in.shape)  # [R, d]
        if perm.numel():
            out[perm] = compute(rows_in[perm], ws_in[perm], sizes)
        return self._exchange(out, [list(col) for col in zip(*matrix)])  # [N, d] back home

    def _counts(self, counts: torch.Tensor, tag: int) -> list[list[int]]:
        """Every rank's rows per expert (``[ep][E]``), checking that all run layer ``tag``."""
        payload = torch.cat([counts.new_tensor([tag]), counts]).long()  # [1+E] on the device
        table = payload.new_empty(self.size * payload.numel())
        self._parallel.collective(
            f"MoE layer {tag} counts",
            lambda: all_gather_tensor(table, payload, group=self.group),
        )
        host = table.view(self.size, -1).tolist()  # the layer's one host sync
        tags = [row[0] for row in host]
        if any(t != tag for t in tags):
            raise PeerFailure(
                f"rank {self.global_rank}: expert-parallel ranks are out of step: this rank runs "
                f"MoE layer {tag}, the EP group's ranks run layers {tags} (an xspec bug: every "
                "rank must run the same forwards each step)"
            )
        return [row[1:] for row in host]

    def _exchange(self, x: torch.Tensor, matrix: list[list[int]]) -> torch.Tensor:
        """Rows ``x`` (``matrix[me][r]`` of them for rank ``r``, in rank order) to their
        ranks -> the rows sent here, in source-rank order."""
        me = self.rank
        send = matrix[me]
        recv = [row[me] for row in matrix]
        if not any(map(any, matrix)):  # nobody sends anything: every rank skips alike
            return x.new_empty((0, *x.shape[1:]))
        if self.exchange == "all_to_all":
            out = x.new_empty((sum(recv), *x.shape[1:]))
            self._parallel.collective(
                "MoE all_to_all",
                lambda: dist.all_to_all_single(out, x.contiguous(), recv, send, group=self.group),
            )
            return out
        longest = max(sum(row) for row in matrix)
        padded = x.new_zeros((longest, *x.shape[1:]))
        padded[: x.shape[0]] = x
        full = x.new_empty((self.size * longest, *x.shape[1:]))
        self._parallel.collective(
            "MoE all_gather",
            lambda: all_gather_tensor(full, padded, group=self.group),
        )
        parts = []
        for s, row in enumerate(matrix):
            start = s * longest + sum(row[:me])
            parts.append(full[start : start + row[me]])
        return torch.cat(parts)


def _expert_major(chunks: list[list[int]]) -> torch.Tensor:
    """``chunks[s][j]`` rows from source ``s`` for local expert ``j``, stored source-major
    -> the row order that groups them by expert (source order within an expert)."""
    offsets: list[list[int]] = []
    off = 0
    for row in chunks:
        offsets.append([])
        for n in row:
            offsets[-1].append(off)
            off += n
    ranges = [
        torch.arange(offsets[s][j], offsets[s][j] + chunks[s][j])
        for j in range(len(chunks[0]) if chunks else 0)
        for s in range(len(chunks))
    ]
    return torch.cat(ranges) if ranges else torch.empty(0, dtype=torch.long)


def routed_expert_bytes(*objects: object) -> int:
    """Bytes of the routed experts' tensors held here (parameters, and the buffers of
    resident quantized experts: their stored bytes), over the modules among ``objects``
    and the ``moe_module`` a drafter exposes (the memory EP divides)."""
    from torch import nn

    modules = [o for o in objects if isinstance(o, nn.Module)]
    modules += [m for o in objects if isinstance(m := getattr(o, "moe_module", None), nn.Module)]
    seen: set[int] = set()
    total = 0
    for module in modules:
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if _EXPERT_TENSOR.search(name) and id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
