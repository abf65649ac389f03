"""Speculation under a grammar: drafts the grammar allows, masks on every verify row.

A request with a :class:`~xspec.grammar.Constraint` samples from the target's
distribution masked by the grammar state its prefix reached. Under speculation that
state differs row by row: the row that scores draft position j has seen ``d_1 .. d_(j-1)``.
Each step walks every constrained sequence's draft path through its grammar and hands
the verifier the drafts, their q, and the mask of every verify row (the bonus row
included). The matcher ends where it started; the step commits what was accepted
(:meth:`~xspec.grammar.Constraint.commit`).

Three walks, one per way the drafter proposes (the step picks by
``Drafter.masks_inside`` and ``Drafter.mask_drafts``, i.e. ``spec.mask_drafts``):

* **Inside the drafter** (MTP, DSpark, DFlash; :class:`DraftGuide`). The drafter gets a
  guide per constrained request and, position by position, masks its logits to the
  allowed set at the path so far before the request's temperature / top-k / top-p
  (:func:`guided_logits`), samples, and pushes the draft (:func:`advance`); the next
  position conditions on that draft (MTP's next forward, DSpark's Markov head). Where the
  grammar forces tokens (JSON punctuation, a schema's keys: llguidance's forced run from
  the committed state, and any position that admits one token) the mask is one-hot: the
  draft is that token with q one-hot, and the drafter still conditions on it. So a block
  never holds a token the grammar forbids, and q is exactly what each draft was drawn
  from. :meth:`DraftGuide.finish` then keeps the prefix the depth policy verifies and
  appends the tokens the grammar forces after it (free: they cost verify rows only), up
  to the request's cap.
* **After the drafter** (drafters that do not mask, e.g. the test drafters;
  :func:`constrain_drafts` with ``redraw``). Forced tokens first, then the drafter's
  ``d_j`` kept if allowed, else redrawn from ``q_j`` restricted to the allowed set
  (``d_j ~ q_j|A`` either way, which the verifier is given). With a one-hot q (greedy) or
  ``q_j(A) = 0`` a forbidden draft ends the walk.
* **Unmasked** (``spec.mask_drafts=false``, :func:`constrain_drafts` without ``redraw``):
  the drafter's drafts and q as proposed, as engines that draft without the grammar do;
  the first draft the grammar forbids is verified (masked target probability 0: rejected
  for certain, the correction comes from the residual) and ends the walk.

Every walk is exact: rejection sampling reproduces the masked target for any proposal
whose distribution it is told. Forced runs are drafted for any sequence, also one its
depth policy left plain, up to the drafter's gamma and the request's remaining budget;
the depth policy observes only the drafter's own drafts (``forced_at``). A stop token
ends a walk (the request ends there if it is accepted).

:data:`GRAMMAR_CLOCK` adds up the host time a process spends on grammar work under
speculation (the walks here, the drafters' masking, the step's verify-row masks and
commits), for benchmarks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from xspec.grammar import Constraint
from xspec.sampling import draw_uniforms, inverse_cdf


class GrammarClock:
    """Host time spent walking grammars and building masks: wall ``seconds`` and the
    process's ``cpu_seconds`` (read and reset by benchmarks)."""

    def __init__(self) -> None:
        self.seconds = self.cpu_seconds = 0.0
        self._depth = 0  # nested timings count once, in the outermost

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = 0.0

    @contextmanager
    def timing(self) -> Iterator[None]:
        self._depth += 1
        t, c = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.seconds += time.perf_counter() - t
                self.cpu_seconds += time.process_time() - c


GRAMMAR_CLOCK = GrammarClock()


@dataclass
class ConstrainedDrafts:
    """One constrained sequence's drafts after the walk."""

    tokens: list[int]  # the drafts to verify
    probs: torch.Tensor | None  # [len(tokens), V] their q (one-hot rows for forced ones)
    masks: torch.Tensor  # [len(tokens) + 1, V] bool: the allowed set of every verify row
    forced_at: list[bool]  # [len(tokens)]: the grammar forced it (not the drafter's draft)

    @property
    def forced(self) -> int:
        """How many of ``tokens`` the grammar forced."""
        return sum(self.forced_at)


class DraftGuide:
    """One constrained request's grammar, walked by its drafter position by position.

    ``cap``: the most drafts the step verifies for it (gamma within its budget). The
    drafter reads :meth:`mask` (through :func:`guided_logits`) and calls :meth:`push`
    (through :func:`advance`) at each position while :attr:`active`; the step then calls
    :meth:`finish`, which leaves the constraint where it started.
    """

    def __init__(self, constraint: Constraint, cap: int) -> None:
        self.constraint, self.cap = constraint, cap
        self.tokens: list[int] = []
        self.masks: list[torch.Tensor] = []  # [V] bool: the allowed set after tokens[:j]
        self._pushed = 0  # tokens pushed into the matcher (a stop token is not)
        with GRAMMAR_CLOCK.timing():
            self._run = constraint.forced(cap)  # forced from the committed state
            self.masks.append(constraint.allowed())

    @property
    def active(self) -> bool:
        """It takes another draft: under its cap and not past a stop token."""
        ended = bool(self.tokens) and self.tokens[-1] in self.constraint.stop_ids
        return len(self.tokens) < self.cap and not ended

    def mask(self) -> torch.Tensor:
        """[V] bool: what the next draft may be (one-hot within the forced run)."""
        j = len(self.tokens)
        if j < len(self._run):
            only = torch.zeros_like(self.masks[-1])
            only[self._run[j]] = True
            return only
        return self.masks[-1]

    def push(self, token: int) -> None:
        """Take ``token`` as the next draft (the drafter sampled it under :meth:`mask`)."""
        if not self.active:
            return
        with GRAMMAR_CLOCK.timing():
            if not (0 <= token < self.masks[-1].numel() and bool(self.mask()[token])):
                self.cap = len(self.tokens)  # cannot happen under the mask; end the walk
                return
            self.tokens.append(token)
            if token in self.constraint.stop_ids:  # the request ends here if accepted
                self.masks.append(self.masks[-1])
                return
            self.constraint.push(token)
            self._pushed += 1
            self.masks.append(self.constraint.allowed())

    def finish(self, kept: int, probs: torch.Tensor | None) -> ConstrainedDrafts:
        """The walk's result: the first ``kept`` drafts (the prefix the policy verifies;
        their q ``probs [>= kept, V]``, or None: one-hot), then the tokens the grammar
        forces after them, up to the cap. The constraint ends where it started."""
        with GRAMMAR_CLOCK.timing():
            self._truncate(min(kept, len(self.tokens)))
            drafted = len(self.tokens)
            run_len = min(len(self._run), drafted)
            forced_at = [j < run_len for j in range(drafted)]
            if self.active:
                self._run = []  # the tail: checked against the allowed set as it is pushed
                for token in self.constraint.forced(self.cap - drafted):
                    self.push(token)
                forced_at += [True] * (len(self.tokens) - drafted)
            self.constraint.pop(self._pushed)
            q = None
            if probs is not None:
                q = probs.new_zeros(len(self.tokens), probs.shape[-1])
                q[:drafted] = probs[:drafted]
                tail = torch.tensor(self.tokens[drafted:], dtype=torch.long)
                q[torch.arange(drafted, len(self.tokens)), tail.to(q.device)] = 1.0
            return ConstrainedDrafts(list(self.tokens), q, torch.stack(self.masks), forced_at)

    def _truncate(self, n: int) -> None:
        gone = [t for t in self.tokens[n:] if t not in self.constraint.stop_ids]
        self.constraint.pop(len(gone))
        self._pushed -= len(gone)
        del self.tokens[n:], self.masks[n + 1 :]


def guided_logits(guides: Sequence[DraftGuide | None], logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` of one draft position with each active guide's row set to -inf
    where its grammar forbids the next draft (before the request's temperature / top-k /
    top-p, as the verify rows are); rows without an active guide unchanged."""
    rows = [(b, g) for b, g in enumerate(guides) if g is not None and g.active]
    if not rows:
        return logits
    with GRAMMAR_CLOCK.timing():
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # [B, V] on the host
        for b, g in rows:
            allowed[b] = g.mask()
        allowed = allowed.to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))


def advance(guides: Sequence[DraftGuide | None], tokens: torch.Tensor) -> None:
    """Push each guided request's draft ``tokens [B]`` (one host read)."""
    if any(g is not None and g.active for g in guides):
        for g, token in zip(guides, tokens.tolist()):
            if g is not None:
                g.push(token)


def constrain_drafts(
    constraint: Constraint,
    tokens: list[int],
    probs: torch.Tensor | None,
    cap: int,
    generator: torch.Generator | None,
    redraw: bool = True,
) -> ConstrainedDrafts:
    """Walk one sequence's drafts (``tokens``, drawn from ``probs [n, V]`` or one-hot
    when None) through ``constraint`` after the drafter proposed them; at most ``cap``
    drafts in all. ``redraw``: a forbidden draft is redrawn from q restricted to the
    allowed set; else it is kept unmasked and ends the walk (the module docstring). The
    constraint ends where it started."""
    with GRAMMAR_CLOCK.timing():
        forced = constraint.forced(cap)
        out: list[int] = []
        rows: list[torch.Tensor | None] = []  # q of each kept draft (None: one-hot)
        masks = [constraint.allowed()]
        stops = constraint.stop_ids
        pushed = 0
        for j in range(cap):
            mask = masks[-1]
            if j < len(forced):
                token, q = forced[j], None
            elif j < len(tokens):
                token = tokens[j]
                q = None if probs is None else probs[j]
                if not redraw:
                    if q is not None and not mask[token]:  # verified: rejected for certain
                        out.append(token)
                        rows.append(q)
                        masks.append(mask)
                        break
                elif q is not None:
                    q = q * mask
                    total = float(q.sum())
                    if total <= 0.0:
                        break
                    q = q / total
                    if not mask[token]:  # redrawn from q|A (greedy: its argmax)
                        token = _redraw(q, generator)
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
            pushed += 1
            masks.append(constraint.allowed())
        constraint.pop(pushed)
    q_out = None  # without the drafter's q every draft is one-hot, forced ones too
    if probs is not None:
        q_out = probs.new_zeros(len(out), probs.shape[-1])
        for j, (token, q) in enumerate(zip(out, rows)):
            if q is None:
                q_out[j, token] = 1.0
            else:
                q_out[j] = q
    n_forced = min(len(forced), len(out))
    return ConstrainedDrafts(
        out, q_out, torch.stack(masks), [j < n_forced for j in range(len(out))]
    )


def _redraw(q: torch.Tensor, generator: torch.Generator | None) -> int:
    if generator is None:
        return int(q.argmax())
    u = draw_uniforms([generator], [1], q.device)[:, 0]
    return int(inverse_cdf(q[None], u)[0])
