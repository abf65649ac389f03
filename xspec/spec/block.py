"""Block drafters: one draft forward proposes a whole block (``spec=dspark``, ``spec=dflash``).

The drafter is conditioned on target hidden states captured at the checkpoint's target
layers. With the anchor ``a`` (last committed token) at position ``p``:

* ``observe``: every newly committed position gets its context K/V in the draft's caches,
  projected from the target's captured hidden of that row (``aux [k, K*d]``). Nothing
  speculative is ever written there, so the draft has nothing to roll back.
* ``propose``: one forward over the block at positions ``p .. p+W-1``, non-causal inside
  the block, each row seeing the committed context (the model decides which part: a
  sliding window for DeepSeek-V4, all of it for Qwen3) and every block row.

  ==========  ======================================  ===========================
  layout      block rows (width W)                    row i predicts position
  ==========  ======================================  ===========================
  dspark      ``[a, noise x (gamma-1)]`` (W = gamma)  ``p+i+1``, rows 0..gamma-1
  dflash      ``[a, mask x gamma]`` (W = gamma+1)     ``p+i``, rows 1..gamma
  ==========  ======================================  ===========================

  DSpark samples left to right from the anchor with a Markov bias on the raw logits,
  ``logits_k = base_k + W2 @ W1[prev_k]`` (``prev_0 = a``, then the sampled draft), and
  then the request's own temperature / top-k / top-p, so the full q the rejection
  sampler needs is exactly what each draft was drawn from. DFlash samples each row on
  its own. Under a grammar (``DraftRequest.guide``) each position's logits are masked to
  what the grammar allows after the drafts before it (one token where it forces one), so
  a block never holds a forbidden token and the Markov head conditions on allowed ones.
  Before that mask the request's penalties, ``logit_bias`` and ``min_tokens`` process
  each position with the drafts before it counted, as its verify row will be
  (:class:`~xspec.spec.processors.DraftProcessors`).
  The confidence head, where the checkpoint has one, scores every position
  after the loop, in one batched call; a calibration file (per-position temperatures,
  :mod:`xspec.spec.adaptive.calibration`, the fit of each request's sampling regime) divides its
  logits before the sigmoid.

The model-specific half (DeepSeek-V4 DSpark stages, Qwen3 DSpark / DFlash layers)
implements :class:`~xspec.models.block_draft.BlockDraftModel`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from xspec.models.base import KvBytes
from xspec.models.block_draft import BlockDraftModel, BlockLayout
from xspec.models.draft_heads import MarkovHead
from xspec.sampling import SamplingParams, draw_uniforms, logits_to_probs, sample
from xspec.spec.adaptive.calibration import ConfidenceCalibration
from xspec.spec.constrained import DraftGuide, advance, guided_logits
from xspec.spec.drafter import CommittedRows, Drafter, DraftProposal, DraftRequest
from xspec.spec.processors import DraftProcessors


def sample_block(
    logits: torch.Tensor,
    anchors: torch.Tensor,
    markov: MarkovHead | None,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    guides: list[DraftGuide | None] | None = None,
    processors: DraftProcessors | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw a block left to right: ``logits [B, G, V]`` raw base logits of the rows that
    predict positions ``p+1 .. p+G``, ``anchors [B]``.

    Returns ``tokens [B, G]``, ``probs [B, G, V]`` (the processed q each token was drawn
    from) and ``prev [B, G]`` (the token before each position: the anchor, then drafts).
    With ``markov`` each position's raw logits get ``bias(prev)`` before processing; with
    ``processors`` they then get each request's penalties and biases with the drafts
    before the position counted (:mod:`xspec.spec.processors`); with ``guides``
    (structured output) they are then masked by each request's grammar at the path so
    far, and each draft is pushed (:mod:`xspec.spec.constrained`).
    """
    positions = logits.shape[1]
    guides = guides or [None] * len(params)
    if all(g is None for g in generators) and all(p.greedy and p.valid for p in params):
        return _greedy_block(logits, anchors, markov, guides, processors)
    # every position's uniform at once, position k in column k: what drawing them one
    # position at a time takes from each request's own generator, in one call a request
    counts = [0 if g is None else positions for g in generators]
    u = draw_uniforms(generators, counts, logits.device)  # [B, G] (or [B, 0]: all greedy)
    prev, tokens, probs, prevs = anchors, [], [], []
    for k in range(positions):
        raw = logits[:, k] if markov is None else logits[:, k] + markov.bias(prev)  # [B, V]
        raw = raw if processors is None else processors.logits(raw)  # penalties, biases
        raw = guided_logits(guides, raw)  # the grammar's allowed set at the path so far
        q = logits_to_probs(raw, params)  # [B, V]: the request's temperature/top-k/top-p
        prevs.append(prev)
        prev = sample(q, generators, check_greedy=False, uniforms=u[:, k] if u.shape[1] else None)
        advance(guides, prev)
        if processors is not None:
            processors.push(prev)
        tokens.append(prev)
        probs.append(q)
    return torch.stack(tokens, 1), torch.stack(probs, 1), torch.stack(prevs, 1)


def _greedy_block(
    logits: torch.Tensor,
    anchors: torch.Tensor,
    markov: MarkovHead | None,
    guides: list[DraftGuide | None],
    processors: DraftProcessors | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`sample_block` when every request is greedy: each draft is the argmax of its
    biased logits (ties to the lowest index, as ``logits_to_probs``), q the one-hot
    there, made once for the block (at 32 requests a step's five one-hot q and their
    argmax took 0.6 ms)."""
    prev, tokens, prevs = anchors, [], []
    for k in range(logits.shape[1]):
        raw = logits[:, k] if markov is None else logits[:, k] + markov.bias(prev)  # [B, V]
        raw = raw if processors is None else processors.logits(raw)
        raw = guided_logits(guides, raw)
        prevs.append(prev)
        prev = raw.float().argmax(dim=-1)  # [B]
        advance(guides, prev)
        if processors is not None:
            processors.push(prev)
        tokens.append(prev)
    drafts = torch.stack(tokens, 1)  # [B, G]
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return drafts, probs.scatter_(2, drafts[..., None], 1.0), torch.stack(prevs, 1)


class BlockDrafter(Drafter):
    """The Drafter protocol on top of a :class:`BlockDraftModel`."""

    def __init__(
        self,
        model: BlockDraftModel,
        *,
        layout: BlockLayout,
        gamma: int,
        capture_layer_ids: list[int],
        device: torch.device,
        calibration: ConfidenceCalibration | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.gamma = gamma
        self.capture_layer_ids = list(capture_layer_ids)
        self.device = device
        self.calibration = calibration
        # [gamma] fp32 per sampling regime: c_k = sigmoid(z_k / T_k) (calibration None: raw)
        self._temperatures: dict[tuple[bool, float, int, float], torch.Tensor] = {}

    def temperatures(self, params: list[SamplingParams]) -> torch.Tensor | None:
        """``[B, gamma]`` the calibration temperatures of each request's sampling regime
        (the fit of its regime, else the nearest: RegimeCheck warns), or None (raw)."""
        if self.calibration is None:
            return None
        rows = []
        for p in params:
            key = (p.greedy, 0.0 if p.greedy else p.temperature, p.top_k, p.top_p)
            if key not in self._temperatures:
                fit = self.calibration.select(p)[0]
                self._temperatures[key] = torch.tensor(
                    fit.temperatures, dtype=torch.float32, device=self.device
                )
            rows.append(self._temperatures[key])
        return torch.stack(rows)

    @property
    def has_confidence(self) -> bool:
        """Whether proposals carry confidences (the checkpoint has a confidence head)."""
        return self.model.confidence is not None

    # expert parallelism (xspec/parallel/lockstep.py): observe only writes context K/V
    # (no MoE); propose runs one block forward
    masks_inside = True  # sample_block masks each position with the request's grammar
    supports_expert_parallel = True
    observe_forwards = 0

    @staticmethod
    def propose_forwards(num_tokens: int) -> int:
        return 1

    @property
    def moe_module(self) -> Any:
        return self.model

    def new_state(self, max_tokens: int | None = None) -> Any:
        return self.model.new_cache(self.gamma, max_tokens)

    def kv_bytes(self) -> KvBytes:
        return self.model.kv_bytes(self.gamma)

    def snapshot(self, state: Any, start: int) -> Any:
        return self.model.snapshot(state, start)

    def restore(self, state: Any, chain: Sequence[Any]) -> Any:
        self.model.restore(state, chain)
        return state

    @torch.no_grad()
    def observe(self, states: list[Any], rows: CommittedRows) -> None:
        if rows.aux_hidden is None:
            raise RuntimeError(
                "a block drafter needs the target's captured hidden states: the step "
                "did not pass capture points for capture_layer_ids"
            )
        self.model.write_context(states, rows.aux_hidden.to(self.device), rows.seq_lens)

    @torch.no_grad()
    def propose(
        self, states: list[Any], requests: list[DraftRequest], num_tokens: int
    ) -> DraftProposal:
        """``num_tokens`` drafts per sequence. The block always has the configured width
        (the trained geometry); only its first ``num_tokens`` positions are sampled."""
        first = self.layout.first_row
        anchors = torch.tensor([r.anchor for r in requests], dtype=torch.long, device=self.device)
        tokens = torch.full(
            (len(requests), self.layout.width(self.gamma)),
            self.model.fill_token_id,
            device=self.device,
        )
        tokens[:, 0] = anchors  # [B, W]: [anchor, fill ...]
        hidden, logits = self.model.forward_block(states, tokens)  # [B, W, d], [B, W, V]
        rows = slice(first, first + num_tokens)
        hidden, logits = hidden[:, rows], logits[:, rows]  # [B, num_tokens, ...]
        params = [r.params for r in requests]
        markov = self.model.markov if self.layout is BlockLayout.DSPARK else None
        generators, guides = [r.generator for r in requests], [r.guide for r in requests]
        procs = DraftProcessors.of([r.processors for r in requests])
        drafts, probs, prev = sample_block(
            logits, anchors, markov, params, generators, guides, procs
        )
        confidence = None
        if self.model.confidence is not None:
            embed = self.model.markov.embed(prev) if self.model.confidence.with_markov else None  # type: ignore[union-attr]
            z = self.model.confidence.logits(hidden, embed)  # [B, num_tokens] raw logits
            temps = self.temperatures(params)  # [B, gamma] of each request's regime
            if temps is not None:  # Sequential Temperature Scaling, per position
                z = z / temps[:, : z.shape[1]]
            confidence = torch.sigmoid(z)  # [B, num_tokens]
        greedy = all(p.greedy for p in params)
        return DraftProposal(tokens=drafts, probs=None if greedy else probs, confidence=confidence)
