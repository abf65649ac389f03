"""The adaptive depth policy: how many tokens each request drafts and verifies, 0 to gamma.

:class:`AdaptiveDepth` (``spec.adaptive`` and/or ``spec.gamma_schedule``;
docs/adaptive.md) is the :class:`~xspec.spec.policy.DepthPolicy` the step asks:

1. the cap: gamma, or what ``spec.gamma_schedule`` gives this batch size (0 included),
   never more than a request's budget can commit;
2. ``decide``, before drafting, with ``spec.adaptive``: the depth ``d_r`` in
   ``[0, cap_r]`` that maximises the expected committed tokens per second of the step::

       value(d) = (R + sum_r sum_{j <= d_r} a_{r,j}) / seconds(R, rows = R + sum_r d_r,
                                                              drafting = #{r: d_r > 0})

   ``a_{r,j}`` the expected survival of draft j of request r (:mod:`.acceptance`), and
   ``seconds`` the online step-cost model (:mod:`.online`), in which the draft forward is
   its own term: a request given 0 does not draft, and a step where all get 0 runs no
   draft forward. The depth scan (:mod:`.scan`) answers the best step of each kind;
   whether the step drafts is then decided on their values, the drafting one corrected
   by what drafting steps really committed (:class:`~.acceptance.YieldCheck`) and taken
   only when :data:`PLAIN_MARGIN` ahead; a plain step is not taken on a regime's
   acceptance before it rests on :data:`MIN_EVIDENCE` request-steps, and now and then
   the other kind is explored to keep measuring it (:mod:`.explore`). Where drafting is
   cheap (a plain step costs more than :data:`CHEAP_DRAFTING` of a drafting one, by the
   online step-cost model), a request is not given 0 unless drafting loses even at
   the upper credible bound of its acceptance (:meth:`~.acceptance.AcceptanceModel.upper`),
   and a batch that steps plain there is offered drafts again on a geometric back-off
   (:class:`~.explore.Probes`);
3. ``trim``, after drafting, for a drafter with a confidence head: Algorithm 1
   (:func:`~.scan.schedule_rows`) trims each verified prefix within ``d_r``, from its
   confidences corrected per regime and position (:class:`~.acceptance.ConfidenceCorrection`);
4. ``observe``, after the step: the realised acceptance and the measured step time.

Lossless by construction: the depth is fixed before the drafts exist, from past steps
only; the trim is Algorithm 1's lossless scan; verification does not change.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from xspec.sampling import SamplingParams, regime_of
from xspec.spec.adaptive.acceptance import (
    AcceptanceHistory,
    AcceptanceModel,
    ConfidenceCorrection,
    YieldCheck,
)
from xspec.spec.adaptive.explore import EXPLORE_WIDE, Exploration, Probes
from xspec.spec.adaptive.online import OnlineStepCost, StepLine
from xspec.spec.adaptive.scan import Choice, revalued, scan_depths, schedule_rows
from xspec.spec.policy import DepthPolicy, PolicySeq

__all__ = [
    "CHEAP_DRAFTING",
    "MIN_EVIDENCE",
    "PLAIN_MARGIN",
    "RESCAN_EVERY",
    "AdaptiveDepth",
    "StepRecord",
    "gamma_for_batch",
]

RESCAN_EVERY = 8  # steps one scan's drafting option serves while the batch steps plain
MIN_EVIDENCE = 64  # request-steps of a regime's acceptance before plain may win on it
PLAIN_MARGIN = 0.03  # drafting is taken only when predicted this much ahead of plain
# drafting is cheap where a plain step costs more than this share of a drafting one: there
# a request goes plain only when drafting loses at its acceptance's upper bound
CHEAP_DRAFTING = 0.5


def _expected(conditional: Sequence[Sequence[float]], depths: Sequence[int]) -> float:
    """The expected accepted drafts of ``depths`` by the mean estimates: the survivals
    ``prod_{i<=j} c_i`` summed over each request's first ``d`` positions."""
    return sum(sum(itertools.accumulate(c[:d], operator.mul)) for c, d in zip(conditional, depths))


def gamma_for_batch(schedule: Sequence[Sequence[int]], batch: int) -> int:
    """``spec.gamma_schedule`` (``[[min_batch, gamma], ...]``, ascending, the first at
    batch 1; validated by :mod:`xspec.config`): the gamma of the last entry whose
    ``min_batch <= batch``."""
    gamma = schedule[0][1]
    for min_batch, g in schedule:
        if min_batch <= batch:
            gamma = g
    return gamma


@dataclass
class StepRecord:
    """What one step decided (for :meth:`AdaptiveDepth.learn` and the metrics)."""

    regimes: list[str]
    depths: list[int]  # decided before drafting
    expected: list[list[float]]  # [R][depth] pre-draft conditional acceptance estimates
    started: float = 0.0  # perf_counter at the decision
    accepted: float = math.nan  # the drafts expected accepted at ``depths`` (not corrected)
    raw: list[list[float]] | None = None  # [R][width] the draft's confidences (host)
    corrected: list[list[float]] | None = None  # [R][width] corrected: what the trim used
    line: StepLine | None = None  # the step-cost line the decision scanned (the trim's too)

    def predicted(self) -> torch.Tensor:
        """``[R, max depth]`` the conditional acceptance this step predicted per verified
        position: the corrected confidences when the draft scored its drafts, else the
        pre-draft estimates (0 beyond a request's depth)."""
        if self.corrected is not None:
            return torch.tensor(self.corrected, dtype=torch.float64)  # [R, width]
        width = max(self.depths, default=0)
        out = torch.zeros(len(self.depths), width, dtype=torch.float64)
        for b, row in enumerate(self.expected):
            if row:  # (a plain step has none: no tensor per request)
                out[b, : len(row)] = torch.tensor(row, dtype=torch.float64)
        return out


class AdaptiveDepth(DepthPolicy):
    """The adaptive decision (the module docstring): :meth:`decide` before drafting,
    :meth:`trim` after it, :meth:`observe` after the step; :meth:`depths` and
    :meth:`learn` are the same on plain per-request data. ``cost`` None: no adaptive
    decision (the gamma schedule alone); ``trim``: Algorithm 1 on the draft's
    confidences after drafting; ``synchronize`` (the platform's) makes the measured step
    time the device's; ``force(caps) -> depths`` replaces the decision (tests)."""

    def __init__(
        self,
        gamma: int,
        *,
        cost: OnlineStepCost | None = None,
        gamma_schedule: Sequence[Sequence[int]] | None = None,
        trim: bool = False,
        synchronize: Callable[[], None] = lambda: None,
        force: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.gamma = gamma
        self.cost = cost
        self.gamma_schedule = [list(e) for e in gamma_schedule] if gamma_schedule else None
        self.trim_enabled = trim and cost is not None
        self.synchronize = synchronize
        self.force = force
        self.acceptance = AcceptanceModel(gamma)
        self.correction = ConfidenceCorrection(gamma)
        self.yield_check = YieldCheck()
        self.exploration = Exploration(cost)
        self.probes = Probes()
        self._probed = False  # the last step drafted as a probe or an exploration
        # the last scan's best drafting option, its batch (caps, histories) and the steps
        # it has served (:data:`RESCAN_EVERY`); None after a step that verified drafts
        self._scanned: tuple[tuple[tuple[int, ...], tuple[int, ...]], Choice, int] | None = None
        self.last: StepRecord | None = None

    # -- the DepthPolicy the step asks --------------------------------------------------

    def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
        """:meth:`depths` for running sequences; a sequence's ``depth_state`` holds its
        :class:`AcceptanceHistory` (made here, at its first step)."""
        for s in seqs:
            if s.depth_state is None:
                s.depth_state = self.acceptance.new_history()
        return self.depths(
            [s.params for s in seqs],
            [s.depth_state for s in seqs],
            caps,
            regimes=[s.regime for s in seqs],
        )

    def observe(self, seqs: Sequence[PolicySeq], verified: list[int], accepted: list[int]) -> None:
        """:meth:`learn` from the step just taken (nothing before a decision)."""
        if self.last is not None:
            self.learn([s.depth_state for s in seqs], verified, accepted)

    def predicted(self, confidence: torch.Tensor | None) -> torch.Tensor | None:
        """What the trim went by (the corrected confidences), else the draft's own
        confidences, else the decision's pre-draft estimates."""
        last = self.last
        if last is not None and (last.corrected is not None or confidence is None):
            return last.predicted()
        return confidence

    def summary(self) -> dict[str, Any]:
        """The step-cost model's predicted vs measured step time (None without
        ``spec.adaptive``) and the yield check's factor."""
        return {
            "step_time": self.cost.summary() if self.cost is not None else None,
            "yield_check": self.yield_check.summary(),
        }

    def reset_report(self) -> None:
        """Start the predicted-vs-measured step-time report afresh (what was learnt stays)."""
        if self.cost is not None:
            self.cost.reset_report()

    # -- the decision on plain per-request data ----------------------------------------

    def caps(self, batch: int, budgets: Sequence[int]) -> list[int]:
        """Most drafts per request this step: gamma or the schedule's, within budget."""
        top = self.gamma
        if self.gamma_schedule is not None:
            top = min(top, gamma_for_batch(self.gamma_schedule, batch))
        return [max(0, min(top, b)) for b in budgets]

    def new_history(self) -> AcceptanceHistory:
        """A running request's acceptance history."""
        return self.acceptance.new_history()

    def depths(
        self,
        params: Sequence[SamplingParams],
        histories: Sequence[AcceptanceHistory | None],
        budgets: Sequence[int],
        *,
        regimes: Sequence[str] | None = None,
    ) -> list[int]:
        """Drafts per request for this step, before drafting, from each request's
        sampling, its acceptance history and ``budgets`` (the drafts it can still use);
        ``regimes``: each request's :func:`~xspec.sampling.regime_of` label, when the
        caller keeps them."""
        started = time.perf_counter()
        self._probed = False
        caps = self.caps(len(params), budgets)
        if regimes is None:
            labels: dict[SamplingParams, str] = {}
            regimes = [labels.get(p) or labels.setdefault(p, regime_of(p)) for p in params]
        regimes = list(regimes)
        rates = {g: self.acceptance.batch_rates(g) for g in set(regimes)}
        conditional: list[list[float]] | None = None  # [R][gamma], when the scan needs it
        accepted, line = math.nan, None
        if self.force is not None:
            depths = [max(0, min(d, c)) for d, c in zip(self.force(caps), caps)]
        elif self.cost is None or not any(caps):
            depths = caps
        else:
            R = len(caps)
            line = self.cost.line(R, R + sum(caps))
            depths, accepted, conditional = self._choose(caps, regimes, histories, rates, line)
        if conditional is None:  # only the drafting requests' (none, in a plain step)
            expected = [
                self.acceptance.conditional(g, h, rates[g])[:d] if d else []
                for g, h, d in zip(regimes, histories, depths)
            ]
        else:
            expected = [c[:d] for c, d in zip(conditional, depths)]
        self.last = StepRecord(regimes, depths, expected, started, accepted, line=line)
        return depths

    def _choose(
        self,
        caps: list[int],
        regimes: list[str],
        histories: Sequence[AcceptanceHistory | None],
        rates: dict[str, list[float]],
        line: StepLine,
    ) -> tuple[list[int], float, list[list[float]] | None]:
        """The depths of this step, their expected accepted drafts (NaN: not the scan's)
        and the conditional acceptance the scan read (None: none was read)."""
        R = len(caps)
        scanned, conditional = self._scan(caps, regimes, histories, rates, line)
        choice = self._checked(scanned, R)
        unsure = self._unsure(choice, regimes)
        explored = False
        if unsure is not None:  # plain, but on too little acceptance: those draft
            depths, accepted = unsure, math.nan
        else:
            explored = choice.other is not None and self.exploration.explore(R, choice)
            if explored:
                choice = choice.swapped()
            depths, accepted = choice.depths, choice.accepted
        self._probed = explored and any(depths)
        if not explored and self._cheap(caps, line):
            if conditional is None:  # the scan was revalued from an earlier one
                conditional = [
                    self.acceptance.conditional(g, h, rates[g]) for g, h in zip(regimes, histories)
                ]
            decided = depths
            depths, accepted = self._held(depths, accepted, caps, regimes, histories, rates, line)
            if not any(depths) and self.probes.due(R):  # the back-off's probe: all draft
                depths, self._probed = list(caps), True
            if depths is not decided:
                accepted = _expected(conditional, depths)
        if self.trim_enabled:  # the draft forward costs the same at any depth: a
            # drafting request drafts its cap, the trim picks the verified prefix
            depths = [c if d > 0 else 0 for d, c in zip(depths, caps)]
        return depths, accepted, conditional

    def _scan(
        self,
        caps: list[int],
        regimes: list[str],
        histories: Sequence[AcceptanceHistory | None],
        rates: dict[str, list[float]],
        line: StepLine,
    ) -> tuple[Choice, list[list[float]] | None]:
        """The depth scan of this step (:func:`~.scan.scan_depths`) and the conditional
        acceptance it read; while the same batch steps plain (nothing it learns from
        changes), the last scan's drafting option is revalued at this step's times
        instead, for up to :data:`RESCAN_EVERY` steps."""
        key = (tuple(caps), tuple(map(id, histories)))
        held = self._scanned
        if held is not None and held[0] == key and held[2] < RESCAN_EVERY:
            self._scanned = (key, held[1], held[2] + 1)
            return revalued(held[1], line), None
        conditional = [
            self.acceptance.conditional(g, h, rates[g]) for g, h in zip(regimes, histories)
        ]
        surv = [list(itertools.accumulate(c, operator.mul)) for c in conditional]
        scanned = scan_depths(surv, caps, line)
        self._scanned = (key, scanned if any(scanned.depths) else scanned.swapped(), 1)
        return scanned, conditional

    def _checked(self, choice: Choice, requests: int) -> Choice:
        """``choice`` with the drafting option's value corrected by :class:`YieldCheck`
        (times its factor) and by :data:`PLAIN_MARGIN` (divided by ``1 + margin``), and
        the plain / drafting decision made on the corrected values; the depths of each
        kind stay the scan's. Why the margin: a plain step commits exactly R tokens at
        what ``spec=none`` pays, while a drafting step's value rests on two estimates
        (the acceptance, the relative cost of drafting); near a tie drafting has little
        to win and much to lose."""
        if choice.other is None:
            return choice
        f = self.yield_check.factor(requests) / (1.0 + PLAIN_MARGIN)
        drafts = any(choice.depths)
        checked = replace(
            choice,
            value=choice.value * (f if drafts else 1.0),
            other_value=choice.other_value * (1.0 if drafts else f),
        )
        return checked.swapped() if checked.other_value > checked.value else checked

    def _cheap(self, caps: list[int], line: StepLine) -> bool:
        """Whether drafting is cheap at this batch: a plain step costs more than
        :data:`CHEAP_DRAFTING` of a step in which every request drafts its cap, by the
        online step-cost model (the profile as this machine runs it now)."""
        R = len(caps)
        return line(R, 0) > CHEAP_DRAFTING * line(R + sum(caps), sum(c > 0 for c in caps))

    def _held(
        self,
        depths: list[int],
        accepted: float,
        caps: list[int],
        regimes: list[str],
        histories: Sequence[AcceptanceHistory | None],
        rates: dict[str, list[float]],
        line: StepLine,
    ) -> tuple[list[int], float]:
        """Where drafting is cheap: ``depths`` with every request that could draft but
        was given 0 drafting after all, unless drafting loses even at the upper credible
        bound of the requests' acceptance (:meth:`AcceptanceModel.upper`, the depth scan
        on it: its drafting option's value, times the yield check's factor and less
        :data:`PLAIN_MARGIN`, against the plain step's). Why: a few unlucky steps lower
        a request's mean estimate enough to lose to plain where a plain step costs half
        a drafting one or more, and a plain request learns nothing more."""
        if all(d > 0 for d, c in zip(depths, caps) if c > 0):
            return depths, accepted
        upper = [self.acceptance.upper(g, h, rates[g]) for g, h in zip(regimes, histories)]
        surv = [list(itertools.accumulate(c, operator.mul)) for c in upper]
        bound = scan_depths(surv, caps, line)
        if bound.other is None:
            return depths, accepted
        drafting, plain = (
            (bound, bound.other_value)
            if any(bound.depths)
            else (
                bound.swapped(),
                bound.value,
            )
        )
        f = self.yield_check.factor(len(caps)) / (1.0 + PLAIN_MARGIN)
        if drafting.value * f <= plain:
            return depths, accepted  # drafting loses even so
        return [max(d, b) for d, b in zip(depths, drafting.depths)], accepted

    def _unsure(self, choice: Choice, regimes: Sequence[str]) -> list[int] | None:
        """When a plain ``choice`` rests on too little acceptance to stop drafting, the
        depths that draft anyway (else None): its drafting option's, for the requests
        whose regime has fewer than :data:`MIN_EVIDENCE` request-steps of realised
        acceptance (:meth:`AcceptanceModel.evidence`), while that option is predicted
        within :data:`~.explore.EXPLORE_WIDE` of plain. Why: a plain step verifies
        nothing, so an estimate that turned the steps plain would not change until a
        re-exploration; a regime's evidence only grows, so this costs a bounded few
        drafting steps per regime and process."""
        drafts = choice.other
        if drafts is None or any(choice.depths):
            return None
        if choice.other_value < (1.0 - EXPLORE_WIDE) * choice.value:
            return None  # far behind: the acceptance would have to be off by 2x
        depths = [
            d if d > 0 and self.acceptance.evidence(g) < MIN_EVIDENCE else 0
            for d, g in zip(drafts, regimes)
        ]
        return depths if any(depths) else None

    def trim(self, confidence: torch.Tensor, depths: list[int]) -> list[int]:
        """After drafting: Algorithm 1 within ``depths`` on the corrected confidences
        ``[R, width]`` -> verified drafts per request (``depths`` when the trim is off)."""
        if not self.trim_enabled:
            return depths
        last = self.last
        assert last is not None and self.cost is not None
        last.raw = confidence.detach().to("cpu", torch.float64).tolist()  # one host copy
        last.corrected = self.correction.apply(last.raw, last.regimes)  # [R][width]
        drafting = sum(d > 0 for d in depths)
        R, line = len(depths), last.line  # nothing was learnt since the decision
        if line is None or line.requests != R:
            line = self.cost.line(R, R + sum(depths))
        return schedule_rows(last.corrected, depths, line.sps(drafting))

    def learn(
        self,
        histories: Sequence[AcceptanceHistory | None],
        verified: Sequence[int],
        accepted: Sequence[int],
        seconds: float | None = None,
    ) -> None:
        """After the step: the realised acceptance per request and the step's time
        (``seconds``; None: measured, from the decision to now, after the platform's
        synchronize; given: a simulated machine's)."""
        rec = self.last
        assert rec is not None
        if self.cost is not None:
            if seconds is None:
                self.synchronize()
                seconds = time.perf_counter() - rec.started
            drafting = sum(d > 0 for d in rec.depths)
            R = len(verified)
            self.cost.update(R, R + sum(verified), drafting, seconds, rec.line)
            self.exploration.observe(drafting > 0, R)
            self.probes.observe(R, drafting > 0, self._probed)
            if drafting and math.isfinite(rec.accepted):
                self.yield_check.observe(R, rec.accepted, sum(accepted))
        if any(verified):  # the acceptance estimates moved: the next step scans afresh
            self._scanned = None
        raw = rec.raw  # [R][width] host rows (the trim's), or None
        for b, history in enumerate(histories):
            self.acceptance.observe(rec.regimes[b], history, verified[b], accepted[b])
            if raw is not None and verified[b]:
                self.correction.observe(rec.regimes[b], raw[b], verified[b], accepted[b])
