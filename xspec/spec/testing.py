"""Drafters that test the speculative machinery (``spec=oracle``, ``spec=wrong``).

Both run the target model itself on a private decoding state: the oracle proposes the
target's own greedy continuation (acceptance 1.0 under greedy decoding), the wrong
drafter proposes a token one id off the target's greedy choice at every position
(acceptance 0). Either way the committed output must equal the baseline's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xspec.models.base import DecodeState, ForwardBatch, KvBytes, StepOptions, TargetModel
from xspec.spec.drafter import CommittedRows, DraftDepth, Drafter, DraftProposal, DraftRequest


class OracleDrafter(Drafter):
    offset = 0  # added to the target's greedy token (mod vocab)

    def __init__(
        self,
        cfg: Any,
        *,
        target: TargetModel,
        model_cfg: Any,
        platform: Any,
        steps: StepOptions,
    ) -> None:
        # the drafts run on ``target`` itself, whose steps its family configured
        self.target = target
        self.gamma = int(cfg.num_speculative_tokens)  # resolved by build
        self.capture_layer_ids: list[int] = []
        # structured output: the step masks these drafts afterwards (spec.mask_drafts)
        self.mask_drafts = bool(cfg.mask_drafts)

    @classmethod
    def draft_depth(cls, spec_cfg: Any, model_cfg: Any) -> DraftDepth:
        return DraftDepth(default=3)

    def new_state(self, max_tokens: int | None = None) -> DecodeState:
        return self.target.new_state(max_tokens)

    def kv_bytes(self) -> KvBytes:
        return self.target.kv_bytes()  # a private target state per sequence

    def snapshot(self, state: Any, start: int) -> Any:
        return self.target.snapshot(state, start)  # its private target state

    def restore(self, state: Any, chain: Sequence[Any]) -> Any:
        self.target.restore(state, chain)
        return state

    def observe(self, states: list[Any], rows: CommittedRows) -> None:
        # Mirror the committed context into the private state.
        self.target.forward(ForwardBatch(rows.input_ids, rows.seq_lens, states))

    @torch.no_grad()
    def propose(
        self, states: list[Any], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        start = [s.num_tokens for s in states]
        device = self.target.device
        tok = torch.tensor([r.anchor for r in requests], dtype=torch.long, device=device)  # [B]
        drafts = []
        for _ in range(num_tokens):
            logits = self.target.forward(
                ForwardBatch(tok, [1] * len(states), states)
            ).logits  # [B, V]
            greedy = logits.argmax(-1)
            drafts.append((greedy + self.offset) % logits.shape[-1])
            tok = greedy  # follow the target's own continuation
        for s, n in zip(states, start):
            self.target.truncate(s, n)
        return DraftProposal(tokens=torch.stack(drafts, 1))  # [B, num_tokens] on the device


class WrongDrafter(OracleDrafter):
    offset = 1
