"""The measured step-cost table: seconds of one decode step by requests and drafts.

:class:`StepCost` holds what :mod:`.profile` measured on this platform: ``seconds[i][k]``
for ``requests[i]`` requests verifying ``drafts[k]`` drafts each, and the draft forward
of ``requests[i]`` drafting requests (``draft_seconds``). Algorithm 1 (:mod:`.scan`) asks
for steps per second as a function of the verify rows B only; a step's time also depends
on how many sequences share those rows (per-sequence work in attention and the draft), so
the table is indexed by requests R and drafts per request ``x = (B - R) / R``, and a step
reads its own R's slice. Between measured points the time is linear in x and in R; beyond
the ends it is clamped to the nearest measured value (a step of more requests than
profiled sees the largest profiled batch's cost: profile what you run). With
``draft_seconds`` a step of R requests of which D draft costs ``verify(R, B) + draft(D)``
(``draft(0) = 0``: nobody drafts, no draft forward).

:func:`batch_bucket` groups batch sizes for what the online model (:mod:`.online`) and
the yield check (:mod:`.acceptance`) learn per batch size.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StepCost", "batch_bucket", "bucket_label"]


def lerp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through ``(xs, ys)`` (xs ascending), clamped at both ends."""
    if x <= xs[0]:
        return float(ys[0])
    if x >= xs[-1]:
        return float(ys[-1])
    i = bisect.bisect_right(xs, x)  # xs[i-1] <= x < xs[i]
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return float(ys[i - 1] + t * (ys[i] - ys[i - 1]))


def lerp_steps(
    xs: Sequence[float], ys: Sequence[float], requests: int, max_rows: int
) -> list[float]:
    """``lerp(xs, ys, k / requests)`` for ``k = 0 .. max_rows - requests``, in one pass."""
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
        per_r = [lerp(self.drafts, row, x) for row in self.seconds]  # at each profiled R
        return lerp(self.requests, per_r, requests)

    def draft_at(self, drafting: int) -> float:
        """Seconds of the draft forward for ``drafting`` requests (0 for none, and 0
        when the table has no separate draft term)."""
        if drafting <= 0 or self.draft_seconds is None:
            return 0.0
        return lerp(self.requests, self.draft_seconds, drafting)

    def seconds_at(self, requests: int, rows: int, drafting: int | None = None) -> float:
        """Step seconds for ``rows`` verify rows over ``requests`` requests of which
        ``drafting`` drafted (None: all of them)."""
        d = requests if drafting is None else drafting
        return self.verify_seconds(requests, rows) + self.draft_at(d)

    def sps(self, requests: int, drafting: int | None = None) -> Callable[[int], float]:
        """SPS(B) for a step of ``requests`` requests (``drafting`` of them drafted):
        steps per second at B rows."""
        return lambda rows: 1.0 / self.seconds_at(requests, rows, drafting)


@functools.lru_cache(maxsize=256)  # called a dozen times a step, on a few batch sizes
def batch_bucket(requests: int) -> int:
    """The batch-size bucket the relative cost of drafting (:mod:`.online`) and
    the draft yield (:class:`~.acceptance.YieldCheck`) are kept in:
    ``round(log2 R)`` (1 | 2 | 3-5 | 6-11 | 12-22 | 23-45 | 46-90 | ...)."""
    return max(0, round(math.log2(max(requests, 1))))


def bucket_label(bucket: int) -> str:
    """The batch sizes of a :func:`batch_bucket`, e.g. ``23-45`` (``1`` for bucket 0)."""
    lo, hi = math.ceil(2 ** (bucket - 0.5)), math.floor(2 ** (bucket + 0.5))
    return str(lo) if lo == hi else f"{lo}-{hi}"
