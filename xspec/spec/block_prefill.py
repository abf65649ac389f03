"""The prefill of a prefix-cached engine: one prompt block per sequence per forward.

:func:`prefill_blocks` is :func:`xspec.spec.step.prefill` cut at fixed block boundaries
(``block``, ``2 * block``, ... of every prompt), so the states can be snapshotted where a
forward ended (:mod:`xspec.engine.prefix_cache`). A sequence starts where its restored
state ends (a boundary; 0 cold). Each forward takes the next block of every sequence
still prefilling; after a block that is not its prompt's last, the drafter observes it
(its rows, and the prompt token after each as the next token) and ``on_boundary`` may
snapshot the sequence. A prompt's last block goes as :func:`~xspec.spec.step.prefill`'s
does: its last row samples the first token, which is the next token of its last row.

A hit and a cold run of one prompt therefore run the same forwards over the same rows
from the same states, and give the same bits (the batch around a sequence aside: like
any forward, a row's arithmetic may depend on the rows it is batched with).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from xspec.models.base import CapturePoint, ForwardBatch, TargetModel
from xspec.spec.drafter import CommittedRows, Drafter
from xspec.spec.logprobs import prompt_token_logprobs
from xspec.spec.step import RunningSeq, StepResult, commit_first, first_tokens


def block_forwards(prompt_lens: list[int], starts: list[int], block: int) -> int:
    """Target forwards :func:`prefill_blocks` runs for these prompts and restored starts."""
    return max((math.ceil((n - s) / block) for n, s in zip(prompt_lens, starts)), default=0)


@dataclass
class _Rows:
    """One sequence's rows of one forward, to be observed by the drafter."""

    seq: int  # index into the prefill's sequences
    ids: torch.Tensor  # [n] the tokens
    next_ids: torch.Tensor | None  # [n] the token after each (None: the last block's)
    hidden: torch.Tensor  # [n, ...] the target's pre-head hidden
    aux: torch.Tensor | None  # [n, K*d] the captured hidden
    start: int  # the position of its first row


@torch.no_grad()
def prefill_blocks(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[RunningSeq],
    capture: list[CapturePoint],
    block: int,
    on_boundary: Callable[[int], None],
) -> StepResult:
    """Prefill ``seqs`` from their states' positions in blocks (module docstring);
    ``on_boundary(i)`` runs when sequence ``i`` holds a boundary short of its prompt's end."""
    device = target.device
    prompts = [torch.tensor(s.token_ids, dtype=torch.long, device=device) for s in seqs]
    starts = [s.target_state.num_tokens for s in seqs]
    last_rows: list[_Rows | None] = [None] * len(seqs)
    last_logits: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    # prompt_logprobs: every row of those prompts is scored (they start cold: the engine
    # gives them no hit), [n_c, V] per forward
    scored = [s.params.prompt_logprobs is not None for s in seqs]
    prompt_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    rounds = block_forwards([len(p) for p in prompts], starts, block)
    for r in range(rounds):
        live = [i for i in range(len(seqs)) if starts[i] + r * block < len(prompts[i])]
        los = [starts[i] + r * block for i in live]
        chunks = [prompts[i][lo : lo + block] for i, lo in zip(live, los)]
        ends = [0]
        for c in chunks:
            ends.append(ends[-1] + len(c))
        final = [len(prompts[i]) <= lo + block for i, lo in zip(live, los)]
        wanted = {ends[j + 1] - 1 for j in range(len(live)) if final[j]}
        wanted.update(
            r for j, i in enumerate(live) if scored[i] for r in range(ends[j], ends[j + 1])
        )
        logit_rows = sorted(wanted)
        at = {r: k for k, r in enumerate(logit_rows)}  # row -> its logits row
        out = target.forward(
            ForwardBatch(
                torch.cat(chunks),
                [len(c) for c in chunks],
                [seqs[i].target_state for i in live],
                capture,
                logit_rows=logit_rows,
            )
        )
        middle: list[_Rows] = []
        for j, (i, lo) in enumerate(zip(live, los)):
            own = slice(ends[j], ends[j + 1])
            aux = None if out.aux_hidden is None else out.aux_hidden[own]
            if scored[i]:
                prompt_rows[i].append(out.logits[at[ends[j]] : at[ends[j + 1] - 1] + 1])
            if final[j]:
                last_rows[i] = _Rows(i, chunks[j], None, out.hidden[own], aux, lo)
                last_logits[i] = out.logits[at[ends[j + 1] - 1]]
            else:
                following = prompts[i][lo + 1 : lo + block + 1]
                middle.append(_Rows(i, chunks[j], following, out.hidden[own], aux, lo))
        if middle:
            _observe(drafter, seqs, middle)
            for rows_of in middle:
                on_boundary(rows_of.seq)
    first, bad, sampled = first_tokens(seqs, last_logits)  # [B], [B] on the device
    tails = [rows for rows in last_rows if rows is not None]
    for rows, token in zip(tails, first.split(1)):
        rows.next_ids = torch.cat([rows.ids[1:], token])
    _observe(drafter, seqs, tails)
    return commit_first(
        seqs, first, bad, sampled, prompt_token_logprobs(seqs, prompts, prompt_rows)
    )


def _observe(drafter: Drafter, seqs: list[RunningSeq], parts: list[_Rows]) -> None:
    """The drafter takes in ``parts`` (one per sequence) as one ragged batch."""
    aux = [p.aux for p in parts]
    next_ids = [p.next_ids for p in parts]
    assert all(n is not None for n in next_ids)
    rows = CommittedRows(
        input_ids=torch.cat([p.ids for p in parts]),
        next_ids=torch.cat(next_ids),  # type: ignore[arg-type]
        hidden=torch.cat([p.hidden for p in parts]),  # [N, ...]
        aux_hidden=None if aux[0] is None else torch.cat(aux),  # type: ignore[arg-type]  # [N, K*d]
        seq_lens=[len(p.ids) for p in parts],
        starts=[p.start for p in parts],
    )
    drafter.observe([seqs[p.seq].draft_state for p in parts], rows)
