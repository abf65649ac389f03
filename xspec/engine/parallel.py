"""The engine of one rank of a data x expert parallel launch.

:class:`ParallelEngine` is the :class:`~xspec.engine.engine.Engine` with requests spread
over the DP replicas and results gathered back:

1. rank 0's request list is broadcast (rank 0 owns the workload) and checked on every
   rank, so a malformed request fails everywhere alike;
2. request ``i`` goes to replica ``i % dp``, with ``concurrency // dp`` (at least 1) slots
   per replica: ``workload.concurrency`` stays the total in flight;
3. each rank runs its replica's requests in lockstep with its EP group (an empty share
   still iterates until every rank is done);
4. the first rank of each replica sends its generations and this run's acceptance
   counters to rank 0, which returns every generation in request order and adds the
   counters to its own (counts, never averages, so the aggregate rates equal a
   single process's). Other ranks return their own generations.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from xspec.engine.engine import Engine, Generation, Request
from xspec.metrics import SpecDecodeMetrics
from xspec.parallel.runtime import Parallel


class ParallelEngine(Engine):
    def __init__(self, *args: Any, parallel: Parallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.parallel = parallel

    def run(
        self,
        requests: Sequence[Request],
        concurrency: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[Generation]:
        topo = self.parallel.topology
        everything: list[Request]
        everything, every_group = self.parallel.broadcast(
            (list(requests), groups) if topo.is_main else None
        )
        for i, r in enumerate(everything):
            self.check(r, f"request {i}")
        mine = topo.requests_of_replica(len(everything))
        if not topo.is_main:  # ship only this run's counters
            self.metrics = SpecDecodeMetrics()
        gens = super().run(
            [everything[i] for i in mine],
            topo.concurrency_of_replica(concurrency),
            None if every_group is None else [every_group[i] for i in mine],
        )
        ship = topo.replica_leader and not topo.is_main
        gathered = self.parallel.gather((mine, gens, self.metrics.totals()) if ship else None)
        if gathered is None:
            return gens
        out: list[Generation | None] = [None] * len(everything)
        for i, g in zip(mine, gens):
            out[i] = g
        for item in gathered:
            if item is not None:
                indices, their_gens, totals = item
                for i, g in zip(indices, their_gens):
                    out[i] = g
                self.metrics.absorb(totals)
        assert all(g is not None for g in out), "a replica returned no generation"
        return out  # type: ignore[return-value]
