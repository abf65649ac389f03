"""The prefill of a prefix-cached engine: one prompt block per sequence per forward.

:func:`prefill_blocks` is :func:`xspec.spec.step.prefill` cut at fixed block boundaries
(``block``, ``2 * block``, ... of every prompt), so the states can be snapshotted where a
forward ended (:mod:`xspec.engine.prefix_cache`). A sequence starts where its restored
state ends (a boundary; 0 cold). Each forward takes the next block of every sequence
still prefilling; after a block that is not its prompt's last, the drafter observes it
(its rows, and the prompt token after each as the next token), all but the block's last
row, which waits for the next block (:class:`HeldRow`), and ``on_boundary`` may snapshot
the sequence. A prompt's last block goes as :func:`~xspec.spec.step.prefill`'s does: its
last row samples the first token, which is the next token of its last row.

A hit and a cold run of one prompt therefore run the same forwards over the same rows
from the same states, and give the same bits (the batch around a sequence aside: like
any forward, a row's arithmetic may depend on the rows it is batched with).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from xspec.models.base import CapturePoint, ForwardBatch, TargetModel
from xspec.spec.drafter import CommittedRows, Drafter
from xspec.spec.logprobs import prompt_token_logprobs
from xspec.spec.step import RunningSeq, StepResult, commit_first, first_tokens, fork


def block_forwards(prompt_lens: list[int], starts: list[int], block: int) -> int:
    """Target forwards :func:`prefill_blocks` runs for these prompts and restored starts."""
    return max((math.ceil((n - s) / block) for n, s in zip(prompt_lens, starts)), default=0)


@dataclass(frozen=True, eq=False)
class HeldRow:
    """A prompt's last row before a block boundary, which the drafter has not observed
    yet: its state at the boundary must not depend on the token after it (MTP embeds the
    next token of every row it observes), so this row waits for the next block. The
    prefix cache keeps it beside the states (``hidden [1, ...]``, ``aux [1, K*d]``)."""

    hidden: torch.Tensor
    aux: torch.Tensor | None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.aux) if t is not None)


@dataclass
class _Rows:
    """One sequence's rows, to be observed by the drafter."""

    seq: int  # index into the prefill's sequences
    ids: torch.Tensor  # [n] the tokens
    next_ids: torch.Tensor  # [n] the token after each (the last may still be missing: [n-1])
    hidden: torch.Tensor  # [n, ...] the target's pre-head hidden
    aux: torch.Tensor | None  # [n, K*d] the captured hidden
    start: int  # the position of its first row

    def after(self, held: _Rows | None) -> _Rows:
        """``held`` (one row) followed by these rows."""
        if held is None:
            return self
        aux = None if self.aux is None or held.aux is None else torch.cat([held.aux, self.aux])
        return _Rows(
            self.seq,
            torch.cat([held.ids, self.ids]),
            torch.cat([held.next_ids, self.next_ids]),
            torch.cat([held.hidden, self.hidden]),
            aux,
            held.start,
        )

    def split_last(self) -> tuple[_Rows, _Rows]:
        """(every row but the last, the last)."""
        n, aux = len(self.ids) - 1, self.aux
        head = _Rows(
            self.seq, self.ids[:n], self.next_ids[:n], self.hidden[:n],
            None if aux is None else aux[:n], self.start,
        )  # fmt: skip
        tail = _Rows(
            self.seq, self.ids[n:], self.next_ids[n:], self.hidden[n:],
            None if aux is None else aux[n:], self.start + n,
        )  # fmt: skip
        return head, tail


@torch.no_grad()
def prefill_blocks(
    target: TargetModel,
    drafter: Drafter,
    seqs: list[RunningSeq],
    capture: list[CapturePoint],
    block: int,
    held: list[HeldRow | None],
    on_boundary: Callable[[int, HeldRow], None],
    shares: Sequence[int | None] | None = None,
) -> StepResult:
    """Prefill ``seqs`` from their states' positions in blocks (module docstring).
    ``held[i]``: the row a restored sequence ``i`` holds back (None: it starts at 0).
    ``on_boundary(i, row)`` runs when sequence ``i`` holds a boundary short of its
    prompt's end, the drafter having observed every row but the boundary's last, ``row``.
    ``shares[i] = j``: ``seqs[i]`` is another choice of ``seqs[j]``'s prompt; it runs no
    forward, and takes ``j``'s states before its last block's rows are observed
    (:func:`~xspec.spec.step.fork`), then those rows with its own first token."""
    device = target.device
    prompts = [torch.tensor(s.token_ids, dtype=torch.long, device=device) for s in seqs]
    starts = [s.target_state.num_tokens for s in seqs]
    shares = shares or [None] * len(seqs)
    runs = [i for i in range(len(seqs)) if shares[i] is None]  # the sequences that forward
    waiting: list[_Rows | None] = [
        None if h is None else _Rows(i, p[b - 1 : b], p[b : b + 1], h.hidden, h.aux, b - 1)
        for i, (h, p, b) in enumerate(zip(held, prompts, starts))
    ]
    last_rows: list[_Rows | None] = [None] * len(seqs)
    last_logits: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
    # prompt_logprobs: every row of those prompts is scored (they start cold: the engine
    # gives them no hit), [n_c, V] per forward
    scored = [s.params.prompt_logprobs is not None for s in seqs]
    prompt_rows: list[list[torch.Tensor]] = [[] for _ in seqs]
    rounds = block_forwards([len(prompts[i]) for i in runs], [starts[i] for i in runs], block)
    for r in range(rounds):
        live = [i for i in runs if starts[i] + r * block < len(prompts[i])]
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
            following = prompts[i][lo + 1 : lo + block + 1]  # (the last block's: one short)
            rows = _Rows(i, chunks[j], following, out.hidden[own], aux, lo).after(waiting[i])
            if scored[i]:
                prompt_rows[i].append(out.logits[at[ends[j]] : at[ends[j + 1] - 1] + 1])
            if final[j]:
                last_rows[i] = rows
                last_logits[i] = out.logits[at[ends[j + 1] - 1]]
            else:
                observed, waiting[i] = rows.split_last()
                middle.append(observed)
        if middle:
            _observe(drafter, seqs, middle)
            for rows in middle:
                row = waiting[rows.seq]
                assert row is not None
                on_boundary(rows.seq, HeldRow(row.hidden, row.aux))
    for i, src in enumerate(shares):  # the other choices: the same rows, their own first token
        if src is None:
            continue
        shared = last_rows[src]
        assert shared is not None, "a shared prompt's own sequence ran its last block"
        fork(target, drafter, seqs[src], seqs[i])
        last_rows[i] = dataclasses.replace(shared, seq=i)
        last_logits[i], prompt_rows[i] = last_logits[src], prompt_rows[src]
    first, bad, sampled = first_tokens(seqs, last_logits)  # [B], [B] on the device
    tails = [rows for rows in last_rows if rows is not None]
    for rows, token in zip(tails, first.split(1)):
        rows.next_ids = torch.cat([rows.next_ids, token])
    _observe(drafter, seqs, tails)
    return commit_first(
        seqs, first, bad, sampled, prompt_token_logprobs(seqs, prompts, prompt_rows)
    )


def _observe(drafter: Drafter, seqs: list[RunningSeq], parts: list[_Rows]) -> None:
    """The drafter takes in ``parts`` (one per sequence) as one ragged batch."""
    aux = [p.aux for p in parts]
    rows = CommittedRows(
        input_ids=torch.cat([p.ids for p in parts]),
        next_ids=torch.cat([p.next_ids for p in parts]),
        hidden=torch.cat([p.hidden for p in parts]),  # [N, ...]
        aux_hidden=None if aux[0] is None else torch.cat(aux),  # type: ignore[arg-type]  # [N, K*d]
        seq_lens=[len(p.ids) for p in parts],
        starts=[p.start for p in parts],
    )
    drafter.observe([seqs[p.seq].draft_state for p in parts], rows)
