"""Which drafts to verify: DSpark's Algorithm 1 after drafting, the depth scan before it.

**Algorithm 1** (DSpark paper section 3.2.2, exactly: :func:`schedule_verify`). Inputs:
the calibrated confidences ``c [R, gamma]`` of the step's R requests (``c_{r,j}``: P(draft
j accepted | drafts < j accepted)), each request's draft budget, and the steps per second
``SPS(B)`` at B verify rows for this step's R. With survivals ``a_{r,j} = prod_{i<=j}
c_{r,i}`` (the expected accepted tokens of verifying d_{r,j})::

    l_r = 0 for every r;  B = R;  tau = R;  best = R * SPS(R)
    for (r, j) in descending a_{r,j} (ties: lower position j first, then lower request r):
        theta = (tau + a_{r,j}) * SPS(B + 1)
        if theta <= best: stop                   # the first non-improvement ends it
        l_r = j;  B += 1;  tau += a_{r,j};  best = theta

``tau`` counts each request's bonus/correction token plus its expected accepted drafts;
request r then verifies ``[anchor, d_1 .. d_{l_r}]``. It stays lossless: survivals are
non-increasing in j, so each request verifies a prefix, and whether d_{r,j} is verified
depends on ``a_{r,j}`` (drafts before j) and on higher-ranked candidates, never on d_{r,j}
itself, because the scan stops at the first non-improvement (a global argmax would look
at later candidates, whose survivals depend on d_{r,j}: paper appendix A).

**The depth scan** (:func:`scan_depths`), before drafting: the depth per request that
maximises the expected committed tokens per second of the whole step, from pre-draft
survival estimates and the predicted step time (:class:`~.online.StepLine`, where a
request given 0 does not draft and a step where all are given 0 runs no draft forward).
Candidates are taken in the same order and the best prefix of that order wins (an
exhaustive scan: nothing in it depends on this step's drafts). It answers the best step
of each kind, plain and drafting (:class:`Choice`), for the policy to weigh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from xspec.spec.adaptive.online import StepLine

__all__ = [
    "SMALL_SCAN",
    "Choice",
    "choose_depths",
    "revalued",
    "scan_depths",
    "schedule_rows",
    "schedule_verify",
    "survivals",
]

# candidates up to which a scan runs in plain Python (faster than tensor ops below this)
SMALL_SCAN = 200


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


def revalued(option: Choice, line: StepLine) -> Choice:
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
