"""What the drafts are expected to deliver, learnt from what they did: acceptance estimates.

* :class:`AcceptanceModel`: the expected survival of each draft position before drafting,
  per sampling regime (the batch's realised conditional acceptance per position) and per
  request (its own, shrunk towards its regime's), and an upper credible bound of it (the
  posterior's spread: how much a request's few steps say). A request's counts live in its
  :class:`AcceptanceHistory` (the policy keeps it in the running sequence's
  ``depth_state``).
* :class:`ConfidenceCorrection`: per regime and position, the ratio of realised to
  predicted acceptance, which corrects the draft's confidences before the trim.
* :class:`YieldCheck`: how many tokens drafting steps committed against what the decision
  expected of them, per batch-size bucket; the decision scales a drafting option by it.

Every count is decayed (recent steps weigh more) and shrunk towards a prior.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

from xspec.spec.adaptive.cost import batch_bucket

__all__ = [
    "BOUND_Z",
    "PRIOR_ACCEPTANCE",
    "YIELD_PRIOR_STEPS",
    "AcceptanceHistory",
    "AcceptanceModel",
    "ConfidenceCorrection",
    "YieldCheck",
]

PRIOR_ACCEPTANCE = 0.7  # per-position acceptance assumed before anything was verified
YIELD_PRIOR_STEPS = 8.0  # YieldCheck: steps' worth of "the model is right", always
BOUND_Z = 1.2816  # AcceptanceModel.upper: the one-sided 90 % bound (a normal quantile)


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
    """One request's realised acceptance per draft position (the policy keeps it in the
    running sequence's ``depth_state``)."""

    counts: _Decayed


class AcceptanceModel:
    """Expected survival of each draft position before drafting: per sampling regime, the
    batch's realised conditional acceptance per position (decayed counts, prior
    :data:`PRIOR_ACCEPTANCE`), and per request its own, shrunk towards its regime's by
    ``request_weight`` pseudo-observations. The request's counts decay by
    ``request_decay`` (about 10 request-steps); the pseudo-observations keep a few
    unlucky steps from outweighing its regime (plain steps verify nothing, so a request
    turned plain by its own bad luck would stay plain until its counts aged)."""

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

    def upper(
        self,
        regime: str,
        history: AcceptanceHistory | None,
        batch: list[float] | None = None,
        z: float = BOUND_Z,
    ) -> list[float]:
        """An upper credible bound of :meth:`conditional` per position: the posterior
        of ``c_j`` as a Beta whose prior is the regime's rate (worth ``request_weight``
        observations, or the regime's own observations plus ``prior_weight`` when
        fewer) and whose data are the request's decayed counts, bounded at its mean plus
        ``z`` standard deviations (clipped to 1). The fewer steps a request has, the wider
        it is: a few unlucky steps lower the mean a little and leave the bound high."""
        mean = self.conditional(regime, history, batch)
        counts = self.regimes.get(regime)
        prior = [
            min(self.request_weight, self.prior_weight + (counts.scale * r if counts else 0.0))
            for r in (counts.reached if counts else [0.0] * self.gamma)
        ]
        seen = [0.0] * self.gamma
        if history is not None:
            c = history.counts
            seen = [c.scale * r for r in c.reached]
        return [
            min(1.0, m + z * math.sqrt(m * (1.0 - m) / (n + p + 1.0)))
            for m, n, p in zip(mean, seen, prior)
        ]

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
    the speed moves, is the cost model's: :class:`~.online.OnlineStepCost`).

    It is shrunk hard (:data:`YIELD_PRIOR_STEPS` pseudo-steps of "the model is right"):
    a bias shows over many steps, while a few unlucky ones are luck the acceptance model
    has already taken in. The factors are hierarchical: the overall ratio shrunk to 1, a
    bucket's to the overall one."""

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
