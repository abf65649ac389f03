"""What a speculative method (drafter) provides to the speculative step.

A drafter keeps its own per-sequence state. The step talks to it twice per decode step:

* ``propose(states, requests, num_tokens)``: ``num_tokens`` draft tokens per sequence
  (``1 <= num_tokens <= self.gamma``: the step asks for fewer when no request in the
  batch can use ``gamma``, see ``DraftRequest.max_drafts``), and their full draft
  distributions q when the drafts were sampled, starting after the anchor (the last
  committed token, not yet seen by the target). Tokens and q live on the target's
  device (``TargetModel.device``). Any speculative rows it appends to its own state
  while drafting it must roll back itself before returning.
* ``observe``: the context committed since the last call. For every target row that
  was kept (the prompt after prefill; anchor + accepted drafts after a verify step) it
  gets the row's input token, the *next* token (the one at position + 1, the last of
  which is the new anchor), and the target's hidden rows (pre-head hidden, and the aux
  hidden captured at ``capture_layer_ids`` when the drafter asked for any).

Memory: ``kv_bytes()`` gives the analytic per-sequence bytes of ``new_state`` (fixed +
per token; the engine's planner adds them to the target's) and ``new_state(max_tokens)``
caps a state's growing buffers at the engine's reservation, so the bytes a state
allocates (``nbytes_allocated()``) never exceed what was planned for it.

Optional class-level hooks, read by :mod:`xspec.build` before anything is loaded:
``preflight(spec_cfg, model_cfg) -> list[str]`` (checkpoint problems from headers) and
``default_gamma(spec_cfg, model_cfg) -> int`` (the gamma the drafter will use when
``spec.num_speculative_tokens`` is null), checked against the platform's limits.

Expert parallelism (``parallel.ep > 1``) needs three more members, so that ranks without
work run the same MoE forwards (:mod:`xspec.parallel.lockstep`): ``moe_module`` (the
draft model, or None), ``observe_forwards`` (its forwards per ``observe``) and
``propose_forwards(num_tokens)``; a drafter without them is refused under ``ep > 1``.

Checkpoint layer ids in ``capture_layer_ids`` are raw: the platform maps them to capture
points; drafters never add +1 themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from xspec.models.base import KvBytes
from xspec.sampling import SamplingParams


@dataclass
class DraftProposal:
    """``num_tokens`` drafts per sequence, on the target's device."""

    tokens: torch.Tensor  # [B, num_tokens] int64
    probs: torch.Tensor | None = (
        None  # [B, num_tokens, V] float32 full q; None = deterministic drafts (one-hot q)
    )
    # [B, gamma] float32: the draft's own estimate of P(draft k accepted | drafts < k
    # accepted) (a confidence head); None when the method has none
    confidence: torch.Tensor | None = None


@dataclass
class CommittedRows:
    """One sequence's newly committed target rows (positions start .. start+k-1)."""

    input_ids: torch.Tensor  # [k] tokens the target consumed at these positions
    next_ids: torch.Tensor  # [k] token at position + 1 (next_ids[-1] is the new anchor)
    hidden: torch.Tensor  # [k, ...] target pre-head hidden (DSv4: [k, hc, d])
    aux_hidden: torch.Tensor | None  # [k, K*d] at the drafter's capture layers, in order


@dataclass
class DraftRequest:
    """What ``propose`` needs to know about one running sequence."""

    anchor: int  # last committed token; the target has not seen it yet
    params: SamplingParams
    generator: torch.Generator | None  # the request's own generator (None: greedy)
    # Drafts this request can still use (its remaining token budget - 1): the step
    # verifies at most this many, so a drafter may stop early for it; informational.
    max_drafts: int


@runtime_checkable
class Drafter(Protocol):
    gamma: int  # draft tokens per step; 0 = no speculation
    capture_layer_ids: list[int]  # raw checkpoint layer ids of the aux hidden it consumes

    def new_state(self, max_tokens: int | None = None) -> Any:
        """A sequence's empty draft state (``None`` when the method keeps none);
        ``max_tokens`` caps its growing buffers like ``TargetModel.new_state``. A state
        that is not None exposes ``nbytes_allocated()``."""
        ...

    def kv_bytes(self) -> KvBytes:
        """Analytic per-sequence bytes of :meth:`new_state` (``KvBytes()`` for none)."""
        ...

    def observe(self, states: list[Any], rows: list[CommittedRows]) -> None: ...

    def propose(
        self, states: list[Any], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal: ...
