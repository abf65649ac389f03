"""How many tokens each request drafts and verifies this step, from 0 up to gamma.

One decision per step, per request, made **before drafting** by :class:`Speculation`
(``spec.adaptive`` and/or ``spec.gamma_schedule``; docs/adaptive.md):

1. the cap: ``gamma``, or what ``spec.gamma_schedule`` gives this batch size (0 included),
   and never more than a request's budget can commit;
2. with ``spec.adaptive``, the depth ``d_r`` in ``[0, cap_r]`` that maximises the expected
   committed tokens per second of the whole step::

       value(d) = (R + sum_r sum_{j <= d_r} a_{r,j}) / seconds(R, rows = R + sum_r d_r,
                                                              drafting = #{r: d_r > 0})

   ``a_{r,j}`` the expected survival of draft j of request r, from the acceptance it
   realised so far (:class:`AcceptanceModel`: per position, per request, blended with
   its sampling regime's batch figures), and ``seconds`` the online step-cost model
   (:class:`~xspec.spec.schedule.OnlineStepCost`), in which the draft forward is its own
   term: a request given 0 does not draft, and a step where every request gets 0 runs no
   draft forward at all (a plain decode step). Candidates ``(r, j)`` are taken in
   descending ``a_{r,j}`` and the best prefix of that order wins (an exhaustive scan of
   the order: nothing in it depends on this step's drafts);
   whether the step drafts at all is then decided on the two values, the drafting
   one's tokens corrected by what drafting steps really committed (:class:`YieldCheck`:
   the acceptance the model learns comes from the positions the trim kept, the
   confident ones), drafting only when that is :data:`PLAIN_MARGIN` ahead of plain
   (a plain step is what ``spec=none`` pays: the sure option near a tie), and a plain
   step is not taken on a regime's acceptance before it rests on :data:`MIN_EVIDENCE`
   request-steps (:meth:`Speculation._unsure`). The seconds of each kind come from
   one model that keeps the machine's speed (common to both kinds, followed at every
   step) apart from the relative cost of drafting (learnt only from steps of both
   kinds close together, so a slow or fast spell does not move it): near the
   crossover, a speed learnt for each kind from its own steps flipped the choice
   whenever the kind not taken had last been measured in another spell;
3. after drafting, a drafter with a confidence head has Algorithm 1
   (:func:`~xspec.spec.schedule.schedule_verify`) trim each request's verified prefix
   within ``d_r``, from its confidences, corrected per position by the realised
   acceptance of its sampling regime (:class:`ConfidenceCorrection`).

Lossless by construction: the depth is fixed before the drafts exist, from past steps
only; Algorithm 1's trim is the lossless scan it always was; verification and rejection
sampling do not change. After the step, :meth:`Speculation.observe` takes in the realised
acceptance and the measured step time.
"""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from xspec.sampling import SamplingParams, regime_of
from xspec.spec.schedule import (
    SMALL_SCAN,
    OnlineStepCost,
    StepLine,
    batch_bucket,
    schedule_rows,
)

__all__ = [
    "AcceptanceHistory",
    "AcceptanceModel",
    "Choice",
    "ConfidenceCorrection",
    "Speculation",
    "StepKinds",
    "YieldCheck",
    "batch_bucket",
    "choose_depths",
    "gamma_for_batch",
    "scan_depths",
]

PRIOR_ACCEPTANCE = 0.7  # per-position acceptance assumed before anything was verified
EXPLORE_RUN = 2  # consecutive steps an exploration takes (a contrast needs a second)
EXPLORE_STEPS = 2 * EXPLORE_RUN  # steps of each kind per batch-size bucket wanted
EXPLORE_EVERY = 32  # and once again after at least this many steps of a bucket without it
EXPLORE_BUDGET = 0.0025  # ... and gap / this many: re-exploring costs this, by the model
EXPLORE_WIDE = 0.5  # ... when the other kind is predicted within this of the best (the gap)
GAP_DECAY = 0.9  # ... the gap as an EMA over the bucket's steps (one request's dip is not it)
RESCAN_EVERY = 8  # steps one scan's drafting option serves while the batch steps plain
MIN_EVIDENCE = 64  # request-steps of a regime's acceptance before plain may win on it
PLAIN_MARGIN = 0.03  # drafting is taken only when predicted this much ahead of plain
YIELD_PRIOR_STEPS = 8.0  # YieldCheck: steps' worth of "the model is right", always


def gamma_for_batch(schedule: Sequence[Sequence[int]], batch: int) -> int:
    """``spec.gamma_schedule`` (``[[min_batch, gamma], ...]``, ascending, the first at
    batch 1; validated by :mod:`xspec.config`): the gamma of the last entry whose
    ``min_batch <= batch``."""
    gamma = schedule[0][1]
    for min_batch, g in schedule:
        if min_batch <= batch:
            gamma = g
    return gamma


class _Decayed:
    """Decayed per-position counts: how often position j was reached (its draft
    verified with every earlier draft accepted) and how often it was accepted, or, for
    the confidence correction, its predicted conditional acceptance. Both are ``scale``
    times the lists: :meth:`age` (a step that reached no position, decaying every count)
    multiplies ``scale`` alone, so a request's plain steps cost no list each (32 of them
    per step at 32 requests, where plain steps are the rule)."""

    def __init__(self, gamma: int, decay: float) -> None:
        self.decay = decay
        self.reached = [0.0] * gamma
        self.hits = [0.0] * gamma
        self.scale = 1.0

    def age(self) -> None:
        """One step that reached no position: every count decays."""
        self.scale *= self.decay

    def add(self, hits: Sequence[float]) -> None:
        """One request-step: positions ``0 .. len(hits) - 1`` reached, ``hits[j]`` each."""
        if self.scale != 1.0:  # the ageing held back, applied before counting
            f = self.scale
            self.reached = [f * x for x in self.reached]
            self.hits = [f * x for x in self.hits]
            self.scale = 1.0
        decay, reached, total = self.decay, self.reached, self.hits
        for j, hit in enumerate(hits):
            reached[j] = decay * reached[j] + 1.0
            total[j] = decay * total[j] + hit


def _accepted(verified: int, accepted: int) -> tuple[float, ...]:
    """The hits of a request-step that verified ``verified`` drafts and accepted the first
    ``accepted``: 1 for each accepted position, 0 for the rejected one (when one was);
    later positions were not reached (their earlier drafts were not all accepted)."""
    return (1.0,) * accepted + (0.0,) * (min(verified, accepted + 1) - accepted)


@dataclass
class AcceptanceHistory:
    """One request's realised acceptance per draft position (kept on its RunningSeq)."""

    counts: _Decayed


class AcceptanceModel:
    """Expected survival of each draft position before drafting: per sampling regime, the
    batch's realised conditional acceptance per position (decayed counts, prior
    :data:`PRIOR_ACCEPTANCE`), and per request its own, shrunk towards its regime's by
    ``request_weight`` pseudo-observations.

    The request's counts decay by ``request_decay`` (about 10 request-steps), so with 3
    pseudo-observations (until 2026-12-05) a few unlucky steps outweighed its regime: at
    one request and T=0.8 the drafting option fell below plain's value, and plain steps
    verify nothing, so it stayed there until the counts aged (in one process, seeds
    610 and 612: 25 and 22 plain steps of 138 and 136, where 10 pseudo-observations
    took 3 and 6 plain steps of 123 and 122; at 8 and 16 requests the same steps either
    way). In the benchmark (seeds 608-615, one request, T=0.8) adaptive took 990 decode
    steps against 1016 (fixed gamma: 962), and greedy stayed at fixed gamma's speed."""

    def __init__(
        self,
        gamma: int,
        *,
        batch_decay: float = 0.995,
        request_decay: float = 0.9,
        prior_weight: float = 4.0,
        request_weight: float = 10.0,
    ) -> None:
        self.gamma = gamma
        self.batch_decay, self.request_decay = batch_decay, request_decay
        self.prior_weight, self.request_weight = prior_weight, request_weight
        self.regimes: dict[str, _Decayed] = {}

    def new_history(self) -> AcceptanceHistory:
        return AcceptanceHistory(_Decayed(self.gamma, self.request_decay))

    def batch_rates(self, regime: str) -> list[float]:
        """The regime's conditional acceptance per position, over every request."""
        batch = self.regimes.get(regime)
        if batch is None:
            return [PRIOR_ACCEPTANCE] * self.gamma
        w, prior = self.prior_weight, PRIOR_ACCEPTANCE
        return [(h + w * prior) / (r + w) for h, r in zip(batch.hits, batch.reached)]

    def evidence(self, regime: str) -> float:
        """The regime's request-steps that verified a draft (decayed counts)."""
        batch = self.regimes.get(regime)
        return 0.0 if batch is None else batch.reached[0]

    def conditional(
        self, regime: str, history: AcceptanceHistory | None, batch: list[float] | None = None
    ) -> list[float]:
        """``c_j`` per position: P(draft j accepted | drafts < j accepted). ``batch``: the
        regime's :meth:`batch_rates`, when the caller has them already."""
        rates = self.batch_rates(regime) if batch is None else batch
        if history is None:
            return rates
        w, c = self.request_weight, history.counts
        f = c.scale  # the ageing since its last count (1.0: none)
        return [(f * h + w * b) / (f * r + w) for h, r, b in zip(c.hits, c.reached, rates)]

    def survivals(self, regime: str, history: AcceptanceHistory | None) -> list[float]:
        """``a_j = prod_{i<=j} c_i``: expected accepted tokens of verifying draft j."""
        return list(itertools.accumulate(self.conditional(regime, history), operator.mul))

    def observe(
        self, regime: str, history: AcceptanceHistory | None, verified: int, accepted: int
    ) -> None:
        """One request-step: ``verified`` drafts scored, the first ``accepted`` accepted.
        A step that verified nothing still ages the request's own counts, so its estimate
        drifts back to its regime's: a request that stopped drafting after a bad spell
        would otherwise keep its bad estimate for good (it never drafts again to learn
        better), which at concurrency 1 costs the whole rest of the request."""
        if verified == 0:
            if history is not None:
                history.counts.age()
            return
        batch = self.regimes.get(regime) or self.regimes.setdefault(
            regime, _Decayed(self.gamma, self.batch_decay)
        )  # (not setdefault alone: its default is built on every call)
        hits = _accepted(verified, accepted)
        batch.add(hits)
        if history is not None:
            history.counts.add(hits)


class ConfidenceCorrection:
    """Per sampling regime and draft position, the ratio of realised to predicted
    conditional acceptance (decayed sums, shrunk to 1 by ``weight`` pseudo-rows);
    :meth:`apply` multiplies each confidence by its position's ratio (clipped to
    ``[0, 1]``). It corrects a calibration fitted elsewhere (or none) from what this
    run's drafts really do. Scaling a position by one factor keeps the order of its
    confidences; the factor comes from earlier steps only."""

    def __init__(self, gamma: int, *, decay: float = 0.995, weight: float = 20.0) -> None:
        self.gamma, self.decay, self.weight = gamma, decay, weight
        self.predicted: dict[str, _Decayed] = {}  # hits = sum of predicted c_j
        self.realised: dict[str, _Decayed] = {}  # hits = accepted

    def factors(self, regime: str) -> list[float]:
        pred, real = self.predicted.get(regime), self.realised.get(regime)
        if pred is None or real is None:
            return [1.0] * self.gamma
        return [
            (real.hits[j] + self.weight) / (pred.hits[j] + self.weight) for j in range(self.gamma)
        ]

    def apply(self, confidence: list[list[float]], regimes: Sequence[str]) -> list[list[float]]:
        """``confidence [B][G]`` (host rows) -> corrected ``[B][G]``: float64 products,
        clamped. Lists, not tensors: at a step's few rows the tensor ops cost 2x."""
        table = {r: self.factors(r) for r in set(regimes)}
        return [
            [min(max(c * f, 0.0), 1.0) for c, f in zip(row, table[r])]
            for row, r in zip(confidence, regimes)
        ]

    def observe(
        self, regime: str, confidence: Sequence[float], verified: int, accepted: int
    ) -> None:
        """One request-step: the draft's (uncorrected) ``confidence`` per verified position."""
        pred, real = self.predicted.get(regime), self.realised.get(regime)
        if pred is None or real is None:
            pred = self.predicted[regime] = _Decayed(self.gamma, self.decay)
            real = self.realised[regime] = _Decayed(self.gamma, self.decay)
        hits = _accepted(verified, accepted)
        real.add(hits)
        pred.add(confidence[: len(hits)])


class _Ratio:
    """Decayed sums of realised and expected committed tokens (and of the steps) whose
    ratio is the factor."""

    __slots__ = ("expected", "n", "realised")

    def __init__(self) -> None:
        self.n, self.realised, self.expected = 0.0, 0.0, 0.0

    def add(self, realised: float, expected: float, decay: float) -> None:
        self.n = decay * self.n + 1.0
        self.realised = decay * self.realised + realised
        self.expected = decay * self.expected + expected

    def shrunk(self, prior: float) -> float:
        """The ratio shrunk to ``prior`` by :data:`YIELD_PRIOR_STEPS` pseudo-steps."""
        if self.expected <= 0:
            return prior
        w = YIELD_PRIOR_STEPS
        return (self.n * self.realised / self.expected + w * prior) / (self.n + w)


class YieldCheck:
    """How many tokens drafting steps really committed against what the decision expected
    of them: per batch-size bucket (:func:`batch_bucket`), the ratio of decayed sums
    (``decay`` per step) of realised and expected committed tokens, ``R + accepted`` and
    ``R + expected accepted``, with the expectation of the depths the decision chose
    (before the trim). The decision multiplies a drafting option's value (its tokens) by
    it. A plain step commits exactly R tokens: it has nothing to check.

    What it corrects is the acceptance model's bias, not the machine's: the acceptance
    it learns comes from the positions the trim kept (the confident ones), so it
    expects more of the deeper positions than they deliver. A ratio of tokens has no
    seconds in it, so a slow or fast spell does not move it (the step-time side, where
    the speed moves, is the cost model's: :class:`~xspec.spec.schedule.OnlineStepCost`).

    It is shrunk hard (:data:`YIELD_PRIOR_STEPS` pseudo-steps of "the model is right"):
    a bias shows over many steps, while a few unlucky ones are luck the acceptance model
    has already taken in. With 2 pseudo-steps, the first two drafting steps of a fresh
    process at one request (1 and 0 drafts accepted, greedy) put it at 0.77 on top of
    the acceptance model's own drop, and the steps went plain for 30 steps where drafting
    made 2.4x their value. The factors are hierarchical: the overall ratio shrunk to 1,
    a bucket's to the overall one."""

    def __init__(self, decay: float = 0.95) -> None:
        self.decay = decay
        self._overall = _Ratio()
        self._bucket: dict[int, _Ratio] = {}

    def factor(self, requests: int | None = None) -> float:
        """The factor (of a batch of ``requests``: its bucket's)."""
        overall = self._overall.shrunk(1.0)
        if requests is None:
            return overall
        bucket = self._bucket.get(batch_bucket(requests))
        return overall if bucket is None else bucket.shrunk(overall)

    def observe(self, requests: int, expected: float, accepted: int) -> None:
        """One drafting step of ``requests`` requests: ``expected`` accepted drafts (the
        decision's), ``accepted`` realised."""
        realised, wanted = requests + accepted, requests + expected
        self._overall.add(realised, wanted, self.decay)
        self._bucket.setdefault(batch_bucket(requests), _Ratio()).add(realised, wanted, self.decay)

    def summary(self) -> dict[str, float]:
        return {"yield_factor": self.factor()}


class StepKinds:
    """Per batch-size bucket and kind of step (plain, drafting): how many steps took it,
    and how many steps of the bucket have gone by since it was last taken (what the
    exploration of :class:`Speculation` decides on)."""

    def __init__(self) -> None:
        self._steps: dict[tuple[int, bool], int] = {}
        self._since: dict[tuple[int, bool], int] = {}

    def steps(self, drafting: bool, requests: int) -> int:
        """Steps of this kind taken in the bucket of ``requests``."""
        return self._steps.get((batch_bucket(requests), drafting), 0)

    def since(self, drafting: bool, requests: int) -> int:
        """Steps of the bucket of ``requests`` since this kind of step was last taken."""
        return self._since.get((batch_bucket(requests), drafting), 0)

    def observe(self, drafting: bool, requests: int) -> None:
        key, other = (batch_bucket(requests), drafting), (batch_bucket(requests), not drafting)
        self._steps[key] = self._steps.get(key, 0) + 1
        self._since[key] = 0
        self._since[other] = self._since.get(other, 0) + 1


@dataclass(frozen=True)
class Choice:
    """:func:`scan_depths`'s answer: the best depths, its value (expected committed
    tokens per second), expected accepted drafts and predicted seconds, and the same of
    the best of the other kind of step (a plain step when the best drafts, the best
    drafting step when the best is plain; None: there is none)."""

    depths: list[int]
    value: float
    other: list[int] | None
    other_value: float
    accepted: float = 0.0
    other_accepted: float = 0.0
    seconds: float = 0.0
    other_seconds: float = 0.0

    def swapped(self) -> Choice:
        """The other kind of step as the choice (``other`` must not be None)."""
        assert self.other is not None
        return Choice(
            self.other,
            self.other_value,
            self.depths,
            self.value,
            self.other_accepted,
            self.accepted,
            self.other_seconds,
            self.seconds,
        )


def scan_depths(
    survivals: Sequence[Sequence[float]], caps: Sequence[int], seconds: StepLine
) -> Choice:
    """The depth per request that maximises expected committed tokens per second
    (module docstring): ``survivals[r][j]`` non-increasing in j, ``caps[r]`` its most,
    ``seconds`` the predicted step time of this step's R requests (its ``max_rows`` at
    least ``R + sum(caps)``). Vectorised over the candidates: a few small tensor ops."""
    R = len(caps)
    plain_s = seconds(R, 0)
    if not any(caps):
        return Choice([0] * R, R / plain_s, None, 0.0, seconds=plain_s)
    if sum(caps) <= SMALL_SCAN:  # a few candidates: plain Python beats tensor ops
        return _scan_small(survivals, caps, seconds, plain_s)
    G = max(caps)
    a = torch.tensor([[*s[:G], *[0.0] * (G - len(s[:G]))] for s in survivals], dtype=torch.float64)
    # candidates in position-major order (j, then r): a stable sort by -a breaks ties by
    # position, then request
    pos = torch.arange(G).repeat_interleave(R)  # [G*R]
    req = torch.arange(R).repeat(G)  # [G*R]
    allowed = pos < torch.tensor(list(caps), dtype=torch.long)[req]
    pos, req, cand = pos[allowed], req[allowed], a.t().reshape(-1)[allowed]
    order = torch.sort(-cand, stable=True).indices
    pos, req, cand = pos[order], req[order], cand[order]
    K = int(cand.shape[0])
    tau = R + cand.cumsum(0)  # [K] expected committed tokens of each prefix
    rows = R + torch.arange(1, K + 1)  # [K]
    drafting = (pos == 0).long().cumsum(0)  # a request's first candidate is its position 0
    secs = seconds.many(rows, drafting)  # [K]
    value = tau / secs
    best = int(value.argmax())  # the first of equal maxima: the shorter prefix
    depths = [0] * R
    for r, j in zip(req[: best + 1].tolist(), pos[: best + 1].tolist()):
        depths[r] = max(depths[r], j + 1)
    best_step = Choice(
        depths, float(value[best]), None, 0.0, float(tau[best]) - R, seconds=float(secs[best])
    )
    return _against_plain(best_step, plain_s)


def _scan_small(
    survivals: Sequence[Sequence[float]], caps: Sequence[int], seconds: StepLine, plain_s: float
) -> Choice:
    """:func:`scan_depths` in plain Python (the same order, the same answer)."""
    R = len(caps)
    cand = sorted((-survivals[r][j], j, r) for r in range(R) for j in range(caps[r]))
    tau, drafting = float(R), 0
    best_value, best_k, accepted, best_s = -math.inf, 0, 0.0, 0.0
    # seconds(R + k, drafting) read from the line's tables inline: a call per candidate
    # cost more than the rest of the scan
    verify, draft, scale = seconds.verify, seconds.draft, seconds.scale
    for k, (neg_a, j, _) in enumerate(cand, start=1):
        tau, drafting = tau - neg_a, drafting + (j == 0)
        if k < len(verify):
            s = (verify[k] + draft[drafting]) * scale[drafting > 0]
        else:
            s = seconds(R + k, drafting)
        value = tau / s
        if value > best_value:
            best_value, best_k, accepted, best_s = value, k, tau - R, s
    depths = [0] * R
    for _, j, r in cand[:best_k]:
        depths[r] = max(depths[r], j + 1)
    return _against_plain(Choice(depths, best_value, None, 0.0, accepted, seconds=best_s), plain_s)


def _revalued(option: Choice, line: StepLine) -> Choice:
    """A drafting option scanned at an earlier step (its depths and expected accepted
    drafts) against the plain step, both at ``line``'s step times: what
    :func:`scan_depths` answers at ``line`` when the survivals are the same (the step-time
    factor of drafting steps scales every drafting candidate alike, so the best of them
    stays the best)."""
    R, depths = line.requests, option.depths
    s = line(R + sum(depths), sum(d > 0 for d in depths))
    best = Choice(depths, (R + option.accepted) / s, None, 0.0, option.accepted, seconds=s)
    return _against_plain(best, line(R, 0))


def _against_plain(drafting: Choice, plain_s: float) -> Choice:
    """The best drafting step (``drafting``: its depths, value, accepted drafts and
    seconds) and the plain step of ``plain_s`` seconds, the better one as the choice."""
    R = len(drafting.depths)
    both = replace(drafting, other=[0] * R, other_value=R / plain_s, other_seconds=plain_s)
    return both if both.value > both.other_value else both.swapped()


def choose_depths(
    survivals: Sequence[Sequence[float]], caps: Sequence[int], seconds: StepLine
) -> list[int]:
    """:func:`scan_depths`'s best depths."""
    return scan_depths(survivals, caps, seconds).depths


@dataclass
class StepRecord:
    """What one step decided (for :meth:`Speculation.observe` and the metrics)."""

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


class Speculation:
    """The per-step decision: :meth:`depths` before drafting, :meth:`trim` after it,
    :meth:`observe` after the step. ``cost`` None: no adaptive decision (the gamma
    schedule alone); ``trim``: Algorithm 1 on the draft's confidences after drafting.
    ``synchronize`` (the platform's) makes the measured step time the device's."""

    def __init__(
        self,
        gamma: int,
        *,
        cost: OnlineStepCost | None = None,
        gamma_schedule: Sequence[Sequence[int]] | None = None,
        trim: bool = False,
        synchronize: Callable[[], None] = lambda: None,
    ) -> None:
        self.gamma = gamma
        self.cost = cost
        self.gamma_schedule = [list(e) for e in gamma_schedule] if gamma_schedule else None
        self.trim_enabled = trim and cost is not None
        self.synchronize = synchronize
        self.acceptance = AcceptanceModel(gamma)
        self.correction = ConfidenceCorrection(gamma)
        self.yield_check = YieldCheck()
        self.kinds = StepKinds()
        self.gaps: dict[int, float] = {}  # bucket -> EMA of the gap (:meth:`_explore`)
        # the exploration under way: (bucket, the kind explored, steps of it still to take)
        self._exploring: tuple[int, bool, int] | None = None
        # the last scan's best drafting option, its batch (caps, histories) and the steps
        # it has served (:data:`RESCAN_EVERY`); None after a step that verified drafts
        self._scanned: tuple[tuple[tuple[int, ...], tuple[int, ...]], Choice, int] | None = None
        self.last: StepRecord | None = None
        # a test hook: ``force(caps) -> depths`` replaces the decision (clipped to caps)
        self.force: Callable[[list[int]], list[int]] | None = None

    def fresh(self) -> Speculation:
        """A decision with this one's settings and nothing learnt: its step-cost model back
        at the profile, no acceptance, correction, yield or exploration history (what a
        process that just built would decide with)."""
        return Speculation(
            self.gamma,
            cost=None if self.cost is None else OnlineStepCost(self.cost.profile),
            gamma_schedule=self.gamma_schedule,
            trim=self.trim_enabled,
            synchronize=self.synchronize,
        )

    def caps(self, batch: int, budgets: Sequence[int]) -> list[int]:
        """Most drafts per request this step: gamma or the schedule's, within budget."""
        top = self.gamma
        if self.gamma_schedule is not None:
            top = min(top, gamma_for_batch(self.gamma_schedule, batch))
        return [max(0, min(top, b)) for b in budgets]

    def new_history(self) -> AcceptanceHistory:
        """A running request's acceptance history (it lives on its RunningSeq)."""
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
        ``regimes``: each request's :func:`~xspec.sampling.regime_of` label, when the caller keeps them."""
        started = time.perf_counter()
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
            key = (tuple(caps), tuple(map(id, histories)))
            held = self._scanned
            if held is not None and held[0] == key and held[2] < RESCAN_EVERY:
                scanned = _revalued(held[1], line)  # the same batch, plain steps since
                self._scanned = (key, held[1], held[2] + 1)
            else:
                conditional = [
                    self.acceptance.conditional(g, h, rates[g]) for g, h in zip(regimes, histories)
                ]
                surv = [list(itertools.accumulate(c, operator.mul)) for c in conditional]
                scanned = scan_depths(surv, caps, line)
                drafts = scanned if any(scanned.depths) else scanned.swapped()
                self._scanned = (key, drafts, 1)
            choice = self._checked(scanned, R)
            unsure = self._unsure(choice, regimes)
            if unsure is not None:  # plain, but on too little acceptance: those draft
                depths, accepted = unsure, math.nan
            else:
                if choice.other is not None and self._explore(R, choice):
                    choice = choice.swapped()
                depths, accepted = choice.depths, choice.accepted
            if self.trim_enabled:  # the draft forward costs the same at any depth: a
                # drafting request drafts its cap, the trim picks the verified prefix
                depths = [c if d > 0 else 0 for d, c in zip(depths, caps)]
        if conditional is None:  # only the drafting requests' (none, in a plain step)
            expected = [
                self.acceptance.conditional(g, h, rates[g])[:d] if d else []
                for g, h, d in zip(regimes, histories, depths)
            ]
        else:
            expected = [c[:d] for c, d in zip(conditional, depths)]
        self.last = StepRecord(regimes, depths, expected, started, accepted, line=line)
        return depths

    def _checked(self, choice: Choice, requests: int) -> Choice:
        """``choice`` with the drafting option's value corrected by :class:`YieldCheck`
        (times its factor) and by :data:`PLAIN_MARGIN` (divided by ``1 + margin``), and
        the plain / drafting decision made on the corrected values; the depths of each
        kind stay the model's.

        The margin: a plain step costs what ``spec=none`` pays and commits exactly R
        tokens; a drafting step's value rests on two estimates (the acceptance, the
        relative cost of drafting), so drafting has to be predicted :data:`PLAIN_MARGIN`
        ahead: near a tie it has little to win and much to lose. It was 0.05 until
        2026-12-05: at 32 requests and T=0.8 the contrasts learnt a relative cost of
        drafting of 0.07-0.12 (log) where the steps' own times gave 0.14, so once a run
        drafted, the model put plain steps 6-10 % dearer than they were and drafting
        1-4 % ahead where it made 0.92x plain's tokens per second (docs/adaptive.md,
        "The decision rule"). Most of that was the contrasts' own bias (a single plain
        step explored amid drafting paid for its switch: :class:`OnlineStepCost`), gone
        with explorations of :data:`EXPLORE_RUN` steps; the margin of 0.05 then kept
        16 requests at T=0.8 plain where drafting made 1.05-1.08x ``spec=none``'s
        tokens per second with requests of mixed lengths (``spec=none`` 437, fixed
        gamma 469, adaptive 442 tok/s in one process; 450, 469, 483 with this). On the
        synthetic machine with the engine's switch costs (benchmarks/sim_adaptive.py
        ``--switch-cost 0.08 0.05``), drafting truly 0.96-1.12x plain's value:
        0.990-1.019x the better fixed kind at 0.03 with these explorations,
        0.975-1.010x at 0.05, and 0.978-1.009x with the single-step explorations and
        0.05."""
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

    def _unsure(self, choice: Choice, regimes: Sequence[str]) -> list[int] | None:
        """When a plain ``choice`` rests on too little acceptance to stop drafting, the
        depths that draft anyway (else None): its drafting option's, for the requests
        whose regime has fewer than :data:`MIN_EVIDENCE` request-steps of realised
        acceptance (:meth:`AcceptanceModel.evidence`), while that option is predicted
        within :data:`EXPLORE_WIDE` of plain.

        A plain step verifies nothing, so nothing a regime's acceptance was learnt from
        changes while the steps are plain: an estimate that turned the steps plain stays
        as it is until a re-exploration (spaced by the gap: tens of steps). Two unlucky
        drafting steps of four requests at T=0.8 (5 drafts accepted where 16 were
        likely) left the estimates at 0.57, 0.48, ... per position against a true 0.8,
        0.65, ... (a prior of 4 pseudo-observations at :data:`PRIOR_ACCEPTANCE` cannot
        hold 8 request-steps), and one fresh decision (a benchmark process's: a warm-up
        run, then the measured one) stepped plain for all 94 steps of its measured run
        where drafting made 1.4x plain's value (1 of 60 seeds; on a synthetic machine
        with the tiny model's profile, 20 of 1000 fresh runs stuck, none with this
        rule). A regime's evidence only grows (64 decayed counts are 77 request-steps),
        so this costs a bounded few drafting steps per regime and process, about
        MIN_EVIDENCE / R at R requests of one regime, each within EXPLORE_WIDE of
        plain's value; only the requests of the regimes short of evidence draft, so a
        rare regime in a big batch costs a small drafting step."""
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

    def _explore(self, requests: int, choice: Choice) -> bool:
        """Take the other kind of step (plain / drafting) instead of the best, to measure
        it, for :data:`EXPLORE_RUN` consecutive steps of the bucket (an exploration):
        the cost model counts no run's first step, which pays for the switch, so a
        contrast needs a run of two (:class:`~xspec.spec.schedule.OnlineStepCost`).
        While this batch size's bucket (:func:`batch_bucket`) has fewer than
        :data:`EXPLORE_STEPS` steps of that kind, each exploration after EXPLORE_RUN
        steps of the best kind (alternating, so that each run is a contrast of the two
        kinds close together: the only thing the cost model learns the relative cost of
        drafting from). Whatever
        the values predicted while no bucket has a contrast: before its first contrasts
        the model cannot tell the machine's speed from the cost of drafting (a run of
        drafting steps twice as slow as profiled could be either), so a gap between the
        kinds means nothing yet. Once one has, the speed is known (common to every batch
        size) and only this bucket's relative cost of drafting is not, so a bucket whose
        other kind is predicted beyond :data:`EXPLORE_WIDE` of the best is not explored
        (the rule of re-exploration below): its profiled cost of drafting would have to
        be off by more than 2x to flip the choice. At greedy and four requests, the
        first steps of two requests (the tail of a run, a bucket a warm-up had not seen)
        explored plain steps at 0.36x drafting's value: two steps of a 28-step run.
        Within it, each exploration waits for :data:`EXPLORE_EVERY` steps of the bucket
        without that kind (the spacing of re-explorations): a bucket a workload visits
        a few steps at a time (the tail of each wave of requests: 8 requests at T=0.8
        took 4 plain steps at 1, 2 and 5 requests in a measured run after a warm-up run,
        at 0.55-0.77x drafting's value, about 1 % of its time) learns its relative cost
        of drafting once it is visited often enough for that to pay. It costs a bounded
        few steps per bucket, once.

        Once more, when its value is within :data:`EXPLORE_WIDE` of the best (``gap = 1
        - other / best <= EXPLORE_WIDE``, as the bucket's EMA: :meth:`_gap`), after
        ``max(EXPLORE_EVERY, EXPLORE_RUN * gap * (seconds of the other / seconds of the
        best) / EXPLORE_BUDGET)`` steps of the bucket without that kind: what was learnt of a
        kind it stopped taking never changes otherwise, so one unlucky contrast could
        shut a kind out for good (at T=0.8, one request, after a warm-up run, one
        benchmark process made 43 tok/s, about ``spec=none``'s 45, where fixed gamma
        made 75). A re-exploration loses ``gap`` of the other kind's step time (a
        drafting step of 32 requests takes 2.6x a plain one), so that spacing bounds
        their cost at :data:`EXPLORE_BUDGET` of the time: every 32 steps cost 4 % at
        T=0.8 and one request (a plain step explored where drafting made 1.9x its value;
        paired in one process). By the model only: it counts the explored steps' own
        loss, not what it does to the batch (at 32 requests, T=0.8, a drafting step of
        one request gets it a token or two ahead of the others, which then end and are
        replaced at different steps); there, in one process, runs without
        re-exploration made 1.02-1.03x those with it at 0.005 (1.75-2.8 re-explorations
        per 94-step run), where the model counted 0.5 %. Hence 0.0025."""
        kind = any(d > 0 for d in choice.other or [])
        known = choice.value > 0 and choice.seconds > 0
        gap = self._gap(requests, 1.0 - choice.other_value / choice.value) if known else 0.0
        bucket, held = batch_bucket(requests), self._exploring
        self._exploring = None
        if (
            held is not None
            and held[:2] == (bucket, kind)
            and self.kinds.since(kind, requests) == 0
        ):
            # under way (the bucket's last step was its first): its next step
            if held[2] > 1:
                self._exploring = (bucket, kind, held[2] - 1)
            return True
        if self._starts_exploring(requests, kind, gap, known, choice):
            if EXPLORE_RUN > 1:
                self._exploring = (bucket, kind, EXPLORE_RUN - 1)
            return True
        return False

    def _starts_exploring(
        self, requests: int, kind: bool, gap: float, known: bool, choice: Choice
    ) -> bool:
        """Whether an exploration of ``kind`` starts at this step (:meth:`_explore`)."""
        since = self.kinds.since(kind, requests)
        if self.kinds.steps(kind, requests) < EXPLORE_STEPS:
            if self.cost is not None and self.cost.contrasted(requests):
                # another bucket's contrasts told speed and drafting apart: far behind,
                # never; else once the bucket has had EXPLORE_EVERY steps without it
                return gap <= EXPLORE_WIDE and since >= EXPLORE_EVERY
            return since >= EXPLORE_RUN  # a steady figure of the best kind on each side
        if not known or gap > EXPLORE_WIDE:
            return False
        return since >= max(EXPLORE_EVERY, self._exploration_loss(requests, kind, gap, choice))

    def _exploration_loss(self, requests: int, kind: bool, gap: float, choice: Choice) -> float:
        """Steps of the bucket to wait before re-exploring ``kind``: an exploration's
        loss, in steps of the best kind, over :data:`EXPLORE_BUDGET`. The loss is
        :data:`EXPLORE_RUN` steps of the other kind at ``gap`` below the best, and the
        two switches, into the other kind and back (:meth:`OnlineStepCost.switch_cost`:
        each first step of a run is dearer; until 2026-12-05 the loss was the gap's
        alone, and at 32 requests, T=0.8, where the kinds were within 7 %, a drafting
        pair was re-explored every 150 steps or so at a true cost 3-4x the model's)."""
        ratio = choice.other_seconds / choice.seconds
        switches = 0.0
        if self.cost is not None:
            cost = self.cost.switch_cost
            switches = cost(requests, kind) * ratio + cost(requests, not kind)
        return (EXPLORE_RUN * gap * ratio + switches) / EXPLORE_BUDGET

    def _gap(self, requests: int, gap: float) -> float:
        """This step's gap into its bucket's EMA (:data:`GAP_DECAY`; the first step's own):
        what the exploration goes by. The gap moves from step to step with the requests'
        own acceptance (one bad step of one request halves its expected drafts for a few
        steps); the kinds' standing is the bucket's. At greedy and one request the gap
        was 0.55 on average and, as one step's, fell below :data:`EXPLORE_WIDE` often
        enough that a plain step was re-explored every 45 steps or so (about 0.5 % of
        the run's time, and 2 of its 89 steps)."""
        bucket = batch_bucket(requests)
        ema = self.gaps.get(bucket)
        ema = gap if ema is None else gap + GAP_DECAY * (ema - gap)
        self.gaps[bucket] = ema
        return ema

    def trim(self, confidence: torch.Tensor, depths: list[int]) -> list[int]:
        """After drafting: Algorithm 1 within ``depths`` on the corrected confidences
        ``[R, width]`` -> verified drafts per request (``depths`` without the trim)."""
        last = self.last
        assert last is not None
        last.raw = confidence.detach().to("cpu", torch.float64).tolist()  # one host copy
        last.corrected = self.correction.apply(last.raw, last.regimes)  # [R][width]
        if not self.trim_enabled or self.cost is None:
            return depths
        drafting = sum(d > 0 for d in depths)
        R, line = len(depths), last.line  # nothing was learnt since the decision
        if line is None or line.requests != R:
            line = self.cost.line(R, R + sum(depths))
        return schedule_rows(last.corrected, depths, line.sps(drafting))

    def observe(
        self,
        histories: Sequence[AcceptanceHistory | None],
        verified: Sequence[int],
        accepted: Sequence[int],
        seconds: float | None = None,
    ) -> None:
        """After the step: the realised acceptance per request and the step's time
        (``seconds``; None: measured, from the decision to now, after the platform's
        synchronize; given: a simulated machine's, benchmarks/sim_adaptive.py)."""
        rec = self.last
        assert rec is not None
        if self.cost is not None:
            if seconds is None:
                self.synchronize()
                seconds = time.perf_counter() - rec.started
            drafting = sum(d > 0 for d in rec.depths)
            R = len(verified)
            self.cost.update(R, R + sum(verified), drafting, seconds, rec.line)
            self.kinds.observe(drafting > 0, R)
            if drafting and math.isfinite(rec.accepted):
                self.yield_check.observe(R, rec.accepted, sum(accepted))
        if any(verified):  # the acceptance estimates moved: the next step scans afresh
            self._scanned = None
        raw = rec.raw  # [R][width] host rows (the trim's), or None
        for b, history in enumerate(histories):
            self.acceptance.observe(rec.regimes[b], history, verified[b], accepted[b])
            if raw is not None and verified[b]:
                self.correction.observe(rec.regimes[b], raw[b], verified[b], accepted[b])
