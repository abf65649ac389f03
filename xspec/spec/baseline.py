"""``spec=none``: no drafter; every step scores one row per sequence."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xspec.models.base import Footprint, KvBytes, StepOptions
from xspec.spec.drafter import CommittedRows, DraftDepth, Drafter, DraftProposal, DraftRequest


class NoDrafter(Drafter):
    """The baseline: gamma = 0, so the speculative step reduces to plain decoding."""

    def __init__(
        self, cfg: Any, *, target: Any, model_cfg: Any, platform: Any, steps: StepOptions
    ) -> None:
        self.gamma = 0
        self.capture_layer_ids: list[int] = []

    @classmethod
    def draft_depth(cls, spec_cfg: Any, model_cfg: Any) -> DraftDepth:
        return DraftDepth(default=0, maximum=0)  # it never drafts

    @classmethod
    def footprint(cls, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint:
        return Footprint()  # no weights, no state

    # expert parallelism (xspec/parallel/lockstep.py): no draft model, no MoE forwards
    # (the Drafter defaults: moe_module None, no observe / propose forwards)
    supports_expert_parallel = True

    def new_state(self, max_tokens: int | None = None) -> None:
        return None

    def kv_bytes(self) -> KvBytes:
        return KvBytes()

    def snapshot(self, state: Any, start: int) -> None:
        return None

    def restore(self, state: Any, chain: Sequence[Any]) -> None:
        return None

    def observe(self, states: list[Any], rows: CommittedRows) -> None:
        pass

    def propose(
        self, states: list[Any], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        # Never called by the step (gamma 0 skips drafting); kept for the protocol.
        return DraftProposal(tokens=torch.empty(len(requests), 0, dtype=torch.long))
