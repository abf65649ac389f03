"""The speculative decoding step, shared by every method (the baseline is gamma = 0).

Read top to bottom: ``prefill`` starts sequences, ``decode_step`` is one
decide -> draft -> verify -> accept -> commit -> observe round for a batch of running
sequences (each at its own position, each accepting its own number of drafts), one short
function per phase. How many drafts each sequence drafts and verifies is its depth
policy's answer (:mod:`xspec.spec.policy`: fixed gamma by default). Both return what they
committed (:class:`StepResult`); the engine decides what to do with it.

Under expert parallelism (``lockstep``, :mod:`xspec.parallel.lockstep`) every rank runs
the same MoE forwards per iteration: ``prefill`` tops its chunks up to the iteration's
count with idle forwards, and ``decode_step`` proposes the iteration's draft count (it
still verifies only the drafts its own requests can use, so outputs do not change).

Device discipline: drafts, verify rows and probabilities live on the target's device
(``target.device``); each call copies one small result matrix to the host, once.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch

from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import CapturePoint, DecodeState, ForwardBatch, ModelOutput, TargetModel
from xspec.sampling import (
    SamplingParams,
    TokenLogprob,
    logits_to_probs,
    nonfinite_rows,
    regime_of,
    sample,
)
from xspec.spec.constrained import GRAMMAR_CLOCK, DraftGuide, constrain_drafts
from xspec.spec.drafter import CommittedRows, Drafter, DraftProposal, DraftRequest
from xspec.spec.logprobs import SampledRows, committed_logprobs, prompt_token_logprobs
from xspec.spec.policy import DepthPolicy, FixedDepth
from xspec.spec.processors import Processors, process_rows
from xspec.spec.verify import VerifyResult, rejection_sample

if TYPE_CHECKING:
    from xspec.grammar import Constraint
    from xspec.parallel.lockstep import Lockstep


@dataclass
class RunningSeq:
    """One running request: its tokens, decoding states, sampling state and budget."""

    token_ids: list[int]  # prompt + generated; token_ids[-1] is the anchor once decoding
    target_state: DecodeState
    draft_state: Any
    params: SamplingParams
    generator: torch.Generator | None
    max_len: int  # prompt + max_new_tokens: the step never grows token_ids past this
    error: str | None = None  # set when its logits turned non-finite; the engine drops it
    # the depth policy's own state of this request (opaque here: xspec.spec.policy)
    depth_state: Any = None
    # its grammar's state after the committed tokens (structured output), or None
    constraint: Constraint | None = None
    processors: Processors | None = None  # penalties, logit_bias, min_tokens; None: none

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]

    @cached_property
    def regime(self) -> str:
        """Its sampling regime's label (:func:`~xspec.sampling.regime_of`), computed once:
        every step reads it for the metrics and the depth policy."""
        return regime_of(self.params)

    @property
    def remaining(self) -> int:
        """Tokens this request may still commit."""
        return self.max_len - len(self.token_ids)


@dataclass
class StepResult:
    """What one ``prefill`` / ``decode_step`` committed, per sequence (host values)."""

    new_tokens: list[list[int]]  # committed tokens per sequence (accepted drafts + 1)
    num_drafts: list[int]  # drafts verified per sequence (0 for prefill / baseline)
    num_accepted: list[int]  # accepted drafts per sequence (the final token not counted)
    # per sequence asking for them (SamplingParams.logprobs), one per committed token
    logprobs: list[list[TokenLogprob] | None] | None = None
    # prefill, per sequence asking (prompt_logprobs): the prompt's, the first one None
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None


def _mask_nonfinite(logits: torch.Tensor, lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits [T, V]``, the rows of B sequences (``lens`` rows each) -> (``logits`` with
    every row of a sequence that has a non-finite row zeroed, so this batch's sampling
    runs; ``bad [B]`` bool on the device). Read with the step's one host sync."""
    seq = torch.arange(len(lens), device=logits.device).repeat_interleave(
        torch.tensor(lens, device=logits.device), output_size=logits.shape[0]
    )  # [T] sequence of each row
    bad_rows = nonfinite_rows(logits).long()  # [T]
    bad = (
        torch.zeros(len(lens), dtype=torch.long, device=logits.device).index_add_(0, seq, bad_rows)
        > 0
    )  # [B]
    return logits.masked_fill(bad[seq][:, None], 0.0), bad


def _flag(seqs: list[RunningSeq], bad: list[bool]) -> None:
    """Mark the sequences whose logits turned non-finite; the engine ends them alone."""
    for s, b in zip(seqs, bad):
        if b:
            pos = s.target_state.num_tokens
            s.error = f"the target's logits became NaN/Inf near position {pos}"


def _cat_rows(parts: list[torch.Tensor], index: torch.Tensor) -> torch.Tensor:
    """The rows ``index [N]`` of the chunk outputs ``parts`` (each ``[T_c, ...]``); a lone
    chunk of N rows holds every prompt whole, in sequence order already (no prompt
    shared by another choice)."""
    if len(parts) == 1 and len(parts[0]) == len(index):
        return parts[0]
    return torch.cat(parts)[index]


def prefill_forwards(prompt_lens: list[int], chunk_tokens: int) -> int:
    """Target forwards ``prefill`` runs for prompts of these lengths (0 for none)."""
    return math.ceil(max(prompt_lens, default=0) / chunk_tokens)


def step_gamma(drafter: Drafter, seqs: list[RunningSeq]) -> int:
    """The block width of a decode step: ``gamma``, unless no sequence can commit that many
    (n drafts commit at most n + 1 tokens)."""
    return min(drafter.gamma, max(s.remaining - 1 for s in seqs))


@torch.no_grad()
def prefill(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[RunningSeq],
    capture: list[CapturePoint],
    chunk_tokens: int,
    lockstep: Lockstep | None = None,
    shares: Sequence[int | None] | None = None,
) -> StepResult:
    """Run the prompts (in chunks of at most ``chunk_tokens`` rows per sequence) and
    sample each sequence's first token; the drafter observes the whole prompt.
    ``shares[i] = j``: ``seqs[i]`` is another choice of ``seqs[j]``'s prompt, prefilled
    once (:func:`fork`)."""
    device = target.device
    starts = [s.target_state.num_tokens for s in seqs]
    prompts = [torch.tensor(s.token_ids, dtype=torch.long, device=device) for s in seqs]
    shares = shares or [None] * len(seqs)
    hidden: list[torch.Tensor] = []  # [T_c, ...] per chunk forward, rows in `live` order
    aux: list[torch.Tensor] = []  # [T_c, K*d] per chunk forward (none: nothing captured)
    rows_of: list[list[int]] = [[] for _ in seqs]  # each prompt's rows in the chunks' rows
    last_logits: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    prompt_rows: list[list[torch.Tensor]] = [[] for _ in seqs]  # prompt_logprobs: [T_c, V] each
    for lo in range(0, max(len(p) for p in prompts), chunk_tokens):
        live = [i for i, p in enumerate(prompts) if len(p) > lo and shares[i] is None]
        chunks = [prompts[i][lo : lo + chunk_tokens] for i in live]
        ends = list(itertools.accumulate(len(c) for c in chunks))  # each chunk's end row + 1
        last = [j for j, i in enumerate(live) if len(prompts[i]) <= lo + chunk_tokens]
        scored = [j for j, i in enumerate(live) if seqs[i].params.prompt_logprobs is not None]
        wanted = {ends[j] - 1 for j in last}  # the prompts' last rows, and every row of ...
        wanted.update(r for j in scored for r in range(ends[j] - len(chunks[j]), ends[j]))
        logit_rows = sorted(wanted)  # ... the prompts whose logprobs are asked for
        at = {r: k for k, r in enumerate(logit_rows)}  # row -> its logits row
        batch = ForwardBatch(
            torch.cat(chunks),
            [len(c) for c in chunks],
            [seqs[i].target_state for i in live],
            capture,
            logit_rows=logit_rows,
        )
        out = target.forward(batch)
        for j in scored:
            prompt_rows[live[j]].append(
                out.logits[at[ends[j] - len(chunks[j])] : at[ends[j] - 1] + 1]
            )
        base = sum(len(h) for h in hidden)
        for i, c, end in zip(live, chunks, ends):
            rows_of[i] += range(base + end - len(c), base + end)
        for j in last:
            last_logits[live[j]] = out.logits[at[ends[j] - 1]]
        hidden.append(out.hidden)
        if out.aux_hidden is not None:
            aux.append(out.aux_hidden)
    if lockstep is not None:  # as many target forwards as the rank with the longest prompt
        lockstep.idle_target(
            lockstep.plan.prefill_forwards
            - prefill_forwards([len(p) for p in prompts], chunk_tokens)
        )
    for i, src in enumerate(shares):  # the other choices: the same rows, their own first token
        if src is not None:
            fork(target, drafter, seqs[src], seqs[i])
            rows_of[i], last_logits[i] = rows_of[src], last_logits[src]
            prompt_rows[i] = prompt_rows[src]
    # the first generated token comes from the last prompt row
    first, bad, sampled = first_tokens(seqs, last_logits)  # [B], [B] on the device
    # the drafter observes every prompt: the chunks' rows, gathered sequence by sequence
    seq_lens = [len(p) for p in prompts]
    ids = torch.cat(prompts)  # [N]
    next_ids = ids.roll(-1)  # [N] the next prompt token, or (at each prompt's end) ...
    next_ids[torch.tensor(seq_lens, device=device).cumsum(0) - 1] = first  # ... the first token
    index = torch.tensor([r for rows in rows_of for r in rows], device=device)  # [N]
    rows = CommittedRows(
        input_ids=ids,
        next_ids=next_ids,
        hidden=_cat_rows(hidden, index),  # [N, ...]
        aux_hidden=_cat_rows(aux, index) if aux else None,  # [N, K*d]
        seq_lens=seq_lens,
        starts=starts,
    )
    drafter.observe([s.draft_state for s in seqs], rows)
    prompt_logprobs = prompt_token_logprobs(seqs, prompts, prompt_rows)
    return commit_first(seqs, first, bad, sampled, prompt_logprobs)


def fork(target: TargetModel, drafter: Drafter, source: RunningSeq, into: RunningSeq) -> None:
    """Copy ``source``'s target and drafter states into ``into``'s empty ones: another
    choice of the same prompt (``n > 1``), whose prompt ``source``'s forwards prefilled.
    Taken after the last target forward and before the drafter observes the last rows
    (their next token is each choice's own first token). A copy through the models'
    ``snapshot`` / ``restore`` (from position 0: the whole state, rings and partial
    compressor rows included), so the two never share memory."""
    target.restore(into.target_state, [target.snapshot(source.target_state, 0)])
    draft = drafter.snapshot(source.draft_state, 0)
    into.draft_state = drafter.restore(into.draft_state, [draft])


def first_tokens(
    seqs: list[RunningSeq], last_logits: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, SampledRows]:
    """Each sequence's first generated token, sampled from its last prompt row's logits
    (``[V]`` each) after its processors and grammar: ``first [B]`` and ``bad [B]``
    (non-finite logits), on the device, and the rows as sampled (for logprobs)."""
    ones = [1] * len(seqs)
    raw, bad = _mask_nonfinite(torch.stack(last_logits), ones)  # [B, V], [B]
    no_drafts = torch.empty(len(seqs), 0, dtype=torch.long, device=raw.device)  # [B, 0]
    logits = _processed(seqs, raw, ones, no_drafts)  # [B, V]
    first_masks = [None if s.constraint is None else s.constraint.allowed()[None] for s in seqs]
    logits = _grammar_rows(logits, first_masks, ones)
    probs = logits_to_probs(logits, [s.params for s in seqs])  # [B, V]
    first = sample(probs, [s.generator for s in seqs], check_greedy=False)  # [B] on the device
    return first, bad, SampledRows(raw, logits, probs, ones)


def commit_first(
    seqs: list[RunningSeq],
    first: torch.Tensor,
    bad: torch.Tensor,
    sampled: SampledRows,
    prompt_logprobs: list[list[TokenLogprob | None] | None] | None = None,
) -> StepResult:
    """Append each sequence's first token (``first [B]``; ``bad [B]`` flags it; sampled
    from ``sampled``) after one host sync: a prefill's result."""
    host = torch.stack([first, bad.long()], dim=1).tolist()  # [B, 2]: the one host sync
    _flag(seqs, [b == 1 for _, b in host])
    new_tokens = [[t] for t, _ in host]
    ones = [1] * len(seqs)
    logprobs = committed_logprobs(seqs, sampled, first[:, None], ones)
    for s, new in zip(seqs, new_tokens):
        s.token_ids += new
        if s.constraint is not None:
            s.constraint.commit(new)
    zeros = [0] * len(seqs)
    return StepResult(
        new_tokens,
        num_drafts=zeros,
        num_accepted=list(zeros),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _scatter(part: torch.Tensor | None, rows: torch.Tensor, batch: int) -> torch.Tensor | None:
    """``part [D, ...]`` (the drafting requests' rows) into a zero ``[batch, ...]`` tensor
    at ``rows [D]``; the other requests' rows are never read (they verify no draft)."""
    if part is None:
        return None
    full = part.new_zeros((batch, *part.shape[1:]))
    full[rows] = part
    return full


def _draft(
    drafter: Drafter,
    seqs: list[RunningSeq],
    drafting: list[int],
    max_drafts: list[int],
    proposed: int,
    guides: list[DraftGuide | None] | None = None,
) -> DraftProposal:
    """The draft forward for the sequences ``drafting`` (indices into ``seqs``) only; the
    proposal's tensors are laid out over all of ``seqs`` (zero rows for the others)."""
    requests = [
        DraftRequest(
            seqs[b].anchor,
            seqs[b].params,
            seqs[b].generator,
            max_drafts=max_drafts[b],
            guide=None if guides is None else guides[b],
            processors=_caught_up(seqs[b]) if drafter.process_drafts else None,
        )
        for b in drafting
    ]
    proposal = drafter.propose([seqs[b].draft_state for b in drafting], requests, proposed)
    if len(drafting) == len(seqs):
        return proposal
    rows = torch.tensor(drafting, dtype=torch.long, device=proposal.tokens.device)
    tokens = _scatter(proposal.tokens, rows, len(seqs))
    assert tokens is not None
    return DraftProposal(
        tokens,
        _scatter(proposal.probs, rows, len(seqs)),
        _scatter(proposal.confidence, rows, len(seqs)),
    )


def _caught_up(seq: RunningSeq) -> Processors | None:
    """The sequence's processors with its committed tokens counted (for the drafter)."""
    if seq.processors is not None:
        seq.processors.catch_up(seq.token_ids)
    return seq.processors


FIXED_DEPTH = FixedDepth()  # the default depth policy (it keeps no state: one for all)


@dataclass
class _Drafts:
    """Phase 1's result, laid out over every sequence of the step."""

    tokens: torch.Tensor  # [B, width] int64, width = max(verified); zero rows for non-drafters
    probs: torch.Tensor | None  # [B, width, V] the draft's full q, or None (one-hot q)
    confidence: torch.Tensor | None  # [B, depth] the draft's confidences (untrimmed), or None
    verified: list[int]  # [B] drafts each sequence verifies (the policy's trim of its depth)
    # [B]: each constrained sequence's allowed set per verify row ([verified+1, V]), or None
    masks: list[torch.Tensor | None] | None = None
    # [B]: per verified draft, whether its grammar forced it (not drafted), or None
    forced: list[list[bool]] | None = None


@dataclass
class _Verified:
    """Phases 2 and 3's result: the verify forward and what it accepted."""

    out: ModelOutput  # the target's forward over every sequence's verify rows (ragged)
    blocks: torch.Tensor  # [B, width+1] anchor + drafts, on the device
    lens: list[int]  # [B] verify rows per sequence (verified + 1)
    result: VerifyResult  # output_tokens [B, width+1] on the device
    rows: SampledRows  # the verify rows as sampled from (logprobs)
    output: torch.Tensor  # [B, width+1] on the host: committed tokens, then -1
    committed: list[int]  # [B] accepted drafts + 1


@torch.no_grad()
def decode_step(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[RunningSeq],
    capture: list[CapturePoint],
    metrics: SpecDecodeMetrics,
    lockstep: Lockstep | None = None,
    policy: DepthPolicy = FIXED_DEPTH,
) -> StepResult:
    """One speculative step for every sequence in ``seqs`` (each with ``remaining >= 1``),
    phase by phase. ``policy`` (:mod:`xspec.spec.policy`) says how many drafts each
    sequence drafts and verifies; under ``lockstep`` every rank proposes the iteration's
    draft count (the engine runs only a lockstep-safe policy there)."""
    n0 = [s.target_state.num_tokens for s in seqs]  # the anchor's position, per sequence
    # 0. decide: drafts per sequence, never more than it can commit (n drafts commit n + 1)
    depths = policy.decide(seqs, [min(drafter.gamma, s.remaining - 1) for s in seqs])
    # 1. draft: the drafting sequences propose; the policy trims what each one verifies
    proposed = max(depths, default=0) if lockstep is None else lockstep.plan.draft_tokens
    guides = _guides(drafter, seqs)  # structured output: xspec.spec.constrained
    drafts = _draft_step(drafter, seqs, depths, policy, proposed, target.device, guides)
    if any(s.constraint is not None for s in seqs):
        drafts = _constrain(seqs, drafts, drafter, guides)
    # 2. verify: the target scores [anchor, d_1 .. d_n] (n + 1 rows) per sequence at once
    # 3. accept: the accepted prefix + one correction (on rejection) or bonus token
    verified = _verify(target, seqs, capture, drafts)
    # 4. commit: the target keeps the anchor and the accepted drafts
    new_tokens = _commit(target, seqs, n0, verified)
    # 5. observe: the drafter catches up on the kept rows of the verify forward
    _observe(drafter, seqs, n0, verified)
    # 6. the policy learns from the step; metrics from the output matrix
    accepted = [k - 1 for k in verified.committed]
    if drafts.forced is None:
        policy.observe(seqs, drafts.verified, accepted)
    else:  # the policy judges its drafter: forced tokens are neither drafted nor its hits
        own = [[not f for f in fs] for fs in drafts.forced]  # [B][verified]: its drafts
        policy.observe(seqs, [sum(o) for o in own], [sum(o[:a]) for o, a in zip(own, accepted)])
    metrics.observe_step(
        verified.output,
        torch.tensor(drafts.verified, dtype=torch.long),
        policy.predicted(drafts.confidence),
        depths=depths,
        regimes=[s.regime for s in seqs],
    )
    logprobs = committed_logprobs(seqs, verified.rows, verified.output, verified.committed)
    return StepResult(new_tokens, drafts.verified, accepted, logprobs=logprobs)


def _draft_step(
    drafter: Drafter,
    seqs: list[RunningSeq],
    depths: list[int],
    policy: DepthPolicy,
    proposed: int,
    device: torch.device,
    guides: list[DraftGuide | None] | None = None,
) -> _Drafts:
    """Phase 1: ``proposed`` drafts for the sequences the policy names (none when it is
    0: a plain step, whose sequences verify nothing), the first ``max(depths)`` of them
    kept; after drafting the policy trims each sequence's verified prefix."""
    B, width = len(seqs), max(depths, default=0)  # width: this step's block
    drafting = policy.drafting(depths)
    tokens = torch.empty(B, 0, dtype=torch.long, device=device)  # [B, width]
    probs = confidence = None
    verified = depths
    if proposed > 0 and drafting:
        proposal = _draft(
            drafter, seqs, drafting, [s.remaining - 1 for s in seqs], proposed, guides
        )
        if width > 0:  # (under lockstep a rank may propose for others' widths only)
            tokens = proposal.tokens[:, :width]
            probs = None if proposal.probs is None else proposal.probs[:, :width]
            confidence = None if proposal.confidence is None else proposal.confidence[:, :width]
        if confidence is not None:
            verified = policy.trim(confidence, depths)  # [B] verified prefix per sequence
        keep = max(verified)  # drafts beyond every sequence's prefix are never scored
        tokens = tokens[:, :keep]
        probs = probs[:, :keep] if probs is not None else None
    return _Drafts(tokens, probs, confidence, verified)


def _guides(drafter: Drafter, seqs: list[RunningSeq]) -> list[DraftGuide | None] | None:
    """Each constrained sequence's grammar for a drafter that masks its own drafts
    (``masks_inside`` and ``spec.mask_drafts``), capped at gamma and what it can still
    commit; None when the drafter is not to be given them or no sequence has a grammar."""
    if not (drafter.masks_inside and drafter.mask_drafts):
        return None
    if all(s.constraint is None for s in seqs):
        return None
    return [
        None if s.constraint is None else DraftGuide(s.constraint, _grammar_cap(drafter, s))
        for s in seqs
    ]


def _grammar_cap(drafter: Drafter, seq: RunningSeq) -> int:
    """The most drafts a constrained sequence verifies: gamma, within what it can commit."""
    return min(drafter.gamma, seq.remaining - 1)


def _constrain(
    seqs: list[RunningSeq],
    drafts: _Drafts,
    drafter: Drafter,
    guides: list[DraftGuide | None] | None,
) -> _Drafts:
    """The drafts of the constrained sequences walked through their grammars
    (:mod:`xspec.spec.constrained`: the drafter's guided drafts and the forced tokens
    after them, or the drafter's drafts walked afterwards), with every verify row's mask;
    the other sequences' drafts unchanged."""
    host = drafts.tokens.tolist()  # [B, width]: drafts are small; the walk is on the host
    tokens: list[list[int]] = []
    probs: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    verified: list[int] = []
    forced: list[list[bool]] = []
    for b, s in enumerate(seqs):
        n = drafts.verified[b]
        q = None if drafts.probs is None else drafts.probs[b, :n]
        if s.constraint is None:
            tokens.append(host[b][:n])
            probs.append(q)
            masks.append(None)
            forced.append([False] * n)
            verified.append(n)
            continue
        if guides is not None:
            guide = guides[b]
            assert guide is not None
            walked = guide.finish(n, q)
        else:
            walked = constrain_drafts(
                s.constraint,
                host[b][:n],
                q,
                _grammar_cap(drafter, s),
                s.generator,
                redraw=drafter.mask_drafts,
            )
        tokens.append(walked.tokens)
        probs.append(walked.probs)
        masks.append(walked.masks)
        forced.append(walked.forced_at)
        verified.append(len(walked.tokens))
    width, device = max(verified, default=0), drafts.tokens.device
    padded = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, t in enumerate(tokens):
        padded[b, : len(t)] = torch.tensor(t, dtype=torch.long)
    q_all = None
    if drafts.probs is not None:  # one-hot rows where a sequence's q is (forced) one-hot
        q_all = drafts.probs.new_zeros(len(seqs), width, drafts.probs.shape[-1])
        for b, (t, q) in enumerate(zip(tokens, probs)):
            if q is not None:
                q_all[b, : len(t)] = q
            elif t:
                q_all[b, torch.arange(len(t)), torch.tensor(t)] = 1.0
    return _Drafts(padded.to(device), q_all, drafts.confidence, verified, masks, forced)


def _grammar_rows(
    logits: torch.Tensor, masks: list[torch.Tensor | None], lens: list[int]
) -> torch.Tensor:
    """``logits [sum(lens), V]`` (sequence b's ``lens[b]`` rows) with each constrained
    sequence's rows set to -inf where its grammar forbids (``masks[b] [lens[b], V]``
    bool; None: no grammar)."""
    if all(m is None for m in masks):
        return logits
    vocab = logits.shape[1]
    with GRAMMAR_CLOCK.timing():
        allowed = torch.cat(
            [
                torch.ones(n, vocab, dtype=torch.bool) if m is None else m
                for m, n in zip(masks, lens)
            ]
        ).to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))


def _verify(
    target: TargetModel, seqs: list[RunningSeq], capture: list[CapturePoint], drafts: _Drafts
) -> _Verified:
    """Phases 2 and 3: one target forward over every sequence's ``[anchor, d_1 .. d_n]``,
    the rejection sampler on it, and the step's one host sync (tokens and NaN flags)."""
    device = target.device
    anchors = torch.tensor([s.anchor for s in seqs], dtype=torch.long, device=device)  # [B]
    blocks = torch.cat([anchors[:, None], drafts.tokens], dim=1)  # [B, max(n)+1]
    lens = [k + 1 for k in drafts.verified]
    out = target.forward(
        ForwardBatch(
            torch.cat([blocks[b, :k] for b, k in enumerate(lens)]),  # [sum(lens)]
            lens,
            [s.target_state for s in seqs],
            capture,
        )
    )
    row_params = [s.params for s, k in zip(seqs, lens) for _ in range(k)]
    raw, bad = _mask_nonfinite(out.logits, lens)  # [sum(lens), V], [B]
    logits = _processed(seqs, raw, lens, drafts.tokens)  # row j after drafts 1..j
    if drafts.masks is not None:
        logits = _grammar_rows(logits, drafts.masks, lens)
    probs = logits_to_probs(logits, row_params)  # [sum(lens), V]
    p = torch.nn.utils.rnn.pad_sequence(
        list(probs.split(lens)), batch_first=True
    )  # [B, max(n)+1, V]
    generators = [s.generator for s in seqs]
    result = rejection_sample(
        p, drafts.tokens, drafts.probs, generators, drafts.verified, check_tokens=False
    )
    host = torch.cat([result.output_tokens, bad.long()[:, None]], dim=1).cpu()  # one host sync
    output = host[:, :-1]  # [B, max(n)+1]
    _flag(seqs, host[:, -1].bool().tolist())
    committed = (output >= 0).sum(dim=1).tolist()  # [B] accepted + 1
    rows = SampledRows(raw, logits, probs, lens)
    return _Verified(out, blocks, lens, result, rows, output, committed)


def _processed(
    seqs: list[RunningSeq], logits: torch.Tensor, lens: list[int], drafts: torch.Tensor
) -> torch.Tensor:
    """``logits [sum(lens), V]`` with each sequence's processors applied to its rows
    (:mod:`xspec.spec.processors`); unchanged when no sequence has any."""
    procs = [s.processors for s in seqs]
    return process_rows(logits, procs, lens, drafts, [s.token_ids for s in seqs])


def _commit(
    target: TargetModel, seqs: list[RunningSeq], n0: list[int], verified: _Verified
) -> list[list[int]]:
    """Phase 4: keep the anchor and the accepted drafts in the target's state (the rest is
    rolled back); the correction/bonus token becomes the next anchor (not yet seen by the
    target). Returns each sequence's committed tokens."""
    new_tokens = []
    for b, s in enumerate(seqs):
        k = verified.committed[b]
        target.truncate(s.target_state, n0[b] + k)
        new_tokens.append(verified.output[b, :k].tolist())
        s.token_ids += new_tokens[-1]
        if s.constraint is not None:
            with GRAMMAR_CLOCK.timing():
                s.constraint.commit(new_tokens[-1])
    return new_tokens


def _observe(drafter: Drafter, seqs: list[RunningSeq], n0: list[int], verified: _Verified) -> None:
    """Phase 5: the drafter catches up on the kept rows of the verify forward, selected
    with one index (sequence b's first committed[b] of its lens[b] rows); also after a
    step that drafted nothing (its context must hold every committed row)."""
    out, blocks, committed = verified.out, verified.blocks, verified.committed
    device = blocks.device
    keep = [(b, j) for b, k in enumerate(committed) for j in range(k)]  # (sequence, column)
    seq, col = torch.tensor(keep, dtype=torch.long, device=device).reshape(-1, 2).T  # [N] each
    anchor_row = torch.tensor([0, *itertools.accumulate(verified.lens)], device=device)  # [B+1]
    row = anchor_row[seq] + col  # [N] rows of the verify forward
    aux = out.aux_hidden
    rows = CommittedRows(
        input_ids=blocks[seq, col],  # [N] anchor + accepted drafts
        next_ids=verified.result.output_tokens[seq, col],  # [N] accepted drafts + correction/bonus
        hidden=out.hidden[row],  # [N, ...]
        aux_hidden=None if aux is None else aux[row],  # [N, K*d]
        seq_lens=committed,
        starts=n0,
    )
    drafter.observe([s.draft_state for s in seqs], rows)
