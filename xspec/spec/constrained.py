"""Speculation under a grammar: drafts the grammar allows, masks on every verify row.

A request with a :class:`~xspec.grammar.Constraint` samples from the target's
distribution masked by the grammar state its prefix reached. Under speculation that
state differs row by row: the row that scores draft position j has seen ``d_1 .. d_(j-1)``.
Before the verify forward, :func:`constrain_drafts` walks each constrained sequence's
drafts through its grammar and returns, per sequence, the drafts to verify and the mask of
every verify row (the bonus row included). The matcher ends where it started; the step
commits what was accepted (:meth:`~xspec.grammar.Constraint.commit`).

The walk, position by position from the committed state:

1. **Forced tokens first.** Where the grammar admits one continuation (JSON punctuation,
   a schema's keys), the step proposes it without asking the drafter: q is one-hot at the
   forced token, whose masked target probability is 1, so it is accepted for certain. A
   forced run is drafted for any sequence, also one its depth policy left plain, up to
   the drafter's gamma (and the request's remaining budget): the run costs verify rows
   only, never a drafter forward.
2. **Then the drafter's proposals, masked.** Draft ``d_j`` was drawn from ``q_j``; the
   allowed set ``A`` at its row is known. If ``d_j`` is in ``A`` it stays, else it is
   redrawn from ``q_j`` restricted to ``A`` (the request's own generator). Either way
   ``d_j ~ q_j|A``, which is what the rejection sampler is given, so verification stays
   exact (it is exact for any proposal distribution that is the one drafts were drawn
   from). With a one-hot q (deterministic drafts, greedy requests) or ``q_j(A) = 0`` the
   walk stops: the draft would be rejected for certain.
3. **A stop token ends the walk** (the request ends there if it is accepted).

The masks come from the same walk, so a constrained sequence's verify rows cost one
mask computation each (tens of microseconds) beside the forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xspec.grammar import Constraint
from xspec.sampling import draw_uniforms, inverse_cdf


@dataclass
class ConstrainedDrafts:
    """One constrained sequence's drafts after the walk."""

    tokens: list[int]  # the drafts to verify
    probs: torch.Tensor | None  # [len(tokens), V] their q (one-hot rows for forced ones)
    masks: torch.Tensor  # [len(tokens) + 1, V] bool: the allowed set of every verify row
    forced: int  # how many of ``tokens`` the grammar forced (a prefix)


def constrain_drafts(
    constraint: Constraint,
    tokens: list[int],
    probs: torch.Tensor | None,
    cap: int,
    generator: torch.Generator | None,
) -> ConstrainedDrafts:
    """Walk one sequence's drafts (``tokens``, drawn from ``probs [n, V]`` or one-hot
    when None) through ``constraint``; at most ``cap`` drafts in all (see the module
    docstring). The constraint ends where it started."""
    forced = constraint.forced(cap)
    out: list[int] = []
    rows: list[torch.Tensor | None] = []  # q of each kept draft (None: one-hot)
    masks = [constraint.allowed()]
    stops = constraint.stop_ids
    for j in range(cap):
        mask = masks[-1]
        if j < len(forced):
            token, q = forced[j], None
        elif j < len(tokens):
            token = tokens[j]
            q = None if probs is None else probs[j]
            if q is not None:
                q = q * mask
                total = float(q.sum())
                if total <= 0.0:
                    break
                q = q / total
                if not mask[token]:  # redrawn from q|A (greedy: its argmax)
                    token = _redraw(q, generator)
            elif not mask[token]:
                break
        else:
            break
        if not 0 <= token < mask.numel() or not mask[token]:
            break
        out.append(token)
        rows.append(q)
        if token in stops:  # the request ends here if accepted: no row after it is read
            masks.append(mask)
            break
        constraint.push(token)
        masks.append(constraint.allowed())
    constraint.pop(sum(1 for t in out if t not in stops))
    q_out = None  # without the drafter's q every draft is one-hot, forced ones too
    if probs is not None:
        q_out = probs.new_zeros(len(out), probs.shape[-1])
        for j, (token, q) in enumerate(zip(out, rows)):
            if q is None:
                q_out[j, token] = 1.0
            else:
                q_out[j] = q
    return ConstrainedDrafts(out, q_out, torch.stack(masks), min(len(forced), len(out)))


def _redraw(q: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is None:
        return int(q.argmax())
    u = draw_uniforms([generator], [1], q.device)[:, 0]
    return int(inverse_cdf(q[None], u)[0])
