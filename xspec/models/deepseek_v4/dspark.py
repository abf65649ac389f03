"""The DeepSeek-V4 DSpark drafter (Flash-0731 layout): S block-diffusion stages.

Checkpoint contract (stored next to the target's tensors, or in ``spec.draft_path``):

* config.json: ``dspark_block_size`` (trained gamma), ``dspark_markov_rank`` r,
  ``dspark_noise_token_id``, ``dspark_target_layer_ids`` (S = its length = the number of
  stages), optional ``dspark_capture`` (``layer_output``, the 0731 default, or
  ``layer_input``: V4.1-style checkpoints read the input of each target layer);
  ``compress_ratios`` carries one entry per stage after the main layers (stages always
  run window-only, whatever the entry says).
* tensors ``mtp.{i}.*`` (i < S): a standard V4 block each (SWA-only attention, learned
  top-k MoE, never hash routing, mHC); ``mtp.0.main_proj.weight [d, K*d]``,
  ``mtp.0.main_norm.weight``, optional dedicated ``mtp.0.embed.weight``;
  ``mtp.{S-1}.norm.weight``, ``mtp.{S-1}.hc_head_{fn,base,scale}``, optional dedicated
  ``mtp.{S-1}.head.weight``, ``mtp.{S-1}.markov_head.markov_w{1,2}.weight [V, r]``,
  optional ``mtp.{S-1}.confidence_head.proj.weight [1, d + r]``. A dedicated vocabulary
  tensor always wins over the target's shared ``embed`` / ``head`` (QuaRot checkpoints
  ship rotated ones). W8A8 and FP8-block storage load as for the target.

The draft step (official semantics): the target's capture (mean over the hc streams of
each target layer's output, concatenated: ``aux [T, K*d]``) becomes
``main_x = main_norm(main_proj(aux))``; each stage writes ``kv_norm(wkv(main_x))``,
roped at the row's position, into its own ring of ``window`` context rows (slot
``pos % window``) for **every** committed position. One forward runs the stages over
the block ``[anchor, noise x (W-1)]`` at positions ``p .. p+W-1``; every block row sees
the same keys: the committed context window of the SAS mode plus the whole block
(non-causal), with the attention sink. Then ``hc_head`` (its output, *before* the final
norm, feeds the confidence head), ``norm``, ``head`` -> base logits.

SAS modes (index sets of the reference attention, the platform picks one):
native = context ``[p - window, p)`` + the block (``ori_win_left = window + W - 1``),
compatibility = the last ``window`` positions ending at the block end, i.e. context
``[p + W - window, p)`` + the block (``ori_win_left = window - 1``). In both, the
number of visible keys is ``ori_win_left + 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xspec.errors import CheckpointError
from xspec.models.base import KvBytes
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.attention import sparse_attention
from xspec.models.deepseek_v4.draft_plan import crossover_problems, plan_tensors
from xspec.models.deepseek_v4.layout import BatchLayout
from xspec.models.deepseek_v4.mhc import HyperHead, RMSNorm
from xspec.models.deepseek_v4.model import Block, init_random
from xspec.models.deepseek_v4.state import Ring, scatter_rows, stack_rings
from xspec.models.deepseek_v4.weights import load_drafter
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.models.loading import CONFIG_NAME, Checkpoint, require_tensors_for
from xspec.models.ops import (
    EAGER_STEPS,
    REFERENCE_OPS,
    ModelOps,
    SasIndicesRejected,
    SasMode,
    StepOptions,
    eager,
)

if TYPE_CHECKING:
    from xspec.parallel.expert import ExpertParallel

log = logging.getLogger(__name__)

PREFIX = "mtp."
CAPTURE_MODES = ("layer_output", "layer_input")
# Spellings of the dedicated vocabulary tensors under a stage prefix (grafted exports).
VOCAB_ALIASES = {
    "emb.tok_emb.weight": "embed.weight",
    "embed_tokens.weight": "embed.weight",
    "shared_head.head.weight": "head.weight",
}


# -- index sets of the draft window ------------------------------------------------------


def context_index(
    starts: torch.Tensor, ring: int, visible: int, base: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows of a ring stack ``[B * ring, D]`` holding context positions
    ``[p_b - visible, p_b)`` of each sequence: ``starts [B]`` (= ``p_b``) -> ``[B, visible]``,
    ``b * ring + pos % ring`` (the remainder wraps, never clamps), -1 before position 0.
    ``base [B]``: the first stack row of each block's sequence instead of ``b * ring``
    (training: many blocks read one sequence's whole context, ``ring`` >= its length)."""
    pos = starts[:, None] - visible + torch.arange(visible, device=starts.device)  # [B, C]
    if base is None:
        base = torch.arange(len(starts), device=starts.device) * ring
    index = base[:, None] + pos.remainder(ring)
    return index.masked_fill_(pos < 0, -1)


def block_index(batch: int, width: int, device: torch.device) -> torch.Tensor:
    """Each block row sees its whole block: ``[B * W, W]`` rows of the ``[B * W, D]`` block K/V."""
    rows = torch.arange(batch * width, device=device) // width * width  # first row of its block
    return rows[:, None] + torch.arange(width, device=device)


def visible_context(mode: SasMode, window: int, width: int) -> int:
    """Context positions a block row sees: ``ori_win_left + 1 - W`` (native: ``window``,
    compatibility: ``window - W``)."""
    return max(0, mode.ori_win_left(window, width) + 1 - width)


class DraftWindow:
    """The SAS mode and attention operator of the draft window, with the runtime fallback:
    an operator that rejects explicit (native) indices switches the draft to the
    compatibility layout once, with a logged reason (``platform.native_sas=on`` raises).
    The operator is the platform's ``draft_window_attention()``; where it has none (or
    it answers None) the reference :func:`sparse_attention` runs, with ``ops``'
    ``sparse_attention`` op."""

    def __init__(self, platform: Any, ops: ModelOps = REFERENCE_OPS) -> None:
        self.platform = platform
        self.mode: SasMode = platform.sas_mode()
        self.op = platform.draft_window_attention()
        self.ops = ops

    def _run(
        self,
        q: torch.Tensor,
        parts: list[tuple[torch.Tensor, torch.Tensor]],
        sink: torch.Tensor,
        scale: float,
        explicit: bool,
    ) -> torch.Tensor:
        if self.op is not None:
            out = self.op(q, parts, sink, scale, explicit_indices=explicit)
            if out is not None:
                return out
        return sparse_attention(q, parts, sink, scale, eager(self.ops.sparse_attention))

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        ctx: BlockRows,
        sink: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """``q [B*W, H, D]``, the block's own ``kv [B*W, D]`` -> ``[B*W, H, D]`` fp32."""
        assert ctx.ring is not None
        parts = [(ctx.ring, ctx.context(self.mode)), (kv, ctx.block)]
        try:
            return self._run(q, parts, sink, scale, self.mode is SasMode.NATIVE)
        except SasIndicesRejected as e:
            self.mode = self.platform.sas_mode(False)  # under native_sas=on: PlatformError
            log.warning(
                "DSpark draft window: the sparse attention operator rejected explicit indices "
                "(%s); falling back to the compatibility layout (window - gamma context rows)",
                e,
            )
            parts = [(ctx.ring, ctx.context(self.mode)), (kv, ctx.block)]
            return self._run(q, parts, sink, scale, False)


@dataclass
class BlockRows:
    """One draft forward: ``B`` blocks of ``W`` rows, flattened to ``[B*W]``."""

    input_ids: torch.Tensor  # [B*W]
    rot: tuple[torch.Tensor, torch.Tensor]  # RoPE cos, sin [B*W, rd]
    starts: torch.Tensor  # [B] anchor positions
    width: int
    window: int
    block: torch.Tensor  # [B*W, W] block_index
    ring: torch.Tensor | None = None  # [B*window, D] the current stage's ring stack, flattened
    # training: the stack holds whole sequences (``ring_rows`` rows each, no wrap) and
    # block b reads the one starting at row ``ring_base[b]``
    ring_rows: int | None = None
    ring_base: torch.Tensor | None = None
    _context: dict[SasMode, torch.Tensor] = field(default_factory=dict)

    def context(self, mode: SasMode) -> torch.Tensor:
        """``[B*W, C]`` ring rows of the context each block row sees under ``mode``."""
        if mode not in self._context:
            visible = visible_context(mode, self.window, self.width)
            rows = self.ring_rows or self.window
            index = context_index(self.starts, rows, visible, self.ring_base)  # [B, C]
            self._context[mode] = index.repeat_interleave(self.width, dim=0)
        return self._context[mode]


# -- modules ------------------------------------------------------------------------------


class DSparkStage(Block, HyperHead):
    """Stage ``i`` of ``S``: a window-only V4 block whose attention reads the draft window.
    Stage 0 also owns ``main_proj`` / ``main_norm`` (and maybe ``embed``); the last stage
    owns ``norm``, ``hc_head_*``, the Markov and confidence heads (and maybe ``head``)."""

    def __init__(
        self,
        args: DeepseekV4Args,
        index: int,
        *,
        num_stages: int,
        capture_width: int,
        markov_rank: int,
        confidence: bool,
        own_embed: bool,
        own_head: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        expert_parallel: ExpertParallel | None = None,
        steps: StepOptions = EAGER_STEPS,
    ) -> None:
        super().__init__(
            args,
            args.num_hidden_layers + index,
            0,
            False,
            dtype=dtype,
            device=device,
            expert_parallel=expert_parallel,
            steps=steps,
        )
        d, vocab, eps = args.hidden_size, args.vocab_size, args.rms_norm_eps
        kw: dict = dict(dtype=dtype, device=device)
        if index == 0:
            self.main_proj = nn.Linear(capture_width, d, bias=False, **kw)
            self.main_norm = RMSNorm(d, eps, device=device, ops=self.ops)
            if own_embed:
                self.embed = nn.Embedding(vocab, d, **kw)
        if index == num_stages - 1:
            self.norm = RMSNorm(d, eps, device=device, ops=self.ops)
            self.init_hyper_head(args, device)
            if own_head:
                self.head = nn.Linear(d, vocab, bias=False, **kw)
            self.markov_head = MarkovHead(vocab, markov_rank, **kw)
            if confidence:
                self.confidence_head = ConfidenceHead(d, markov_rank, bias=False, **kw)
        self.window: DraftWindow | None = None  # set by DSparkDraft

    def attend(
        self, x: torch.Tensor, ctx: Any
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Block attention: ``x [B*W, d]`` -> its result ``[B*W, H, D]`` fp32 and the
        rows' rotation; writes no cache."""
        assert self.window is not None
        attn = self.attn
        proj = self.steps.project(attn, x, ctx.rot[0], ctx.rot[1], None)
        out = self.window.attend(proj.q, proj.kv, ctx, attn.attn_sink, attn.head_dim**-0.5)
        return out, ctx.rot


PENDING_ROWS = 8  # committed rows a sequence holds in its slot of the batch's stack ...
HOLD_ROWS = 32  # ... in runs that can skip drafting (``hold_window``): see held_rows


def held_rows(hold_window: bool, window: int) -> int:
    """Rows of a sequence's ``held`` buffer (:class:`DSparkCache`). Where steps can skip
    drafting, a full buffer moves to the sequence's backlog: a copy per sequence, which
    at 32 requests stepping plain cost 0.8 ms every 8th step with 8 rows (0.1 ms per step
    on average); 32 rows make it every 32nd. Where every request drafts every step the
    buffer only fills with a prompt, and 8 rows (a step's commits) are enough. Never more
    than the ``window`` the context keeps."""
    return min(HOLD_ROWS if hold_window else PENDING_ROWS, window)


def context_bytes(
    num_stages: int, args: DeepseekV4Args, itemsize: int, hold_window: bool = True
) -> KvBytes:
    """One sequence's draft state: a ``[window, head_dim]`` context ring per stage; every
    stage is ratio 1, so nothing grows with the context (xLLM: the DSpark draft reserves
    only its SWA pool). Plus the captures it holds back (:class:`DSparkCache`):
    :func:`held_rows` rows of ``K*d``, and ``window`` more with ``hold_window`` (a
    sequence that stops drafting)."""
    ring = num_stages * args.sliding_window * args.head_dim * itemsize
    w = args.sliding_window
    rows = held_rows(hold_window, w) + (w if hold_window else 0)
    return KvBytes(ring + rows * num_stages * args.hidden_size * itemsize, 0.0)


class DSparkCache:
    """One sequence's draft context: per stage a ring ``[window, head_dim]`` of context
    K/V, position ``p`` in slot ``p % window``. ``num_tokens``: the positions before the
    captures held back (each written, or skipped because the ring would not have kept
    it). Only committed positions are written: no rollback.

    The captures ``[K*d]`` of committed rows are not turned into K/V until the sequence
    next drafts: steps that do not draft (``spec.adaptive`` deciding depth 0) cost the
    draft a row copy, and of the rows it commits meanwhile only the last ``window`` are
    ever computed (the ring keeps no more). They wait in two places, in position order:

    - ``backlog [window, K*d]``, ``backlog_rows`` of them: a ring (position ``p`` in slot
      ``p % window``) of this sequence alone, allocated when it first fills its ``held``
      rows without drafting and freed when it drafts; the rows falling out of it are the
      ones the context ring would have overwritten.
    - ``held [held_rows, K*d]``, the first ``pending_rows``: the latest rows, in this
      sequence's row of a stack of every running sequence's buffer (:class:`Ring`), so a
      step's rows go in with one scatter; when a sequence's rows do not fit, its held
      rows and the new ones move to its backlog.

    Without a backlog (``DSparkDraft.hold_window`` false: a run in which every request
    drafts every step) rows that do not fit are written at once, with the held ones."""

    def __init__(self, rings: list[Ring], held: torch.Tensor, window: int) -> None:
        self.rings = rings
        self.held_ring = Ring(held)  # a Ring, so a batch's rows go in with one scatter
        self.capacity = held.shape[0]  # rows ``held`` takes (:func:`held_rows`)
        self.window = window
        self.backlog: torch.Tensor | None = None
        self.backlog_rows = 0
        self.num_tokens = 0
        self.pending_rows = 0

    @property
    def held(self) -> torch.Tensor:
        """``[held_rows, K*d]``: the latest captures held back (the first ``pending_rows``)."""
        return self.held_ring.data

    @property
    def observed(self) -> int:
        """Committed positions seen: written or skipped, plus held back (the anchor's
        position)."""
        return self.num_tokens + self.backlog_rows + self.pending_rows

    def defer(self, rows: torch.Tensor) -> None:
        """Move the held rows and ``rows [n, K*d]`` (the next positions) to the backlog:
        of everything it then holds, the last ``window`` positions."""
        moved = self.pending_rows + rows.shape[0]
        end = self.observed + rows.shape[0]  # the positions seen after
        if rows.shape[0] >= self.window:  # (a prompt) older rows would never be read
            keep = rows[-self.window :].to(self.held.dtype)
        else:
            keep = torch.cat([self.held[: self.pending_rows], rows.to(self.held.dtype)])
            keep = keep[-self.window :]
        self.pending_rows = 0
        if self.backlog is None:
            self.backlog = keep.new_empty(self.window, keep.shape[1])
        slots = torch.arange(end - keep.shape[0], end, device=keep.device) % self.window
        self.backlog.index_copy_(0, slots, keep)
        self.backlog_rows = min(self.backlog_rows + moved, self.window)
        self.num_tokens = end - self.backlog_rows

    def take_held(self) -> torch.Tensor:
        """Every capture held back, in position order ``[rows, K*d]`` (the positions from
        ``num_tokens``); the cache then holds none (its backlog is freed)."""
        rows = self.held[: self.pending_rows]
        if self.backlog is not None and self.backlog_rows:
            first = self.num_tokens
            slots = torch.arange(first, first + self.backlog_rows, device=rows.device)
            rows = torch.cat([self.backlog[slots % self.window], rows])
        self.backlog, self.backlog_rows, self.pending_rows = None, 0, 0
        return rows

    def nbytes_allocated(self) -> int:
        tensors = [r.data for r in self.rings] + [self.held]
        if self.backlog is not None:
            tensors.append(self.backlog)
        return sum(t.numel() * t.element_size() for t in tensors)

    def snapshot(self) -> DSparkSnapshot:
        """A copy of everything it holds (all of it fixed-size: the context rings, the
        captures held back and their backlog)."""
        backlog = None if self.backlog is None else self.backlog.clone()
        return DSparkSnapshot(
            tuple(r.data.clone() for r in self.rings),
            self.held[: self.pending_rows].clone(),
            backlog,
            self.backlog_rows,
            self.num_tokens,
        )

    def restore(self, snap: DSparkSnapshot) -> None:
        """Hold what ``snap`` was taken of (an empty cache of the same draft)."""
        for ring, data in zip(self.rings, snap.rings, strict=True):
            ring.data.copy_(data)
        self.held[: snap.held.shape[0]] = snap.held
        self.pending_rows = snap.held.shape[0]
        self.backlog = None if snap.backlog is None else snap.backlog.clone()
        self.backlog_rows, self.num_tokens = snap.backlog_rows, snap.num_tokens


@dataclass(frozen=True, eq=False)
class DSparkSnapshot:
    """A prefix-cache snapshot of a :class:`DSparkCache`: all of it."""

    rings: tuple[torch.Tensor, ...]  # [window, head_dim] per stage
    held: torch.Tensor  # [pending_rows, K*d]
    backlog: torch.Tensor | None  # [window, K*d]
    backlog_rows: int
    num_tokens: int

    def nbytes(self) -> int:
        tensors = [*self.rings, self.held] + ([] if self.backlog is None else [self.backlog])
        return sum(t.numel() * t.element_size() for t in tensors)


class DSparkDraft(nn.Module):
    """The S stages (state_dict keys = the official ``mtp.{i}.*`` names) as a
    :class:`~xspec.spec.block.BlockDraftModel`. ``embed`` / ``head``: the target's, used
    where the checkpoint has no dedicated tensor."""

    def __init__(
        self,
        args: DeepseekV4Args,
        *,
        num_stages: int,
        markov_rank: int,
        noise_token_id: int,
        confidence: bool,
        embed: nn.Embedding | None,
        head: nn.Linear | None,
        window: DraftWindow | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        expert_parallel: ExpertParallel | None = None,
        steps: StepOptions = EAGER_STEPS,
        hold_window: bool = True,
    ) -> None:
        super().__init__()
        self.args = args
        self.fill_token_id = noise_token_id
        # hold a sequence's captures back while it does not draft (up to a window of
        # them: no context compute on its plain steps) or write a full buffer at once
        # (8 rows of K*d per sequence instead of 32 + window: held_rows)
        self.hold_window = hold_window
        self.mtp = nn.ModuleList(
            DSparkStage(
                args,
                i,
                num_stages=num_stages,
                capture_width=num_stages * args.hidden_size,
                markov_rank=markov_rank,
                confidence=confidence,
                own_embed=embed is None,
                own_head=head is None,
                dtype=dtype,
                device=device,
                expert_parallel=expert_parallel,
                steps=steps,
            )
            for i in range(num_stages)
        )
        first, last = self.stages[0], self.stages[-1]
        # shared vocabulary modules in a tuple: not registered, so not part of state_dict
        self._vocab: tuple[nn.Embedding, nn.Linear] = (
            embed if embed is not None else first.embed,
            head if head is not None else last.head,
        )
        if window is not None:
            self.set_window(window)

    @property
    def stages(self) -> list[DSparkStage]:
        return list(self.mtp)  # type: ignore[arg-type]

    @property
    def markov(self) -> MarkovHead:
        return self.stages[-1].markov_head

    @property
    def confidence(self) -> ConfidenceHead | None:
        return getattr(self.stages[-1], "confidence_head", None)

    def set_window(self, window: DraftWindow) -> None:
        for stage in self.stages:
            stage.window = window

    # -- BlockDraftModel ------------------------------------------------------------------

    def snapshot(self, cache: DSparkCache, start: int) -> DSparkSnapshot:
        return cache.snapshot()  # fixed-size: nothing is append-only

    def restore(self, cache: DSparkCache, chain: Sequence[DSparkSnapshot]) -> None:
        if chain:
            cache.restore(chain[-1])

    def kv_bytes(self, gamma: int) -> KvBytes:
        itemsize = self.stages[0].attn.dtype.itemsize
        return context_bytes(len(self.stages), self.args, itemsize, self.hold_window)

    def new_cache(self, gamma: int, max_tokens: int | None = None) -> DSparkCache:
        w, hd = self.args.sliding_window, self.args.head_dim
        attn = self.stages[0].attn
        capture = len(self.stages) * self.args.hidden_size  # K*d
        return DSparkCache(  # one ring per stage
            [Ring(attn.attn_sink.new_zeros(w, hd, dtype=attn.dtype)) for _ in self.stages],
            attn.attn_sink.new_zeros(held_rows(self.hold_window, w), capture, dtype=attn.dtype),
            w,
        )

    @torch.no_grad()
    def write_context(
        self, caches: list[DSparkCache], aux: torch.Tensor, seq_lens: list[int]
    ) -> None:
        """Take in the captures ``aux [sum seq_lens, K*d]`` of new committed positions.
        They are held back until their sequence drafts (:class:`DSparkCache`); with
        ``hold_window`` no K/V is computed here. The rows that fit in the held buffers go
        in with one scatter (the buffers' :class:`Ring` stack, which stays as long as the
        batch does), not a copy per sequence. Without ``hold_window`` the rows that do not
        fit are written now."""
        due: list[tuple[DSparkCache, torch.Tensor | None]] = []
        picked: list[int] = []  # rows of aux that fit in their cache's held buffer ...
        slots: list[int] = []  # ... and where, in the stack of every cache's buffer
        row = 0
        for b, (cache, n) in enumerate(zip(caches, seq_lens)):
            k, size = cache.pending_rows, cache.capacity  # (one size: the buffers are stacked)
            if n == 1 and k + 1 < size:  # a plain step's row (the loop runs per sequence)
                picked.append(row)
                slots.append(b * size + k)
                cache.pending_rows = k + 1
            elif n and k + n < size:
                picked += range(row, row + n)
                slots += range(b * size + k, b * size + k + n)
                cache.pending_rows += n
            elif n and self.hold_window:  # full: to the backlog, with what it held
                cache.defer(aux[row : row + n])
            elif n:  # full: written now, with what it held
                due.append((cache, aux[row : row + n]))
            row += n
        if slots:
            stack = stack_rings([c.held_ring for c in caches])  # [B, held_rows, K*d]
            index = torch.tensor(slots, device=aux.device)
            which = None if len(picked) == aux.shape[0] else torch.tensor(picked, device=aux.device)
            scatter_rows(stack, aux.to(stack.dtype), (which, index))
        self._write(due)

    @torch.no_grad()
    def flush_context(self, caches: list[DSparkCache]) -> None:
        """Write the context K/V of what ``caches`` hold back."""
        self._write([(c, None) for c in caches if c.pending_rows or c.backlog_rows])

    def _write(self, due: list[tuple[DSparkCache, torch.Tensor | None]]) -> None:
        """Context K/V of what each cache holds back followed by ``rows``, in one batch: of
        each, only the rows its ring keeps (the last ``window``)."""
        if not due:
            return
        window = self.args.sliding_window
        parts, keep, starts = [], [], []
        for cache, rows in due:
            start, new = cache.num_tokens, cache.take_held()
            if rows is not None:
                new = torch.cat([new, rows.to(new.dtype)])
            k = min(new.shape[0], window)
            parts.append(new[-k:])
            keep.append(k)
            starts.append(start + new.shape[0] - k)
            cache.num_tokens = start + new.shape[0]
        aux = torch.cat(parts)
        layout = BatchLayout(_positions(starts, keep, aux.device), keep, starts)
        for i, kv in enumerate(self.context_kv(aux, layout)):
            ring = stack_rings([c.rings[i] for c, _ in due])  # [B, window, D]
            scatter_rows(ring, kv, layout.ring_slots(window))

    def context_kv(self, aux: torch.Tensor, layout: BatchLayout) -> list[torch.Tensor]:
        """Each stage's context K/V rows ``[T, D]`` (roped at ``layout``'s positions) of the
        captures ``aux [T, K*d]``: ``kv_norm(wkv(main_norm(main_proj(aux))))``."""
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(aux.to(first.attn.dtype)))
        return [
            stage.attn.key_value(main_x, layout.rotation(stage.attn.rope)) for stage in self.stages
        ]

    def forward_block(
        self, caches: list[DSparkCache], tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, W]`` at positions ``p_b .. p_b+W-1`` -> (hc_head output before the
        final norm ``[B, W, d]``, raw logits ``[B, W, V]`` fp32)."""
        self.flush_context(caches)
        starts = torch.tensor([c.num_tokens for c in caches], device=tokens.device)  # [B]
        rows = self.block_rows(tokens, starts)
        return self.run_block(
            rows, lambda i: stack_rings([c.rings[i] for c in caches]).flatten(0, 1)
        )

    def block_rows(
        self,
        tokens: torch.Tensor,
        starts: torch.Tensor,
        *,
        ring_rows: int | None = None,
        ring_base: torch.Tensor | None = None,
    ) -> BlockRows:
        """The layout of blocks ``tokens [B, W]`` anchored at ``starts [B]``."""
        batch, width = tokens.shape
        device = tokens.device
        positions = (starts[:, None] + torch.arange(width, device=device)).flatten()  # [B*W]
        return BlockRows(
            input_ids=tokens.flatten(),
            rot=self.stages[0].attn.rope.rotation(positions, int(starts.max()) + width),
            starts=starts,
            width=width,
            window=self.args.sliding_window,
            block=block_index(batch, width, device),
            ring_rows=ring_rows,
            ring_base=ring_base,
        )

    def run_block(
        self, rows: BlockRows, ring: Callable[[int], torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stages over ``rows``; ``ring(i)``: stage i's context K/V stack ``[N, D]``
        (inference: the sequences' rings; training: whole sequences) -> (hc_head output
        before the final norm ``[B, W, d]``, raw logits ``[B, W, V]`` fp32)."""
        batch, width = rows.starts.shape[0], rows.width
        x = self._vocab[0](rows.input_ids)  # [B*W, d]
        x = x.unsqueeze(1).expand(-1, self.args.hc_mult, -1).contiguous()  # [B*W, hc, d]
        for i, stage in enumerate(self.stages):
            rows.ring = ring(i)
            x = stage(x, rows)
        last = self.stages[-1]
        h = last.hyper_head(x)  # [B*W, d], before the final norm
        logits = self._vocab[1](last.norm(h)).float()  # [B*W, V]
        return h.view(batch, width, -1), logits.view(batch, width, -1)

    @torch.no_grad()
    def init_random_(self, seed: int) -> None:
        """Deterministic random weights, the target's scheme (tests, the tiny preset)."""
        init_random(self, self.args, seed)


def _positions(starts: list[int], seq_lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, seq_lens)])


# -- planning from headers -------------------------------------------------------------------


@dataclass
class DSparkPlan:
    ckpt: Checkpoint
    args: DeepseekV4Args  # the draft checkpoint's config.json
    num_stages: int
    block_size: int
    markov_rank: int
    noise_token_id: int
    capture_layer_ids: list[int]  # raw checkpoint ids (output semantics), config order
    confidence: bool
    own_embed: bool
    own_head: bool
    names: dict[str, str]  # checkpoint name -> module key
    dequant: dict[str, str]


def stage_key(name: str, num_stages: int) -> str | None:
    """The :class:`DSparkDraft` key of checkpoint tensor ``name``; None = not a stage
    tensor, or a vocabulary copy on a stage that does not own one (ignored)."""
    if not name.startswith(PREFIX):
        return None
    stage, _, rest = name[len(PREFIX) :].partition(".")
    if not stage.isdigit():
        return None
    rest = VOCAB_ALIASES.get(rest, rest)
    owner = {"embed.weight": 0, "head.weight": num_stages - 1}.get(rest)
    if owner is not None and int(stage) != owner:
        return None
    return f"{PREFIX}{stage}.{rest}"


def expected_tensors(
    args: DeepseekV4Args,
    *,
    num_stages: int,
    markov_rank: int,
    confidence: bool,
    own_embed: bool,
    own_head: bool,
) -> dict[str, list[int]]:
    """Module key -> shape of every stage tensor (built on the meta device)."""
    meta = nn.Embedding(args.vocab_size, args.hidden_size, device="meta")
    meta_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False, device="meta")
    draft = DSparkDraft(
        args,
        num_stages=num_stages,
        markov_rank=markov_rank,
        noise_token_id=0,
        confidence=confidence,
        embed=None if own_embed else meta,
        head=None if own_head else meta_head,
        device="meta",
    )
    return {k: list(v.shape) for k, v in draft.state_dict().items()}


def plan_dspark(path: str | Path, target_args: DeepseekV4Args | None) -> DSparkPlan:
    """Validate a DSpark checkpoint from config.json and tensor headers only; one
    CheckpointError lists every problem. ``target_args``: the target's config, to check
    that hidden states and token ids cross over (None skips those checks)."""
    ckpt = Checkpoint(path)
    where = ckpt.path / CONFIG_NAME
    args = DeepseekV4Args.from_config(ckpt.config, where)
    problems = _config_problems(ckpt, args, target_args)
    if problems:
        raise _error(ckpt, problems)
    require_tensors_for(ckpt, {"n_routed_experts": args.n_routed_experts})
    ids = list(args.dspark_target_layer_ids or [])
    stages = len(ids)
    rank = int(args.dspark_markov_rank or 0)
    last = f"{PREFIX}{stages - 1}."
    found = {stage_key(n, stages) for n in ckpt.names()} - {None}
    confidence = f"{last}confidence_head.proj.weight" in found
    own_embed, own_head = f"{PREFIX}0.embed.weight" in found, f"{last}head.weight" in found
    expected = expected_tensors(
        args,
        num_stages=stages,
        markov_rank=rank,
        confidence=confidence,
        own_embed=own_embed,
        own_head=own_head,
    )
    problems += _markov_problems(ckpt, last, rank)
    extra = sorted({int(n[len(PREFIX) :].split(".")[0]) for n in found if n} - set(range(stages)))
    if extra:
        problems.append(
            f"the checkpoint stores stages mtp.{extra} beyond the {stages} stages that "
            f"dspark_target_layer_ids {ids} declares (one stage per target layer id)"
        )
    names, dequant, tensor_problems = plan_tensors(
        ckpt, lambda n: stage_key(n, stages), lambda _: expected, "DSpark"
    )
    problems += [p for p in tensor_problems if not extra or "unexpected tensor" not in p]
    if problems:
        raise _error(ckpt, problems)
    capture = str(args.extra.get("dspark_capture", "layer_output"))
    return DSparkPlan(
        ckpt=ckpt,
        args=args,
        num_stages=stages,
        block_size=int(args.dspark_block_size),  # type: ignore[arg-type]
        markov_rank=rank,
        noise_token_id=int(args.dspark_noise_token_id),  # type: ignore[arg-type]
        # layer_input of L is the output of L-1 (-1: the embedding output)
        capture_layer_ids=ids if capture == "layer_output" else [i - 1 for i in ids],
        confidence=confidence,
        own_embed=own_embed,
        own_head=own_head,
        names=names,
        dequant=dequant,
    )


def _error(ckpt: Checkpoint, problems: list[str]) -> CheckpointError:
    return CheckpointError(
        f"DSpark checkpoint {ckpt.path} (Flash-0731 layout, {PREFIX}{{0..S-1}}.*) cannot be used",
        problems=problems,
    )


def _config_problems(
    ckpt: Checkpoint, args: DeepseekV4Args, target_args: DeepseekV4Args | None
) -> list[str]:
    where = ckpt.path / CONFIG_NAME
    keys = (
        "dspark_block_size",
        "dspark_markov_rank",
        "dspark_noise_token_id",
        "dspark_target_layer_ids",
    )
    missing = [k for k in keys if getattr(args, k) is None]
    if missing:
        hint = (
            "; this directory holds an MTP layer: use spec=mtp"
            if f"{PREFIX}0.e_proj.weight" in ckpt
            else "; spec=dspark needs a DeepSeek-V4-Flash-0731 checkpoint (or spec.draft_path to one)"
        )
        return [f"{where}: no DSpark drafter: config.json lacks {', '.join(missing)}{hint}"]
    problems: list[str] = []
    ids = args.dspark_target_layer_ids or []
    if not ids:
        problems.append(
            f"{where}: dspark_target_layer_ids is empty; it lists one target layer per stage"
        )
    if not 1 <= int(args.dspark_block_size or 0) <= 16:
        problems.append(f"{where}: dspark_block_size={args.dspark_block_size} must be in 1..16")
    if not 0 <= int(args.dspark_noise_token_id) < args.vocab_size:  # type: ignore[arg-type]
        problems.append(
            f"{where}: dspark_noise_token_id={args.dspark_noise_token_id} is outside the "
            f"vocabulary [0, {args.vocab_size})"
        )
    if int(args.dspark_markov_rank or 0) < 1:
        problems.append(
            f"{where}: dspark_markov_rank must be >= 1 (the V4 Markov head is required)"
        )
    capture = args.extra.get("dspark_capture", "layer_output")
    if capture not in CAPTURE_MODES:
        problems.append(
            f"{where}: dspark_capture={capture!r}; use one of {', '.join(CAPTURE_MODES)}"
        )
    if target_args is not None:
        problems += crossover_problems(where, args, target_args, "draft")
        n = target_args.num_hidden_layers
        if bad := [i for i in ids if not 0 <= i < n]:
            problems.append(
                f"{where}: dspark_target_layer_ids {bad} are outside the target's layers 0..{n - 1}"
            )
    return problems


def _markov_problems(ckpt: Checkpoint, last: str, rank: int) -> list[str]:
    """W1 / W2 must share the rank ``dspark_markov_rank`` names."""
    w1, w2 = f"{last}markov_head.markov_w1.weight", f"{last}markov_head.markov_w2.weight"
    if w1 not in ckpt or w2 not in ckpt:
        return []  # reported as missing tensors
    r1, r2 = ckpt.meta(w1)[0][-1], ckpt.meta(w2)[0][-1]
    if r1 != r2 or r1 != rank:
        return [
            f"Markov head rank mismatch: {w1} has rank {r1}, {w2} has rank {r2}, "
            f"config.json dspark_markov_rank is {rank}; they must agree"
        ]
    return []


def load_dspark(
    plan: DSparkPlan,
    *,
    embed: nn.Embedding,
    head: nn.Linear,
    window: DraftWindow | None,
    dtype: torch.dtype,
    device: torch.device | str,
    expert_parallel: ExpertParallel | None = None,
    steps: StepOptions = EAGER_STEPS,
    quant_compute: str = "auto",
    hold_window: bool = True,
) -> DSparkDraft:
    """Allocate the stages of ``plan`` and stream their weights in (with
    ``expert_parallel``: only this rank's experts; ``steps``: the platform's ops and
    compiler; quantized linears stay resident, computed per ``quant_compute``)."""

    def build(on: torch.device | str) -> DSparkDraft:
        return DSparkDraft(
            plan.args,
            num_stages=plan.num_stages,
            markov_rank=plan.markov_rank,
            noise_token_id=plan.noise_token_id,
            confidence=plan.confidence,
            embed=None if plan.own_embed else embed,
            head=None if plan.own_head else head,
            window=window,
            dtype=dtype,
            device=on,
            expert_parallel=expert_parallel,
            steps=steps,
            hold_window=hold_window,
        )

    return load_drafter(
        build,
        plan.ckpt,
        plan.names,
        plan.dequant,
        plan.args,
        expert_parallel,
        device=device,
        dtype=dtype,
        steps=steps,
        quant_compute=quant_compute,
    )
