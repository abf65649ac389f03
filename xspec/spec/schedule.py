"""Confidence-scheduled verification: how many drafts each request verifies this step.

DSpark's Algorithm 1 (paper section 3.2.2), exactly. Inputs: the calibrated confidences
``c [R, gamma]`` of the R requests in the step (``c_{r,j}``: P(draft j accepted | drafts
< j accepted)), each request's draft budget, and the platform's measured steps per
second ``SPS(B)`` for B verify rows in a step of R requests. With survivals
``a_{r,j} = prod_{i<=j} c_{r,i}`` (expected accepted tokens of verifying d_{r,j}):

    l_r = 0 for every r;  B = R;  tau = R;  best = R * SPS(R)
    for (r, j) in descending a_{r,j} (ties: lower position j first, then lower request r):
        theta = (tau + a_{r,j}) * SPS(B + 1)
        if theta <= best: stop                   # the first non-improvement ends it
        l_r = j;  B += 1;  tau += a_{r,j};  best = theta

``tau`` counts each request's bonus/correction token (1 per request) plus its expected
accepted drafts; ``tau * SPS(B)`` is the expected tokens per second of the step. Request r
then verifies ``[anchor, d_1 .. d_{l_r}]``: ``l_r + 1`` rows, at least the anchor row.

Why it stays lossless: survivals are non-increasing in j (``c <= 1``), so (r, j) comes
after (r, j-1) and each request verifies a prefix; whether d_{r,j} is verified depends
on ``a_{r,j}`` (drafts before j) and on higher-ranked candidates, never on d_{r,j}
itself, because the scan stops at the first non-improvement instead of searching the
whole order (a global argmax would look at later candidates, whose survivals depend on
d_{r,j}, and bias the output: paper appendix A). Rejection sampling on the verified
prefix is unchanged.

:class:`StepCost` is the measured table. Algorithm 1 asks for SPS as a function of B
only; xspec's measured step time also depends on how many sequences share the B rows
(per-sequence work in attention and the draft), so the table is indexed by requests R
and drafts per request ``x = (B - R) / R``, and a step uses its own R's slice: SPS(B) for
that R, as Algorithm 1 needs. Between measured points the step time is linear in x and
in R; beyond the ends it is clamped to the nearest measured value (so a step of more
requests than profiled sees the largest profiled batch's cost: profile what you run).
With ``draft_seconds`` the draft forward is its own term: ``seconds`` is then the
verify side alone and a step of R requests of which D draft costs
``verify(R, B) + draft(D)`` (``draft(0) = 0``: nobody drafts, no draft forward).

:class:`OnlineStepCost` is what ``spec.adaptive`` predicts with at run time: the
profile, corrected from the step times measured on the running workload.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AdaptiveVerify",
    "OnlineStepCost",
    "StepCost",
    "batch_bucket",
    "schedule_rows",
    "schedule_verify",
]

# candidates up to which a scan runs in plain Python: measured on this CPU, the Python scan
# of 160 candidates (32 requests x 5) takes 0.15-0.2 ms, the tensor one 0.37-0.46 ms; at
# 320 the tensor scan is ahead (0.43 vs 0.70 ms for Algorithm 1)
SMALL_SCAN = 200


def _lerp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)`` (xs ascending), clamped at both ends."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x)  # xs[i-1] <= x < xs[i]
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))


def _lerp_steps(
    xs: Sequence[float], ys: Sequence[float], requests: int, max_rows: int
) -> list[float]:
    """``_lerp(xs, ys, k / requests)`` for ``k = 0 .. max_rows - requests``, in one pass."""
    out, i, last = [], 0, len(xs) - 1
    for k in range(max(0, max_rows - requests) + 1):
        x = k / requests
        while i < last - 1 and x > xs[i + 1]:
            i += 1
        if x <= xs[0]:
            out.append(float(ys[0]))
        elif x >= xs[last]:
            out.append(float(ys[last]))
        else:
            t = (x - xs[i]) / (xs[i + 1] - xs[i])
            out.append(float(ys[i] + t * (ys[i + 1] - ys[i])))
    return out


@dataclass(frozen=True)
class StepCost:
    """Measured seconds of one decode step: ``seconds[i][k]`` for ``requests[i]`` requests
    verifying ``drafts[k]`` drafts each (``requests[i] * (drafts[k] + 1)`` rows).

    ``draft_seconds[i]``: one draft forward for ``requests[i]`` drafting requests; then
    ``seconds`` leaves the draft out (the verify side of the step). None: ``seconds``
    is the whole step, drafting included (an older profile, or a test's table)."""

    requests: list[int]  # ascending, >= 1
    drafts: list[int]  # ascending, >= 0 (drafts per request)
    seconds: list[list[float]]  # [len(requests)][len(drafts)], > 0
    draft_seconds: list[float] | None = None  # [len(requests)] >= 0, or None

    def __post_init__(self) -> None:
        problems = []
        for name, grid, low in (("requests", self.requests, 1), ("drafts", self.drafts, 0)):
            if not grid or any(b <= a for a, b in itertools.pairwise(grid)) or grid[0] < low:
                problems.append(f"{name} must be a non-empty ascending list >= {low}: {grid}")
        shape = [len(row) for row in self.seconds]
        if len(self.seconds) != len(self.requests) or set(shape) != {len(self.drafts)}:
            problems.append(
                f"seconds must be [{len(self.requests)}][{len(self.drafts)}], got rows {shape}"
            )
        elif any(not s > 0 for row in self.seconds for s in row):
            problems.append("seconds must all be > 0")
        d = self.draft_seconds
        if d is not None and (len(d) != len(self.requests) or any(not s >= 0 for s in d)):
            problems.append(f"draft_seconds must be {len(self.requests)} values >= 0, got {d}")
        if problems:
            raise ValueError("invalid step-cost table: " + "; ".join(problems))

    def verify_seconds(self, requests: int, rows: int) -> float:
        """The ``seconds`` table at ``rows`` verify rows over ``requests`` requests
        (interpolated; the draft included unless ``draft_seconds`` is given)."""
        x = (rows - requests) / requests  # drafts per request
        per_r = [_lerp(self.drafts, row, x) for row in self.seconds]  # at each profiled R
        return _lerp(self.requests, per_r, requests)

    def draft_at(self, drafting: int) -> float:
        """Seconds of the draft forward for ``drafting`` requests (0 for none, and 0
        when the table has no separate draft term)."""
        if drafting <= 0 or self.draft_seconds is None:
            return 0.0
        return _lerp(self.requests, self.draft_seconds, drafting)

    def seconds_at(self, requests: int, rows: int, drafting: int | None = None) -> float:
        """Step seconds for ``rows`` verify rows over ``requests`` requests of which
        ``drafting`` drafted (None: all of them)."""
        d = requests if drafting is None else drafting
        return self.verify_seconds(requests, rows) + self.draft_at(d)

    def sps(self, requests: int, drafting: int | None = None) -> Callable[[int], float]:
        """SPS(B) for a step of ``requests`` requests (``drafting`` of them drafted):
        steps per second at B rows."""
        return lambda rows: 1.0 / self.seconds_at(requests, rows, drafting)


def survivals(confidence: torch.Tensor) -> torch.Tensor:
    """``c [R, G]`` -> ``a [R, G]``, ``a_{r,j} = prod_{i<=j} c_{r,i}`` (float64)."""
    a = confidence.to(torch.float64).clamp(0.0, 1.0).cumprod(dim=1)
    return a.cummin(dim=1).values  # already non-increasing; kept exact for the prefix rule


def schedule_verify(
    confidence: torch.Tensor, max_drafts: Sequence[int], sps: Callable[[int], float]
) -> list[int]:
    """Algorithm 1 (module docstring): ``confidence [R, G]`` on the host, ``max_drafts[r]``
    the drafts request r may verify (its budget, at most G), ``sps(B)`` steps per second
    at B rows for this step's R -> drafts to verify per request, ``l_r`` in [0, max_drafts[r]].
    """
    R, G = confidence.shape
    if len(max_drafts) != R:
        raise ValueError(f"max_drafts has {len(max_drafts)} entries for {R} requests")
    if sum(min(m, G) for m in max_drafts) <= SMALL_SCAN:
        return _schedule_small(confidence.tolist(), max_drafts, sps)
    a = survivals(confidence)  # [R, G]
    # candidates in position-major order (j, then r), so a stable sort by -a breaks
    # ties by position, then request
    pos = torch.arange(G).repeat_interleave(R)  # [G*R] j (0-based) per candidate
    req = torch.arange(R).repeat(G)  # [G*R]
    cand = a.t().reshape(-1)  # [G*R] a_{r,j}
    allowed = pos < torch.tensor(list(max_drafts), dtype=torch.long)[req]
    pos, req, cand = pos[allowed], req[allowed], cand[allowed]
    order = torch.sort(-cand, stable=True).indices
    lengths = [0] * R
    tau, rows = float(R), R
    best = tau * sps(rows)
    for r, j, s in zip(req[order].tolist(), pos[order].tolist(), cand[order].tolist()):
        theta = (tau + s) * sps(rows + 1)
        if not theta > best:
            break  # the first non-improvement ends the scan (lossless)
        lengths[r], rows, tau, best = j + 1, rows + 1, tau + s, theta
    return lengths


def schedule_rows(
    confidence: list[list[float]], max_drafts: Sequence[int], sps: Callable[[int], float]
) -> list[int]:
    """:func:`schedule_verify` on host rows (``confidence[r]`` at least ``max_drafts[r]``
    long): a few candidates are scanned as they are, more as a tensor."""
    if len(max_drafts) != len(confidence):
        raise ValueError(f"max_drafts has {len(max_drafts)} entries for {len(confidence)} requests")
    if sum(min(m, len(row)) for m, row in zip(max_drafts, confidence)) <= SMALL_SCAN:
        return _schedule_small(confidence, max_drafts, sps)
    return schedule_verify(torch.tensor(confidence, dtype=torch.float64), max_drafts, sps)


def _schedule_small(
    confidence: list[list[float]], max_drafts: Sequence[int], sps: Callable[[int], float]
) -> list[int]:
    """:func:`schedule_verify` in plain Python for a few candidates: the same survivals
    (float64 products, clamped, non-increasing), the same order, the same answer."""
    cand = []
    for r, row in enumerate(confidence):
        a = low = 1.0
        for j in range(min(max_drafts[r], len(row))):
            a *= min(max(row[j], 0.0), 1.0)
            low = min(low, a)
            cand.append((-low, j, r))
    cand.sort()
    lengths = [0] * len(confidence)
    tau, rows = float(len(confidence)), len(confidence)
    best = tau * sps(rows)
    for neg_a, j, r in cand:
        theta = (tau - neg_a) * sps(rows + 1)
        if not theta > best:
            break
        lengths[r], rows, tau, best = j + 1, rows + 1, tau - neg_a, theta
    return lengths


@dataclass(frozen=True)
class AdaptiveVerify:
    """The step's hook: drafts to verify per request from the proposal's confidences."""

    cost: StepCost

    def __call__(self, confidence: torch.Tensor, max_drafts: Sequence[int]) -> list[int]:
        """``confidence [R, G]`` on the target's device -> ``l_r`` per request. Copies the
        small confidence matrix to the host: the one extra sync of an adaptive step (the
        ragged verify batch needs its row counts on the host anyway)."""
        return schedule_verify(confidence.cpu(), max_drafts, self.cost.sps(len(max_drafts)))


@functools.lru_cache(maxsize=256)  # called a dozen times a step, on a few batch sizes
def batch_bucket(requests: int) -> int:
    """The batch-size bucket the relative cost of drafting (:class:`OnlineStepCost`) and
    the draft yield (:class:`~xspec.spec.adaptive.YieldCheck`) are kept in:
    ``round(log2 R)`` (1 | 2 | 3-5 | 6-11 | 12-22 | 23-45 | 46-90 | ...)."""
    return max(0, round(math.log2(max(requests, 1))))


def bucket_label(bucket: int) -> str:
    """The batch sizes of a :func:`batch_bucket`, e.g. ``23-45`` (``1`` for bucket 0)."""
    lo, hi = math.ceil(2 ** (bucket - 0.5)), math.floor(2 ** (bucket + 0.5))
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _averaged(
    state: tuple[float, float] | None, sample: float, decay: float
) -> tuple[float, float]:
    """An EMA ``(value, samples)`` (None: none yet) after one more ``sample``: the first
    samples averaged exactly, then by ``decay``."""
    ema, n = state if state is not None else (sample, 0.0)
    alpha = max(1.0 / (n + 1), 1.0 - decay)
    return ema + alpha * (sample - ema), n + 1


@dataclass
class _Run:
    """A run of consecutive steps of one kind in a batch-size bucket: its kind, the
    indices of its first and last steps, its first and last steps' log(measured /
    profiled) seconds, and of its steps after the first (a first step pays for the
    switch, see :class:`OnlineStepCost`) the second's and a short EMA of them (the
    machine's speed as it was lately; both None while the run has one step)."""

    drafting: bool
    start: int
    last: int
    first: float
    last_x: float
    second: float | None = None
    steady: float | None = None


class OnlineStepCost:
    """The step-cost model ``spec.adaptive`` predicts with: the measured profile, times
    two factors learnt from the step times of the running workload, which keep apart
    what moves both kinds of step (the machine's speed) from what sets one against the
    other (the cost of drafting, relative to a plain step):

    - the **level** of a batch size R: the EMA (``decay``) of ``log(measured /
      profiled)`` over its steps of both kinds (a drafting step's less the relative cost
      below). Whatever kind the steps take, it follows the machine's speed and the
      workload (longer contexts than profiled, another load on the machine). A batch
      size not seen yet starts from the recent speed (an EMA of every step's level),
      then moves to its own by its samples (``prior_weight`` samples of that prior).
    - the **relative cost** of a drafting step per batch-size bucket
      (:func:`batch_bucket`): ``log(drafting / plain)`` beyond the profile's, learnt
      from contrasts only: a run of one kind sandwiched between two of the other, each
      switch between steps at most ``fresh`` apart, of any length between them (two
      steps at least). At each switch the run's figure is set against its neighbour's
      (going in: its second step against the run before's short EMA of its steps after
      its first; coming out: its own such EMA against the next run's second step), and
      the contrast is the mean of the two, taken at that second step. Each switch is
      measured at one speed, so a slow or fast spell, or a drift during a long run,
      leaves it alone, and the two switches' drift cancels; two switches that differ
      by more than ``jump`` (log) saw the speed change at one of them and teach nothing
      (a contrast with one switch only took half a speed change for a cost of
      drafting). **No first step of a run counts**: the step after a switch pays for
      it. At 16 requests, T=0.8, in one process (runs of 6 of each kind, forced), a
      plain step took 19.7 ms first and 18.0-18.2 after, a drafting step 52.0 ms first
      and 49.2-49.6 after (the drafter's held-back rows written, the rings restacked
      for the requests the other kind ended). Until 2026-12-05 a run of one step was a
      contrast, its step on both sides: a plain step explored amid drafting put
      drafting at ``log(50.7 / 19.7)`` over plain where the runs of each kind made
      ``log(49.4 / 18.1)``, 5.5 % cheaper than it is, and the model, drafting, kept
      drafting where plain was as good (``PLAIN_MARGIN`` of the decision was 0.05 to
      make up for it; :mod:`xspec.spec.adaptive` explores in runs of two steps since,
      and its margin is 0.03). Until 2026-12-04 the sandwich had to fit in ``2 * fresh``
      steps, so a stretch of the other kind that the choice itself took (the values
      crossed) taught nothing: after a spell had left the relative cost low, one run
      took 11 plain steps amid drafting ones and went back to drafting. An EMA
      (``relative_decay``, the first samples averaged exactly) shrunk to 0 (the
      profile is right) by ``relative_prior`` samples (the first few contrasts decide:
      a bucket gets three from its first explorations). Each contrast counts by the
      noise around it (:meth:`contrast_weight`): fully while the steps' noise
      (``log(measured / profiled)`` step to step, an EMA by ``noise_decay`` of half the
      squared difference of two steps of one kind close together, or the difference
      of the contrast's own two switches if larger) is at most ``quiet`` in log sd,
      ``(quiet / noise)**2`` beyond. A quiet machine's steps of 32 requests move by 4-6 %; beside
      two CPU hogs by 17-25 %, and there two single-step contrasts (-0.31, -0.40) took
      the relative cost from 1.10 to 0.91 and the choice to drafting, which outlived
      the spell.

    Apart from both, **what a switch costs** (:meth:`switch_cost`): the first step of a
    run right after the other kind over its second. No prediction includes it; the
    decision's re-exploration spacing does (an exploration makes two switches).

    The predicted time of a step of R requests is then ``profile * exp(level(R) +
    relative(R) * drafting)``. The earlier model kept one scale per kind of step,
    learnt from that kind's steps alone: the kind not being taken kept the speed of
    the spell in which it was last measured, so a 1.7x spell flipped the plain /
    drafting choice (benchmarks/sim_adaptive.py, plain right: drafting taken in 4-6 % of
    the steps under such spells, 0.5 % on a steady machine; this model 1.0 % in both,
    all of it re-exploration).

    Both are factors, never per-row figures: the shape in rows (what one more verify row
    costs, which Algorithm 1 and the depth scan weigh against a draft's survival) stays
    the profile's, measured interleaved, and a prediction never falls as rows grow. An
    EMA per ``(requests, rows, drafting)`` bucket (an earlier model still) learnt each
    row count from its own few steps: a slow spell left one dearer than its neighbours,
    the trim then verified 3 rows in 101 of 132 steps, and the rows it avoided were
    never measured again."""

    def __init__(
        self,
        profile: StepCost,
        *,
        decay: float = 0.9,
        relative_decay: float = 0.75,
        prior_weight: float = 2.0,
        relative_prior: float = 0.5,
        fresh: int = 4,
        jump: float = 0.3,
        quiet: float = 0.1,
        noise_decay: float = 0.8,
        switch_decay: float = 0.8,
        switch_prior: float = 1.0,
    ) -> None:
        self.profile = profile
        self.decay, self.relative_decay = decay, relative_decay
        self.prior_weight, self.relative_prior = prior_weight, relative_prior
        self.fresh, self.jump = fresh, jump
        self.quiet, self.noise_decay = quiet, noise_decay
        self.switch_decay, self.switch_prior = switch_decay, switch_prior
        self.levels: dict[int, tuple[float, float]] = {}  # requests -> (log level, samples)
        self.speed = 0.0  # EMA of every step's log level: where a new batch size starts
        # bucket -> (log EMA, weight of its contrasts, contrasts)
        self.relative: dict[int, tuple[float, float, int]] = {}
        # bucket -> (EMA of the variance of log(measured / profiled) step to step, samples)
        self.noise: dict[int, tuple[float, float]] = {}
        self._runs: dict[int, _Run] = {}  # bucket -> its latest run of one kind
        self._before: dict[int, _Run | None] = {}  # bucket -> the run before that
        self._earlier: dict[int, _Run | None] = {}  # bucket -> and the one before that
        self._step = 0  # steps taken in (the runs' clock; the report's count can restart)
        # (bucket or None: every bucket's, kind) -> (log EMA of a run's first step over its
        # second, samples): what a switch to that kind costs (:meth:`switch_cost`)
        self.switches: dict[tuple[int | None, bool], tuple[float, float]] = {}
        # (requests, max_rows) -> the profile's verify and draft seconds (StepLine)
        self.profile_lines: dict[tuple[int, int], tuple[list[float], list[float], list[float]]] = {}
        # predicted vs measured over the steps seen (the report)
        self.num_steps = 0
        self.predicted_s = 0.0
        self.measured_s = 0.0
        self.abs_error_s = 0.0

    def level(self, requests: int) -> float:
        """The log factor on the profile common to both kinds of step at ``requests``."""
        ema, n = self.levels.get(requests, (0.0, 0.0))
        w, prior = min(n, 1.0 / (1.0 - self.decay)), self.prior_weight
        return (w * ema + prior * self.speed) / (w + prior)

    def relative_cost(self, requests: int) -> float:
        """The log cost of a drafting step over a plain one beyond the profile's, at
        ``requests`` (its bucket's; 0 before any contrast)."""
        ema, n, _ = self.relative.get(batch_bucket(requests), (0.0, 0.0, 0))
        return n * ema / (n + self.relative_prior)

    def contrasts(self, requests: int) -> int:
        """Contrasts the relative cost of ``requests``'s bucket was learnt from."""
        return self.relative.get(batch_bucket(requests), (0.0, 0.0, 0))[2]

    def contrasted(self, besides: int | None = None) -> bool:
        """Whether a batch-size bucket (other than that of ``besides`` requests, when
        given) has learnt its relative cost from a contrast yet."""
        skip = None if besides is None else batch_bucket(besides)
        return any(n > 0 for b, (_, n, _) in self.relative.items() if b != skip)

    def factors(self, requests: int) -> tuple[float, float]:
        """The factors on the profile of a plain and of a drafting step of ``requests``."""
        level = self.level(requests)
        return math.exp(level), math.exp(level + self.relative_cost(requests))

    def line(self, requests: int, max_rows: int | None = None) -> StepLine:
        """Predicted seconds of a step of ``requests`` requests, ``f(rows, drafting)``
        (:class:`StepLine`; ``max_rows``: the most rows it will be asked about, so their
        verify times are computed once, in one pass)."""
        return StepLine(self, requests, max_rows if max_rows is not None else requests)

    def seconds_at(self, requests: int, rows: int, drafting: int) -> float:
        """Predicted seconds of one step (see :meth:`line`)."""
        return self.line(requests)(rows, drafting)

    def sps(
        self, requests: int, drafting: int, max_rows: int | None = None
    ) -> Callable[[int], float]:
        """SPS(B) for Algorithm 1 in a step of ``requests`` requests, ``drafting`` drafted
        (``max_rows``: as for :meth:`line`)."""
        return self.line(requests, max_rows).sps(drafting)

    def update(
        self,
        requests: int,
        rows: int,
        drafting: int,
        seconds: float,
        line: StepLine | None = None,
    ) -> float:
        """Take in one measured step; returns what was predicted for it (before the
        update). ``line``: the :meth:`line` the step was decided on, given when nothing
        was learnt since, so its prediction and profile figures are this step's and are
        not computed again (a line of another batch size is ignored)."""
        if line is None or line.requests != requests:
            line = self.line(requests)
        predicted = line(rows, drafting)
        self.num_steps += 1
        self._step += 1
        self.predicted_s += predicted
        self.measured_s += seconds
        self.abs_error_s += abs(predicted - seconds)
        profiled = line.profiled(rows, drafting)
        if not (seconds > 0 and profiled > 0 and math.isfinite(seconds)):
            return predicted
        x, kind, bucket = math.log(seconds / profiled), drafting > 0, batch_bucket(requests)
        run = self._runs.get(bucket)
        if run is not None and run.drafting == kind and self._step - run.last <= self.fresh:
            # two steps of one kind close together: their difference is the step noise
            noise = (x - run.last_x) ** 2 / 2
            self.noise[bucket] = _averaged(self.noise.get(bucket), noise, self.noise_decay)
            run.last, run.last_x = self._step, x
            if run.steady is None:  # its second step, its first steady figure: the run
                run.second = run.steady = x  # before it, sandwiched, is a contrast
                self._switched(bucket, run)
                self._sandwich(bucket, run)
            else:
                run.steady += 0.5 * (x - run.steady)
        else:
            self._earlier[bucket] = self._before.get(bucket)
            self._before[bucket] = run
            self._runs[bucket] = _Run(kind, self._step, self._step, x, x)
        x -= self.relative_cost(requests) if kind else 0.0
        self.levels[requests] = _averaged(self.levels.get(requests), x, self.decay)
        self.speed += (1.0 - self.decay) * (x - self.speed) if self._step > 1 else x - self.speed
        return predicted

    def switch_cost(self, requests: int | None, drafting: bool) -> float:
        """What switching to a step of this kind costs at ``requests`` (None: every
        bucket's figure), as a fraction of such a step: how much dearer the first step of
        a run is than its second (the rings restacked for the requests the other kind
        ended, the drafter's held-back rows written; :meth:`update`), learnt from the
        switches seen (an EMA of the log excess per batch-size bucket, shrunk to every
        bucket's, which is shrunk to 0 by ``switch_prior`` samples), never below 0. At
        32 requests, T=0.8, a drafting step right after plain ones took 87 ms where the
        next took 70-75."""
        x = self._shrunk(self.switches.get((None, drafting)), 0.0)
        if requests is not None:
            x = self._shrunk(self.switches.get((batch_bucket(requests), drafting)), x)
        return max(math.expm1(x), 0.0)

    def _shrunk(self, ema: tuple[float, float] | None, prior: float) -> float:
        if ema is None:
            return prior
        x, n = ema
        return (n * x + self.switch_prior * prior) / (n + self.switch_prior)

    def _switched(self, bucket: int, run: _Run) -> None:
        """``run`` just took its second step: when the run before it in its bucket was of
        the other kind and close (a switch), its first step's excess over the second is
        a sample of the switch's cost."""
        before = self._before.get(bucket)
        if before is None or before.drafting == run.drafting or run.start - before.last > 1:
            return
        assert run.second is not None
        sample = run.first - run.second
        for key in ((bucket, run.drafting), (None, run.drafting)):
            self.switches[key] = _averaged(self.switches.get(key), sample, self.switch_decay)

    def _sandwich(self, bucket: int, after: _Run) -> None:
        """The contrast of the run before ``after`` (its second step just taken), when that
        run is of the other kind and lies between two of this kind, each switch between
        steps close together: the run's steady figure over the steady figures on either
        side (the mean of the switch into it and the switch out of it): never its first
        step nor the next run's (see the class docstring); the run before counts by its
        only step when it had one."""
        run, before = self._before.get(bucket), self._earlier.get(bucket)
        if (
            run is None
            or before is None
            or run.steady is None  # one step: no figure without its switch's cost
            or not before.drafting == after.drafting != run.drafting
            or run.start - before.last > self.fresh
            or after.start - run.last > self.fresh
        ):
            return
        side = before.steady if before.steady is not None else before.first
        # each switch at one speed: the run's start (its second step) against the end of
        # the run before, its end (its last steps) against the start of the run after
        assert run.second is not None and after.second is not None
        into, out = run.second - side, run.steady - after.second
        if abs(into - out) <= self.jump:  # else the speed changed at a switch
            sample = 0.5 * (into + out)
            self._contrast(bucket, sample if run.drafting else -sample, into - out)

    def contrast_weight(self, requests: int, sides: float = 0.0) -> float:
        """The weight a contrast taken now in the bucket of ``requests`` gets, in
        contrasts: 1 while the step noise is at most ``quiet`` (log sd), ``(quiet /
        noise)**2`` above that (an inverse-variance weight). The noise: the larger of
        the bucket's (steps of one kind close together) and what the contrast itself
        tells (``sides``: the difference of its two switches' figures, two measures of
        one relative cost)."""
        return self._weight(batch_bucket(requests), sides)

    def _weight(self, bucket: int, sides: float) -> float:
        var, _ = self.noise.get(bucket, (0.0, 0.0))
        return self.quiet**2 / max(var, sides**2 / 2, self.quiet**2)

    def _contrast(self, bucket: int, sample: float, sides: float = 0.0) -> None:
        w = self._weight(bucket, sides)
        ema, n, count = self.relative.get(bucket, (0.0, 0.0, 0))
        alpha = max(w / (n + w), w * (1.0 - self.relative_decay))
        self.relative[bucket] = (ema + alpha * (sample - ema), n + w, count + 1)

    def reset_report(self) -> None:
        """Start the predicted-vs-measured report afresh (what was learnt stays)."""
        self.num_steps, self.predicted_s, self.measured_s, self.abs_error_s = 0, 0.0, 0.0, 0.0

    def summary(self) -> dict[str, Any]:
        """Predicted vs measured step time so far (results.json ``adaptive.step_time``)."""
        n = self.num_steps
        return {
            "steps": n,
            "predicted_ms_mean": self.predicted_s / n * 1e3 if n else None,
            "measured_ms_mean": self.measured_s / n * 1e3 if n else None,
            "abs_error_ms_mean": self.abs_error_s / n * 1e3 if n else None,
            "speed": math.exp(self.speed),  # measured / profiled, lately
            # a drafting step's cost over a plain one's, beyond the profile's, per bucket
            "relative_cost_drafting": {
                bucket_label(b): math.exp(self.relative_cost(2**b)) for b in sorted(self.relative)
            },
            # log sd of a step's time, step to step, per bucket (what a contrast counts by)
            "step_noise": {
                bucket_label(b): math.sqrt(v) for b, (v, _) in sorted(self.noise.items())
            },
            # what a switch to each kind costs, as a fraction of its step (every bucket's)
            "switch_cost": {
                "plain": self.switch_cost(None, False),
                "drafting": self.switch_cost(None, True),
            },
        }


class StepLine:
    """:class:`OnlineStepCost`'s prediction for steps of one batch size R, read once:
    ``line(rows, drafting)`` seconds, and :meth:`many` for a whole scan of candidates at
    once (the per-step decision evaluates up to R * gamma of them)."""

    def __init__(self, cost: OnlineStepCost, requests: int, max_rows: int) -> None:
        p = cost.profile
        self.requests = requests
        self.xs = p.drafts
        # the profile's own figures at this R (they never change): computed once per R
        key = (requests, max_rows)
        if key not in cost.profile_lines:
            at_r = [
                _lerp(p.requests, [row[k] for row in p.seconds], requests)
                for k in range(len(p.drafts))
            ]  # verify seconds at this R for each profiled x
            cost.profile_lines[key] = (
                at_r,
                _lerp_steps(self.xs, at_r, requests, max_rows),  # [rows - R]
                [p.draft_at(d) for d in range(requests + 1)],  # [drafting]
            )
        self.at_r, self.verify, self.draft = cost.profile_lines[key]
        self.scale = cost.factors(requests)  # on the profile: (plain, drafting)

    def __call__(self, rows: int, drafting: int) -> float:
        return self.profiled(rows, drafting) * self.scale[drafting > 0]

    def profiled(self, rows: int, drafting: int) -> float:
        """The profile's own seconds of the step (without the online factors)."""
        k = rows - self.requests
        v = (
            self.verify[k]
            if 0 <= k < len(self.verify)
            else _lerp(self.xs, self.at_r, k / self.requests)
        )
        return v + self.draft[min(max(drafting, 0), self.requests)]

    def drafting_seconds(self, drafting: int) -> list[float]:
        """Seconds of a step in which ``drafting`` requests draft, at ``R + k`` rows for
        each ``k`` up to the ``max_rows`` given (the values of ``self(R + k, drafting)``,
        in one pass: a scan reads one per candidate)."""
        d = self.draft[min(max(drafting, 0), self.requests)]
        scale = self.scale[drafting > 0]
        return [(v + d) * scale for v in self.verify]

    def sps(self, drafting: int) -> Callable[[int], float]:
        """SPS(B) for Algorithm 1 in a step where ``drafting`` requests drafted: steps
        per second at B rows (a table read up to ``max_rows``)."""
        inv = [1.0 / s for s in self.drafting_seconds(drafting)]
        R, top = self.requests, len(inv)
        return lambda rows: inv[rows - R] if 0 <= rows - R < top else 1.0 / self(rows, drafting)

    def many(self, rows: torch.Tensor, drafting: torch.Tensor) -> torch.Tensor:
        """Seconds of each candidate ``(rows[i], drafting[i])`` (int64, drafting at most
        R) -> float64 ``[N]``."""
        top = int(rows.max()) if rows.numel() else self.requests
        if top - self.requests >= len(self.verify):  # beyond max_rows: extend, once
            self.verify = _lerp_steps(self.xs, self.at_r, self.requests, top)
        verify = torch.tensor(self.verify, dtype=torch.float64)  # here, not per line: most
        draft = torch.tensor(self.draft, dtype=torch.float64)  # lines are only called
        scale = torch.where(drafting > 0, self.scale[1], self.scale[0])
        return (verify[rows - self.requests] + draft[drafting]) * scale
