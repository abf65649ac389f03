"""The speculative decoding step, shared by every method (the baseline is gamma = 0).

Read top to bottom: ``prefill`` starts sequences, ``decode_step`` is one
draft -> verify -> accept -> commit -> observe round for a batch of running sequences
(each at its own position, each accepting its own number of drafts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import CapturePoint, DecodeState, ForwardBatch, ModelOutput, TargetModel
from xspec.sampling import SamplingParams, logits_to_probs, nonfinite_rows, sample
from xspec.workers.drafter import CommittedRows, Drafter, DraftRequest
from xspec.workers.verify import rejection_sample


@dataclass
class Sequence:
    """One running request: its tokens, decoding states and sampling state."""

    token_ids: list[int]  # prompt + generated; token_ids[-1] is the anchor once decoding
    target_state: DecodeState
    draft_state: Any
    params: SamplingParams
    generator: torch.Generator | None
    new_tokens: list[int] = field(default_factory=list)  # committed this step
    error: str | None = None  # set when its logits turned non-finite; the engine drops it

    @property
    def anchor(self) -> int:
        return self.token_ids[-1]


def _flag_nonfinite(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, R, V]``: a sequence with a non-finite row gets ``error`` set and its rows
    zeroed, so this batch's sampling runs; its tokens of this step are discarded."""
    bad = nonfinite_rows(logits.flatten(0, 1)).view(logits.shape[:2]).any(dim=1)  # [B]
    if not bool(bad.any()):
        return logits
    for b in bad.nonzero().flatten().tolist():
        pos = seqs[b].target_state.num_tokens
        seqs[b].error = f"the target's logits became NaN/Inf near position {pos}"
    return logits.masked_fill(bad[:, None, None], 0.0)


def _rows(out: ModelOutput, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    aux = out.aux_hidden[start:stop] if out.aux_hidden is not None else None
    return out.hidden[start:stop], aux


@torch.no_grad()
def prefill(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[Sequence],
    capture: list[CapturePoint],
    chunk_tokens: int,
) -> None:
    """Run the prompts (in chunks of at most ``chunk_tokens`` rows per sequence) and
    sample each sequence's first token; the drafter observes the whole prompt."""
    prompts = [torch.tensor(s.token_ids, dtype=torch.long) for s in seqs]
    hidden: list[list[torch.Tensor]] = [[] for _ in seqs]
    aux: list[list[torch.Tensor]] = [[] for _ in seqs]
    last_logits: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    for lo in range(0, max(len(p) for p in prompts), chunk_tokens):
        live = [i for i, p in enumerate(prompts) if len(p) > lo]
        chunks = [prompts[i][lo : lo + chunk_tokens] for i in live]
        batch = ForwardBatch(
            torch.cat(chunks),
            [len(c) for c in chunks],
            [seqs[i].target_state for i in live],
            capture,
        )
        out = target.forward(batch)
        end = 0
        for i, c in zip(live, chunks):
            h, a = _rows(out, end, end + len(c))
            hidden[i].append(h)
            if a is not None:
                aux[i].append(a)
            end += len(c)
            last_logits[i] = out.logits[end - 1]
    # the first generated token comes from the last prompt row
    logits = _flag_nonfinite(seqs, torch.stack(last_logits)[:, None])[:, 0]  # [B, V]
    probs = logits_to_probs(logits, [s.params for s in seqs])  # [B, V]
    first = sample(probs, [s.generator for s in seqs])  # [B]
    rows = []
    for i, s in enumerate(seqs):
        s.new_tokens = [int(first[i])]
        s.token_ids.append(s.new_tokens[0])
        rows.append(
            CommittedRows(
                input_ids=prompts[i],
                next_ids=torch.tensor(s.token_ids[1:], dtype=torch.long),
                hidden=torch.cat(hidden[i]),
                aux_hidden=torch.cat(aux[i]) if aux[i] else None,
            )
        )
    drafter.observe([s.draft_state for s in seqs], rows)


@torch.no_grad()
def decode_step(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[Sequence],
    capture: list[CapturePoint],
    metrics: SpecDecodeMetrics,
) -> None:
    """One speculative step for every sequence in ``seqs``; sets ``seq.new_tokens``."""
    B, gamma = len(seqs), drafter.gamma
    params = [s.params for s in seqs]
    generators = [s.generator for s in seqs]
    n0 = [s.target_state.num_tokens for s in seqs]  # the anchor's position, per sequence

    # 1. draft: gamma tokens after each anchor (q: the draft's full distributions, if sampled)
    requests = [DraftRequest(anchor=s.anchor, params=s.params, generator=s.generator) for s in seqs]
    proposal = drafter.propose([s.draft_state for s in seqs], requests)
    drafts = proposal.tokens  # [B, gamma]

    # 2. verify: the target scores [anchor, d_1 .. d_gamma] in one forward
    rows = torch.cat(
        [torch.tensor([s.anchor for s in seqs])[:, None], drafts], dim=1
    )  # [B, gamma+1]
    out = target.forward(
        ForwardBatch(rows.flatten(), [gamma + 1] * B, [s.target_state for s in seqs], capture)
    )
    row_params = [p for p in params for _ in range(gamma + 1)]
    logits = _flag_nonfinite(seqs, out.logits.view(B, gamma + 1, -1))  # [B, gamma+1, V]
    p = logits_to_probs(logits.flatten(0, 1), row_params).view(B, gamma + 1, -1)

    # 3. accept: the accepted prefix + one correction (on rejection) or bonus token
    result = rejection_sample(p, drafts, proposal.probs, generators)
    accepted = result.num_accepted.tolist()  # [B]

    # 4. commit: keep the anchor and the accepted drafts in the target's state; the
    #    correction/bonus token becomes the next anchor (not yet seen by the target)
    committed = []
    for b, s in enumerate(seqs):
        a = accepted[b]
        target.truncate(s.target_state, n0[b] + 1 + a)
        s.new_tokens = result.output_tokens[b, : a + 1].tolist()
        s.token_ids.extend(s.new_tokens)
        h, x = _rows(out, b * (gamma + 1), b * (gamma + 1) + a + 1)
        committed.append(
            CommittedRows(
                input_ids=rows[b, : a + 1],
                next_ids=result.output_tokens[b, : a + 1],
                hidden=h,
                aux_hidden=x,
            )
        )

    # 5. the drafter catches up on what was committed; 6. metrics from the output matrix
    drafter.observe([s.draft_state for s in seqs], committed)
    metrics.observe_step(
        result.output_tokens, torch.full((B,), gamma, dtype=torch.long), proposal.confidence
    )
