"""Lockstep: every rank runs the same MoE forwards every engine iteration.

An expert-parallel MoE layer is a collective: all ranks of its EP group must call the
same layer the same number of times, in the same order, whatever their batches. Ranks
differ: one prefills while another decodes, one has no requests left (a finished DP
replica keeps participating until every rank is done), speculative steps propose
different numbers of drafts. One small ``all_gather`` per iteration (:meth:`Lockstep.sync`:
``[prefill forwards, draft tokens, busy]`` of every rank) fixes the iteration's shape for
everyone; then the iteration runs two phases in this order, each rank doing its real work
and topping up with **idle forwards** (every MoE layer of a model entered with zero rows,
serving the rows others route to it; no attention runs):

==============  =====================================================================
phase           MoE forwards on every rank
==============  =====================================================================
prefill         ``P`` target forwards (P = the most prompt chunks of any rank), then the
                drafter's observe forwards (MTP: 1; DSpark: 0: its context K/V is MoE-free)
decode          the drafter's propose forwards for ``g`` drafts (MTP: g - 1 chained
                steps; DSpark: 1 block forward; none at g = 0), 1 target verify forward,
                the drafter's observe forwards
==============  =====================================================================

``g`` is the most drafts any rank's step needs; every decoding rank proposes ``g`` and
verifies only its own requests' share (``decode_step`` keeps its per-request widths, so
greedy outputs equal a single process's). The loop ends when no rank is busy.

A drafter takes part through three members that :class:`~xspec.spec.drafter.Drafter`
declares (defaults: no MoE forwards): ``moe_module`` (the module whose MoE layers its
forwards run), ``observe_forwards`` and ``propose_forwards(num_tokens)``. A MoE layer takes part by having ``expert_parallel``
set and an ``idle()`` method (:class:`xspec.models.deepseek_v4.moe.MoE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from xspec.parallel.runtime import Parallel

if TYPE_CHECKING:
    from xspec.spec.drafter import Drafter


@dataclass(frozen=True)
class StepPlan:
    """The shape of one engine iteration, the same on every rank."""

    prefill_forwards: int  # target forwards of the prefill phase (0: no rank prefills)
    draft_tokens: int  # drafts each decoding rank proposes (-1: no rank decodes)
    done: bool  # no rank has work left: the loop ends


def moe_layers(module: nn.Module | None) -> list[Any]:
    """The expert-parallel MoE layers of ``module`` in forward order (registration order)."""
    if module is None:
        return []
    return [
        m
        for m in module.modules()
        if getattr(m, "expert_parallel", None) is not None and hasattr(m, "idle")
    ]


class Lockstep:
    """One rank's side of the per-iteration agreement (see the module docstring)."""

    def __init__(self, parallel: Parallel, target: nn.Module, drafter: Drafter) -> None:
        self.parallel = parallel
        self.drafter = drafter
        self.target_layers = moe_layers(target)
        self.draft_layers = moe_layers(drafter.moe_module)
        self.plan = StepPlan(0, -1, False)

    def sync(self, *, prefill_forwards: int, draft_tokens: int, busy: bool) -> StepPlan:
        """This rank's needs in, the iteration's plan out (one small all_gather)."""
        rows = self.parallel.all_gather_ints([prefill_forwards, draft_tokens, int(busy)])
        self.plan = StepPlan(
            prefill_forwards=max(r[0] for r in rows),
            draft_tokens=max(r[1] for r in rows),
            done=not any(r[2] for r in rows),
        )
        return self.plan

    def idle_target(self, forwards: int) -> None:
        for _ in range(forwards):
            for layer in self.target_layers:
                layer.idle()

    def idle_draft(self, forwards: int) -> None:
        for _ in range(forwards):
            for layer in self.draft_layers:
                layer.idle()

    def _observe_forwards(self) -> int:
        return self.drafter.observe_forwards if self.draft_layers else 0

    def idle_prefill(self) -> None:
        """The prefill phase on a rank that prefills nothing this iteration."""
        if self.plan.prefill_forwards > 0:
            self.idle_target(self.plan.prefill_forwards)
            self.idle_draft(self._observe_forwards())

    def idle_decode(self) -> None:
        """The decode phase on a rank that decodes nothing this iteration."""
        g = self.plan.draft_tokens
        if g < 0:
            return
        if g > 0 and self.draft_layers:
            self.idle_draft(self.drafter.propose_forwards(g))
        self.idle_target(1)
        self.idle_draft(self._observe_forwards())
