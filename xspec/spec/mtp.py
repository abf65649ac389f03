"""``spec=mtp``: DeepSeek-V4 multi-token prediction as the drafter.

The MTP layer (:mod:`xspec.models.deepseek_v4.mtp`) runs over the committed context
shifted by one: MTP row ``i`` pairs the target's pre-``hc_head`` hidden ``H_i`` with
``tok_{i+1}`` and predicts ``tok_{i+2}``, so the MTP's own SWA cache always holds as many
positions as the target's. With the anchor ``a`` at position ``p`` (committed, not yet
seen by the target):

* ``observe`` appends one MTP row per newly committed target row (``H_i``, next token)
  and keeps, per sequence, the logits and hidden of its last row (position ``p - 1``,
  which pairs ``H_{p-1}`` with the anchor): those logits give ``d_1``, the token at ``p + 1``.
* ``propose`` samples ``d_1`` from the kept logits; for ``k = 2..num_tokens`` (at most
  gamma) it runs the MTP
  at position ``p + k - 2`` on (its own previous hidden, ``d_{k-1}``), standing in for the
  target's ``H`` it does not have yet, and samples ``d_k``. Then it truncates its cache
  back to ``p``: exact, the rows are re-scored by ``observe`` once the target has
  verified them. ``gamma = 1`` (the trained setting) runs no MTP forward at all here.

Drafts go through the request's own :func:`~xspec.sampling.logits_to_probs` and
generator, so the full q the rejection sampler needs is exactly what was sampled from.
Under a grammar (``DraftRequest.guide``, ``spec.mask_drafts``) each position's logits are
first masked to what the grammar allows after the drafts before it (one token where it
forces one), and the next MTP step runs on that draft
(:mod:`xspec.spec.constrained`). Before that mask, the request's penalties, ``logit_bias``
and ``min_tokens`` process each position with the drafts before it counted
(:class:`~xspec.spec.processors.DraftProcessors`), as its verify row will be.
The MTP consumes ``CommittedRows.hidden``, not aux captures: ``capture_layer_ids`` is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from xspec.errors import ConfigError
from xspec.models.base import Footprint, KvBytes, StepOptions, TargetModel
from xspec.models.family import ModelFamily
from xspec.registry import families_where, family_named
from xspec.sampling import logits_to_probs, sample
from xspec.spec.constrained import advance, guided_logits
from xspec.spec.drafter import CommittedRows, DraftDepth, Drafter, DraftProposal, DraftRequest
from xspec.spec.processors import DraftProcessors

if TYPE_CHECKING:
    from xspec.models.deepseek_v4.mtp import MtpBlock

TRAINED_GAMMA = 1  # DeepSeek-V4 ships one MTP layer, trained to draft one token
MAX_GAMMA = 16  # chained drafts beyond this are noise; also bounds the MTP's rollback ring


@dataclass
class MtpState:
    """One sequence's MTP state: its SWA cache and what its last committed row predicted."""

    cache: Any  # LayerCache of the MTP block; cache.num_tokens == the target's
    logits: torch.Tensor | None = None  # [V] fp32: last row's logits (d_1 comes from here)
    hidden: torch.Tensor | None = None  # [hc, d]: last row's MTP hidden (chains gamma > 1)

    @property
    def num_tokens(self) -> int:
        return int(self.cache.num_tokens)

    def nbytes_allocated(self) -> int:
        return int(self.cache.nbytes_allocated())


@dataclass(frozen=True, eq=False)
class MtpSnapshot:
    """A prefix-cache snapshot of an :class:`MtpState`: its cache's (the SWA ring: fixed
    size) and copies of the last row's logits and hidden state."""

    cache: Any  # the MTP block's LayerSnapshot
    logits: torch.Tensor | None  # [V]
    hidden: torch.Tensor | None  # [hc, d]

    def nbytes(self) -> int:
        own = [t for t in (self.logits, self.hidden) if t is not None]
        return int(self.cache.nbytes()) + sum(t.numel() * t.element_size() for t in own)


class MtpDrafter(Drafter):
    """Drafts with the target checkpoint's MTP layer (or an exported one, spec.draft_path)."""

    def __init__(
        self,
        cfg: Any,
        *,
        target: TargetModel,
        model_cfg: Any,
        platform: Any,
        steps: StepOptions,
    ) -> None:
        family = _mtp_family(model_cfg.arch)
        # resolved by build; drafts 2..gamma chain the MTP's own hidden state
        self.gamma: int = int(cfg.num_speculative_tokens)
        self.capture_layer_ids: list[int] = []
        self.mask_drafts = bool(cfg.mask_drafts)
        self.target = target
        # built with the target's steps (``steps``: build shares one StepOptions)
        self.module: MtpBlock = family.load_mtp(cfg, target=target, model_cfg=model_cfg)

    # -- expert parallelism: MoE forwards per call (xspec/parallel/lockstep.py) ----------

    masks_inside = True  # each position's logits masked by the request's grammar
    supports_expert_parallel = True
    observe_forwards = 1  # observe runs the MTP block once

    @staticmethod
    def propose_forwards(num_tokens: int) -> int:
        """MTP block forwards of ``propose(..., num_tokens)``: d_1 comes from observe."""
        return num_tokens - 1

    @property
    def moe_module(self) -> MtpBlock:
        return self.module

    # -- preflight (before any weights exist) ------------------------------------------

    @classmethod
    def draft_depth(cls, spec_cfg: Any, model_cfg: Any) -> DraftDepth:
        """The trained depth by default, at most :data:`MAX_GAMMA` (chained drafts)."""
        return DraftDepth(default=TRAINED_GAMMA, maximum=MAX_GAMMA, trained=TRAINED_GAMMA)

    @classmethod
    def preflight(cls, spec_cfg: Any, model_cfg: Any) -> list[str]:
        """Every problem of ``spec=mtp`` for this model, from configs and headers only."""
        try:
            family = _mtp_family(model_cfg.arch)
        except ConfigError as e:
            return [str(e)]
        return family.preflight_mtp(spec_cfg, model_cfg)

    @classmethod
    def footprint(cls, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint | None:
        try:
            family = _mtp_family(model_cfg.arch)
        except ConfigError:
            return None  # preflight reports it
        return family.footprint_mtp(spec_cfg, model_cfg, gamma=gamma)

    # -- Drafter protocol ---------------------------------------------------------------

    def new_state(self, max_tokens: int | None = None) -> MtpState:
        # propose appends gamma - 1 speculative rows and rolls them back
        limit = min(self.target.max_context, max_tokens or self.target.max_context)
        cache = self.module.new_cache(max_rollback=self.gamma - 1, max_context=limit)
        return MtpState(cache)

    def kv_bytes(self) -> KvBytes:
        """The MTP block's layer cache: its SWA ring (+ compressed entries if its ratio has any)."""
        from xspec.models.deepseek_v4.state import layer_kv_bytes

        m = self.module
        fixed, per_token = layer_kv_bytes(m.args, m.compress_ratio, m.attn.dtype, self.gamma - 1)
        return KvBytes(fixed, per_token)

    @torch.no_grad()
    def snapshot(self, state: MtpState, start: int) -> MtpSnapshot:
        own = [None if t is None else t.clone() for t in (state.logits, state.hidden)]
        return MtpSnapshot(state.cache.snapshot(start), *own)

    def restore(self, state: MtpState, chain: Sequence[MtpSnapshot]) -> MtpState:
        state.cache.restore([s.cache for s in chain])
        if chain:
            last = chain[-1]
            state.logits = None if last.logits is None else last.logits.clone()
            state.hidden = None if last.hidden is None else last.hidden.clone()
        return state

    def observe(self, states: list[MtpState], rows: CommittedRows) -> None:
        """One MTP row per committed target row: (its hidden, the next token)."""
        seq_lens = rows.seq_lens
        device = self.target.device  # where the MTP weights and every committed row live
        hidden = rows.hidden.to(device)  # [T, hc, d]
        tokens = rows.next_ids.to(device)  # [T]
        x = self._run(states, hidden, tokens, seq_lens)  # [T, hc, d]
        last = torch.tensor(seq_lens, device=device).cumsum(0) - 1  # [B] last row of each
        x_last = x[last]  # [B, hc, d], a copy: the per-state views keep no [T, ...] alive
        logits = self.module.draft_logits(x_last)  # [B, V]: only what propose needs
        for b, (state, n) in enumerate(zip(states, seq_lens)):
            if n:
                state.logits, state.hidden = logits[b], x_last[b]

    @torch.no_grad()
    def propose(
        self, states: list[MtpState], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        if any(s.logits is None or s.hidden is None for s in states):
            raise RuntimeError(
                "MtpDrafter.propose before observe: every sequence needs its prompt observed"
            )
        params = [r.params for r in requests]
        generators = [r.generator for r in requests]
        guides = [r.guide for r in requests]  # structured output: xspec.spec.constrained
        procs = DraftProcessors.of([r.processors for r in requests])  # penalties and biases
        start = [s.num_tokens for s in states]  # the anchors' positions
        logits = torch.stack([s.logits for s in states])  # type: ignore[misc]  # [B, V]
        hidden = torch.stack([s.hidden for s in states])  # type: ignore[misc]  # [B, hc, d]
        tokens: list[torch.Tensor] = []  # [B] each
        probs: list[torch.Tensor] = []  # [B, V] each
        for k in range(num_tokens):  # num_tokens <= self.gamma: the caches' rollback room
            if k:  # d_{k+1} from (own hidden, d_k) at the next position
                hidden = self._run(states, hidden, tokens[-1], [1] * len(states), own=True)
                logits = self.module.draft_logits(hidden)
            raw = logits if procs is None else procs.logits(logits)  # as the verify rows
            q = logits_to_probs(guided_logits(guides, raw), params)  # [B, V]
            tokens.append(sample(q, generators, check_greedy=False))  # [B], no device read
            probs.append(q)
            advance(guides, tokens[-1])  # the grammar's next mask (with a guide: a host read)
            if procs is not None:
                procs.push(tokens[-1])  # counted by the next position's penalties
        for state, n in zip(states, start):
            state.cache.truncate(n)  # drop the speculative rows (exact)
        greedy = all(p.greedy for p in params)
        return DraftProposal(
            tokens=torch.stack(tokens, dim=1),  # [B, num_tokens] on the target's device
            probs=None if greedy else torch.stack(probs, dim=1),  # [B, num_tokens, V]
        )

    def _run(
        self,
        states: list[MtpState],
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        seq_lens: list[int],
        *,
        own: bool = False,
    ) -> torch.Tensor:
        """Append MTP rows (ragged, ``seq_lens`` per sequence) to each state's cache.

        ``hidden [T, hc, d]`` (the target's, or with ``own`` the MTP's), ``tokens [T]``
        -> the MTP's own hidden ``[T, hc, d]``.
        """
        from xspec.models.deepseek_v4.state import BlockContext

        starts = [s.num_tokens for s in states]
        positions = torch.cat(
            [torch.arange(p, p + n, dtype=torch.long) for p, n in zip(starts, seq_lens)]
        ).to(tokens.device)
        ctx = BlockContext(tokens, positions, seq_lens, starts, [s.cache for s in states])
        return self.module.draft_hidden(hidden, tokens, ctx, own=own)


def _mtp_family(arch: str) -> ModelFamily:
    """The target's family; ConfigError when it has no MTP layer."""
    family = family_named(arch)
    if family is not None and family.offers_mtp:
        return family
    offering = families_where(lambda f: f.offers_mtp)
    names = " or ".join(f.display_name for f in offering) or "an MTP-carrying"
    archs = ", ".join(f.arch for f in offering)
    raise ConfigError(
        f"spec=mtp needs a {names} target (model.arch={archs}), not model.arch={arch}: only "
        f"{names} checkpoints carry an MTP layer"
    )
