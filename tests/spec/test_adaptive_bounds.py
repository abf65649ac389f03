"""The adaptive decision where the answer is clear (``xspec/spec/adaptive/``): where a
plain step costs more than half a drafting one, a request goes plain only when drafting
loses at the upper bound of its acceptance, and a plain batch there is probed again on a
geometric back-off; where drafting costs more, a confident loss turns the steps plain."""

from __future__ import annotations

import math

import pytest

from xspec.sampling import SamplingParams
from xspec.spec.adaptive import policy
from xspec.spec.adaptive.acceptance import AcceptanceModel, _Decayed
from xspec.spec.adaptive.cost import StepCost
from xspec.spec.adaptive.explore import PROBE_FIRST, Probes
from xspec.spec.adaptive.online import OnlineStepCost
from xspec.spec.adaptive.policy import AdaptiveDepth

T08 = [SamplingParams(temperature=0.8)]
# one request: a plain step 1.0 s, verifying 5 drafts 1.5 s, the draft forward 0.4 s: a
# drafting step 1.9 s (a plain one is 0.53 of it); at 0.7 per position it makes 2.94
# tokens, 1.55x a plain step's value
CHEAP = StepCost(
    requests=[1, 32], drafts=[0, 5], seconds=[[1.0, 1.5], [1.0, 1.5]], draft_seconds=[0.4, 0.4]
)
# 32 requests: verifying 5 drafts each 3.0 s, the draft forward 0.5 s: a plain step is 0.29
# of a drafting one
DEAR = StepCost(
    requests=[1, 32], drafts=[0, 5], seconds=[[1.0, 1.5], [1.0, 3.0]], draft_seconds=[0.4, 0.5]
)


def _policy(profile: StepCost, monkeypatch: pytest.MonkeyPatch) -> AdaptiveDepth:
    """The decision on ``profile`` without its exploration of the other kind of step
    (what these tests look at is the decision itself)."""
    s = AdaptiveDepth(5, cost=OnlineStepCost(profile))
    monkeypatch.setattr(s.exploration, "explore", lambda requests, choice: False)
    return s


def _regime(c: float, steps: float = 1e6) -> _Decayed:
    """A regime whose realised conditional acceptance is ``c`` at every position, over
    ``steps`` request-steps."""
    counts = _Decayed(5, 1.0)
    counts.reached, counts.hits = [steps] * 5, [c * steps] * 5
    return counts


def test_the_upper_bound_is_wide_on_few_steps_and_narrow_on_many() -> None:
    m = AcceptanceModel(5)
    fresh = m.new_history()
    assert m.conditional("T=0.8", fresh) == pytest.approx([0.7] * 5)
    wide = m.upper("T=0.8", fresh)
    assert all(0.85 < u < 1.0 for u in wide)  # the prior alone: 4 pseudo-observations
    seasoned = m.new_history()
    for _ in range(300):  # the regime and the request at 0.5 at the first position
        m.observe("T=0.8", seasoned, 1, _ % 2)
    mean, upper = m.conditional("T=0.8", seasoned)[0], m.upper("T=0.8", seasoned)[0]
    assert mean == pytest.approx(0.5, abs=0.05)
    n = sum(m.request_decay**k for k in range(300)) + m.request_weight + 1
    assert upper == pytest.approx(mean + 1.2816 * math.sqrt(mean * (1 - mean) / n))


@pytest.mark.parametrize("rule", [True, False], ids=["with-bound", "without"])
def test_three_bad_steps_at_one_request_do_not_stop_drafting(
    monkeypatch: pytest.MonkeyPatch, rule: bool
) -> None:
    """One request at T=0.8, the acceptance at its prior (0.7 per position), then three
    drafting steps whose first draft is rejected. The mean estimate of the first
    position falls to 0.32 (the others stay 0.7): 1.87 tokens in 1.9 s, below a plain
    step's value; at its upper bound (0.50, the others
    0.96) drafting is 1.4x a plain step. A plain step costs more than half a drafting
    one here, so the request keeps drafting; without the bound (and with no minimum of
    evidence, the decision alone) it goes plain."""
    monkeypatch.setattr(policy, "MIN_EVIDENCE", 0)
    if not rule:
        monkeypatch.setattr(policy, "CHEAP_DRAFTING", math.inf)
    assert _policy(CHEAP, monkeypatch).depths(T08, [None], [5]) == [5]  # at the prior
    s = _policy(CHEAP, monkeypatch)
    h = s.new_history()
    for _ in range(3):
        s.acceptance.observe("T=0.8", h, 5, 0)
    assert s.acceptance.conditional("T=0.8", h)[0] == pytest.approx(0.315, abs=0.01)
    d = s.depths(T08, [h], [5])
    assert (d[0] > 0) == rule, d


def test_a_confident_loss_goes_plain_where_drafting_is_cheap() -> None:
    """At one request, drafting cheap: a regime accepting 0.1 per position over many
    steps and a request whose 20 steps accepted nothing: drafting loses even at the
    upper bound, and the step is plain."""
    s = AdaptiveDepth(5, cost=OnlineStepCost(CHEAP))
    s.acceptance.regimes["T=0.8"] = _regime(0.1)
    h = s.new_history()
    for _ in range(20):
        h.counts.add([0.0])
    assert s.depths(T08, [h], [5]) == [0]


def test_at_32_requests_where_drafting_is_dear_a_clear_loss_goes_plain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """32 fresh requests of a regime accepting 0.6 per position: drafting all makes 2.38
    tokens a request in 3.5 s, 0.68x a plain step's value. A plain step costs 0.29 of a
    drafting one: no bound holds the requests, the step is plain (and at 0.9 per
    position, 1.17x plain, it drafts)."""
    s = _policy(DEAR, monkeypatch)
    s.acceptance.regimes["T=0.8"] = _regime(0.6)
    histories = [s.new_history() for _ in range(32)]
    assert s.depths(T08 * 32, histories, [5] * 32) == [0] * 32
    s = _policy(DEAR, monkeypatch)
    s.acceptance.regimes["T=0.8"] = _regime(0.9)
    assert all(d > 0 for d in s.depths(T08 * 32, histories, [5] * 32))


def test_a_plain_request_is_probed_again_on_a_geometric_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One request, drafting cheap, acceptance confidently poor (the steps are plain):
    drafts are offered again after PROBE_FIRST plain steps, then after twice as many
    each time, so 300 steps hold at most log2(300 / PROBE_FIRST) + 1 probes; a probe
    that accepts everything brings drafting back."""
    s = _policy(CHEAP, monkeypatch)
    s.acceptance.regimes["T=0.8"] = _regime(0.1)
    drafted = []
    for t in range(300):
        d = s.depths(T08, [None], [5])
        s.learn([None], d, [0] * len(d), seconds=CHEAP.seconds_at(1, 1 + d[0], int(d[0] > 0)))
        if d[0]:
            drafted.append(t)
    waits = [PROBE_FIRST * 2**k for k in range(len(drafted))]
    want = [sum(waits[: k + 1]) + k for k in range(len(drafted))]  # plain runs, then a probe
    assert drafted == want and len(drafted) <= math.log2(300 / PROBE_FIRST) + 1, drafted
    # the acceptance turns good: from the next probe on, the steps draft
    s.acceptance.regimes["T=0.8"] = _regime(0.1, steps=10.0)
    steps = []
    for _ in range(2 * s.probes.wait(1) + 2):
        d = s.depths(T08, [None], [5])
        s.learn([None], d, d, seconds=CHEAP.seconds_at(1, 1 + d[0], int(d[0] > 0)))
        steps.append(d[0] > 0)
    first = steps.index(True)
    assert first <= s.probes.wait(1) and all(steps[first:]), steps


def test_probes_back_off_and_reset_once_the_decision_drafts() -> None:
    p = Probes()
    seq = []
    for _ in range(PROBE_FIRST * 7 + 3):
        due = p.due(4)
        seq.append(due)
        p.observe(4, due, due)  # plain but for the probes
    firsts = [i for i, x in enumerate(seq) if x]
    assert firsts == [PROBE_FIRST, 3 * PROBE_FIRST + 1, 7 * PROBE_FIRST + 2]
    assert p.wait(4) == 8 * PROBE_FIRST and p.wait(1) == PROBE_FIRST  # per bucket
    p.observe(4, True, False)  # the decision itself drafts: back to the first wait
    assert p.wait(4) == PROBE_FIRST and not p.due(4)
