"""Which rank does what: the data x expert layout of a torchrun launch (no torch here).

``world`` processes (torchrun's ``WORLD_SIZE``; 1 without torchrun), ranks ``0..world-1``:

* **DP replicas**: ``dp`` of them, each ``world / dp`` consecutive ranks. Request ``i``
  goes to replica ``i % dp``; the ranks of one replica decode the same requests (xspec
  has no tensor parallelism: they compute the replica's attention redundantly and split
  its experts), so ``dp = world`` is the efficient layout (data-parallel attention).
* **EP groups**: ``world / ep`` groups of ``ep`` consecutive ranks; each group holds one
  copy of every MoE layer's experts, EP rank ``r`` the contiguous ids
  ``[r * E / ep, (r + 1) * E / ep)``. Tokens of every rank of a group are routed inside it.

Examples: 2 processes ``ep=2`` (dp 1): one replica, experts halved. 4 processes
``dp=2 ep=2``: replicas {0,1} and {2,3}, EP groups the same pairs. 16 NPUs ``dp=16
ep=16``: every rank its own requests, 1/16 of the experts (the reference deployment's
expert split).

torchrun's environment (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``) is the launcher's
contract, read in one place (:func:`launch`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """What the launcher says about this process."""

    world: int = 1
    rank: int = 0
    local_rank: int = 0


def launch() -> Launch:
    """This process's place in a torchrun launch (``Launch()`` without torchrun)."""
    env = os.environ
    if "WORLD_SIZE" not in env:
        return Launch()
    return Launch(
        world=int(env["WORLD_SIZE"]),
        rank=int(env.get("RANK", "0")),
        local_rank=int(env.get("LOCAL_RANK", "0")),
    )


@dataclass(frozen=True)
class Topology:
    """The layout of one run (``parallel.dp`` x ``parallel.ep`` over ``world`` ranks)."""

    world: int
    rank: int
    dp: int
    ep: int

    @property
    def replica_size(self) -> int:
        return self.world // self.dp

    @property
    def replica(self) -> int:
        """The DP replica this rank decodes for."""
        return self.rank // self.replica_size

    @property
    def replica_leader(self) -> bool:
        """The first rank of its replica: the one whose results reach rank 0."""
        return self.rank % self.replica_size == 0

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def ep_group_ranks(self) -> list[list[int]]:
        """Every EP group's ranks, in group order."""
        return [list(range(g * self.ep, (g + 1) * self.ep)) for g in range(self.world // self.ep)]

    @property
    def is_main(self) -> bool:
        """Rank 0 owns the workload, the printed report and results.json."""
        return self.rank == 0

    def requests_of_replica(self, num_requests: int) -> list[int]:
        """Request indices of this rank's replica (round-robin)."""
        return list(range(self.replica, num_requests, self.dp))

    def concurrency_of_replica(self, concurrency: int) -> int:
        """This replica's share of ``workload.concurrency`` (the total in flight), >= 1."""
        share = concurrency // self.dp + (self.replica < concurrency % self.dp)
        return max(1, share)


def expert_range(ep_rank: int, ep: int, num_experts: int) -> range:
    """The contiguous expert ids EP rank ``ep_rank`` of ``ep`` holds."""
    per = num_experts // ep
    return range(ep_rank * per, (ep_rank + 1) * per)
