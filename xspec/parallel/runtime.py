"""The torch.distributed runtime of a torchrun launch: process groups and fault handling.

:func:`init_parallel` joins the default process group (torchrun's ``env://``
rendezvous) with the backend the platform names (``Platform.distributed_backend()``:
gloo on the CPU, nccl on CUDA, hccl on the NPU; ``parallel.backend`` overrides it) and
``parallel.timeout_s`` as every collective's timeout, then creates the EP groups. It
runs once per process (a multirun reuses the groups).

Faults: every collective xspec issues goes through :func:`collective`, which turns a
backend failure (a peer's socket closed because it died, or a wait longer than the
timeout because it hangs) into :class:`PeerFailure`, naming this rank, the operation
and the timeout. The CLI prints it and exits with :data:`PEER_FAILURE_EXIT` without
running interpreter teardown (which could wait on the dead peer again).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from xspec.parallel.topology import Topology, launch

PEER_FAILURE_EXIT = 3
T = TypeVar("T")


class PeerFailure(RuntimeError):
    """A collective failed or timed out: another rank died, hangs or raised."""


@dataclass(frozen=True)
class Parallel:
    """One process's distributed context (``world == 1``: nothing is distributed)."""

    topology: Topology
    timeout_s: float
    ep_group: Any = None  # the ProcessGroup of this rank's EP group (ep > 1)
    exchange: str = "all_to_all"  # how EP MoE layers move rows (parallel.moe_exchange)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # small buffers

    @property
    def distributed(self) -> bool:
        return self.topology.world > 1

    def collective(self, what: str, fn: Callable[[], T]) -> T:
        return collective(self.topology.rank, self.topology.world, self.timeout_s, what, fn)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything, e.g. None)."""
        box = [obj]
        self.collective("broadcast", lambda: dist.broadcast_object_list(box, src=0))
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order); None elsewhere."""
        out: list[Any] | None = [None] * self.topology.world if self.topology.is_main else None
        self.collective("gather", lambda: dist.gather_object(obj, out, dst=0))
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (same length everywhere), in rank order."""
        mine = torch.tensor(values, dtype=torch.long, device=self.device)
        out = mine.new_empty(self.topology.world * len(values))
        self.collective("all_gather", lambda: all_gather_tensor(out, mine))
        return out.view(self.topology.world, len(values)).tolist()


def all_gather_tensor(out: torch.Tensor, inp: torch.Tensor, group: Any = None) -> None:
    """``out`` = every rank's ``inp`` concatenated along dim 0 (torch >= 2.13 names it
    ``all_gather_single``; earlier releases ``all_gather_into_tensor``)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


SINGLE = Parallel(Topology(world=1, rank=0, dp=1, ep=1), timeout_s=0.0)


def collective(rank: int, world: int, timeout_s: float, what: str, fn: Callable[[], T]) -> T:
    """Run one collective; a backend failure becomes :class:`PeerFailure`."""
    try:
        return fn()
    except PeerFailure:
        raise
    except (RuntimeError, ConnectionError) as e:  # DistBackendError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PeerFailure(
            f"rank {rank} of {world}: {what} failed, most likely another rank died, hangs or "
            "raised "
            f"(collectives wait at most parallel.timeout_s={timeout_s:g}s; see the other "
            f"ranks' logs). Backend: {first[:300]}"
        ) from e


def init_parallel(cfg: Any, platform: Any) -> Parallel:
    """The distributed context for the ``parallel`` config section (``SINGLE`` without
    torchrun). Joins the process group on first use; later calls reuse it."""
    env = launch()
    if env.world == 1:
        return SINGLE
    topology = Topology(world=env.world, rank=env.rank, dp=cfg.dp, ep=cfg.ep)
    backend = platform.distributed_backend() if cfg.backend == "auto" else cfg.backend
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        collective(
            env.rank,
            env.world,
            cfg.timeout_s,
            "joining the process group",
            lambda: dist.init_process_group(backend, timeout=timeout),
        )
    exchange = cfg.moe_exchange.value
    if exchange == "auto":
        exchange = "all_to_all" if platform.capabilities.all_to_all else "all_gather"
    ep_group = None
    if cfg.ep > 1:
        # every rank creates every group, in the same order (torch.distributed's rule)
        for ranks in topology.ep_group_ranks():
            group = dist.new_group(ranks, timeout=timeout)
            if env.rank in ranks:
                ep_group = group
    return Parallel(topology, cfg.timeout_s, ep_group, exchange, platform.device())


def shutdown() -> None:
    """Leave the process group (end of a successful run)."""
    if dist.is_initialized():
        dist.destroy_process_group()
