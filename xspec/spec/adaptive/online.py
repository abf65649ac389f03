"""The online step-cost model: the profile, corrected from the step times measured as
the workload runs.

:class:`OnlineStepCost` learns two factors on the measured profile (:class:`~.cost.StepCost`):
a per-batch-size level (the machine's speed, common to both kinds of step) and, per
batch-size bucket, the cost of a drafting step relative to a plain one, learnt only from
steps of both kinds close together. :class:`StepLine` is its prediction for steps of one
batch size, read once per step (the depth scan asks it about up to R * gamma candidates).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xspec.spec.adaptive.cost import StepCost, batch_bucket, bucket_label, lerp, lerp_steps

__all__ = ["OnlineStepCost", "StepLine"]


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
    """The step-cost model ``spec.adaptive`` predicts with: the measured profile times two
    factors learnt from the step times of the running workload, which keep what moves both
    kinds of step (the machine's speed) apart from what sets one against the other (the
    cost of drafting, relative to a plain step):

    - the **level** of a batch size R: the EMA (``decay``) of ``log(measured / profiled)``
      over its steps of both kinds (a drafting step's less the relative cost below). It
      follows the machine's speed and the workload (longer contexts than profiled,
      another load). A batch size not seen yet starts from the recent speed (an EMA of
      every step's level) and moves to its own by its samples (``prior_weight`` samples
      of that prior).
    - the **relative cost** of a drafting step per batch-size bucket
      (:func:`~.cost.batch_bucket`): ``log(drafting / plain)`` beyond the profile's,
      learnt from contrasts only: a run of one kind between two runs of the other, each
      switch between steps at most ``fresh`` apart. At each switch the run's figure is
      set against its neighbour's (going in: its second step against the run before's
      short EMA of its steps after its first; coming out: its own such EMA against the
      next run's second step), and the contrast is the mean of the two. Each switch is
      measured at one speed, so a slow or fast spell leaves the contrast alone; two
      switches that differ by more than ``jump`` (log) saw the speed change and teach
      nothing. No first step of a run counts: the step after a switch pays for it (the
      drafter's held-back rows written, the rings restacked). An EMA
      (``relative_decay``) shrunk to 0 (the profile is right) by ``relative_prior``
      samples; each contrast weighs by the noise around it (:meth:`contrast_weight`):
      fully while the step-to-step noise (an EMA by ``noise_decay``) is at most
      ``quiet`` in log sd, ``(quiet / noise)**2`` beyond.

    Apart from both, **what a switch costs** (:meth:`switch_cost`): the first step of a
    run right after the other kind over its second. No prediction includes it; the
    exploration's spacing does (:mod:`.explore`).

    The predicted time of a step of R requests is ``profile * exp(level(R) + relative(R)
    * drafting)``. Both are factors, never per-row figures: the shape in rows (what one
    more verify row costs, which Algorithm 1 and the depth scan weigh against a draft's
    survival) stays the profile's, and a prediction never falls as rows grow."""

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
        bucket's, which is shrunk to 0 by ``switch_prior`` samples), never below 0."""
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
                lerp(p.requests, [row[k] for row in p.seconds], requests)
                for k in range(len(p.drafts))
            ]  # verify seconds at this R for each profiled x
            cost.profile_lines[key] = (
                at_r,
                lerp_steps(self.xs, at_r, requests, max_rows),  # [rows - R]
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
            else lerp(self.xs, self.at_r, k / self.requests)
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
            self.verify = lerp_steps(self.xs, self.at_r, self.requests, top)
        verify = torch.tensor(self.verify, dtype=torch.float64)  # here, not per line: most
        draft = torch.tensor(self.draft, dtype=torch.float64)  # lines are only called
        scale = torch.where(drafting > 0, self.scale[1], self.scale[0])
        return (verify[rows - self.requests] + draft[drafting]) * scale
