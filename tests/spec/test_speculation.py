"""The per-step speculation decision (``xspec/spec/adaptive.py``): how many tokens each
request drafts and verifies, 0 included, decided before drafting.

Greedy outputs equal ``spec=none`` with the decision on, through steps that draft
nothing and mixed batches of 0 and 5 drafts (forced through the test hook, and through
``spec.gamma_schedule``); sampled outputs follow the target through mixed batches and the
trim (chi-square, with a negative control); the decision itself on fixed numbers; the
calibration regimes; the gamma schedule's validation."""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

import xspec
from tests.spec.test_dspark import NEW, PROMPTS, bigram_draft
from tests.spec.test_verify_stats import CHI2_CRIT_0001, assert_follows, chi_square
from xspec.compose import compose_run
from xspec.config import validate
from xspec.errors import ConfigError
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.sampling import SamplingParams
from xspec.spec.adaptive import (
    EXPLORE_BUDGET,
    EXPLORE_EVERY,
    EXPLORE_WIDE,
    AcceptanceModel,
    ConfidenceCorrection,
    Speculation,
    ValueCheck,
    choose_depths,
    gamma_for_batch,
    regime_of,
)
from xspec.spec.block import sample_block
from xspec.spec.calibration import ConfidenceCalibration, RegimeCheck, save_calibration
from xspec.spec.schedule import OnlineStepCost, StepCost
from xspec.spec.verify import rejection_sample

# a step costs 1 s plus 0.1 s per verify row beyond one per request; the draft forward
# 0.5 s whatever the number of drafting requests
COST = StepCost(
    requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.5], [1.0, 5.0]], draft_seconds=[0.5, 0.5]
)


# -- greedy: outputs equal spec=none through plain steps and mixed batches ------------------


@pytest.fixture(scope="module")
def dsv4_baseline() -> list[list[int]]:
    llm = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")
    return [g.token_ids for g in llm.generate(PROMPTS, NEW, ignore_eos=True)]


@pytest.fixture(scope="module")
def bigram_dsv4(tmp_path_factory: pytest.TempPathFactory, dsv4_baseline: list[list[int]]) -> Path:
    """A DSpark draft whose Markov head encodes the target's greedy bigrams (drafts get
    accepted, so a wrong commit would show in the output)."""
    nxt: dict[int, Counter] = defaultdict(Counter)
    for prompt, out in zip(PROMPTS, dsv4_baseline):
        for a, b in itertools.pairwise(prompt[-1:] + out):
            nxt[a][b] += 1
    pairs = {a: c.most_common(1)[0][0] for a, c in nxt.items()}
    return bigram_draft(tmp_path_factory.mktemp("speculation_dspark"), pairs)


class Pattern:
    """Forced depths: step k gives request r ``depths[(k + r) % len(depths)]``, so the
    steps mix drafting and non-drafting requests, and every ``len(depths)``-th step of a
    batch whose pattern is all zero drafts nothing."""

    def __init__(self, depths: list[int]) -> None:
        self.depths, self.step, self.seen = depths, 0, []

    def __call__(self, caps: list[int]) -> list[int]:
        out = [self.depths[(self.step + r) % len(self.depths)] for r in range(len(caps))]
        self.step += 1
        self.seen.append([min(d, c) for d, c in zip(out, caps)])
        return out


@pytest.mark.parametrize(
    "depths",
    [
        [0, 5],  # every step mixes 0 and 5 drafts
        [0, 0, 0, 5, 5],  # some steps of the 4-request batch draft nothing
    ],
)
def test_greedy_equals_baseline_with_plain_steps_and_mixed_batches(
    bigram_dsv4: Path, dsv4_baseline: list[list[int]], depths: list[int]
) -> None:
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="cpu",
        overrides={
            "spec.adaptive": True,
            "spec.adaptive.max_requests": 4,
            "spec.adaptive.profile_reps": 1,
            "spec.num_speculative_tokens": 5,
            "spec.draft_path": str(bigram_dsv4),
        },
    )
    speculation = llm._built.engine.speculation
    assert speculation is not None
    pattern = Pattern(depths)
    speculation.force = pattern
    proposed: list[int] = []
    propose = llm._built.drafter.propose

    def spy(states: list, requests: list, n: int) -> Any:
        proposed.append(len(states))
        return propose(states, requests, n)

    llm._built.drafter.propose = spy  # type: ignore[method-assign]
    out = llm.generate(PROMPTS, NEW, ignore_eos=True)
    assert [g.token_ids for g in out] == dsv4_baseline
    rep = llm.metrics.report()
    assert rep.num_accepted_tokens > 0  # drafts were really accepted
    mixed = [s for s in pattern.seen if 0 in s and 5 in s]
    plain = [s for s in pattern.seen if not any(s)]
    assert mixed, "no step mixed 0 and 5 drafts"
    # only the drafting requests ran the draft forward; steps drafting nothing ran none
    assert len(proposed) == len(pattern.seen) - len(plain)
    assert proposed == [sum(d > 0 for d in s) for s in pattern.seen if any(s)]
    assert rep.num_steps_without_drafts == len(plain)
    assert sum(rep.depth_histogram) == rep.num_row_steps
    if depths.count(0) > 2:
        assert plain, "no step drafted nothing"


def test_gamma_schedule_by_batch_size_greedy_equals_baseline(
    bigram_dsv4: Path, dsv4_baseline: list[list[int]]
) -> None:
    """``spec.gamma_schedule``: two running requests draft nothing, one alone (the third
    prompt, once the first two are done) drafts 2; the output is the baseline's."""
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="cpu",
        overrides={
            "spec.gamma_schedule": [[1, 2], [2, 0]],
            "spec.num_speculative_tokens": 3,
            "spec.draft_path": str(bigram_dsv4),
        },
    )
    out = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=2)
    assert [g.token_ids for g in out] == dsv4_baseline
    rep = llm.metrics.report()
    assert rep.num_steps_without_drafts > 0 and rep.depth_histogram[0] > 0
    assert len(rep.depth_histogram) <= 3  # never more than 2 drafts
    assert rep.num_draft_tokens > 0 and rep.num_accepted_tokens > 0  # the one alone drafted


def test_gamma_schedule_with_mtp_greedy_equals_baseline(dsv4_baseline: list[list[int]]) -> None:
    """``spec.gamma_schedule`` with MTP: steps of two requests draft nothing, the last
    request alone drafts 2 (MTP chains its own hidden); the output is the baseline's and
    the MTP state stays in step through the plain steps."""
    llm = xspec.LLM(
        model="dsv4_tiny_random",
        spec="mtp",
        platform="cpu",
        overrides={"spec.gamma_schedule": [[1, 2], [2, 0]], "spec.num_speculative_tokens": 2},
    )
    out = llm.generate(PROMPTS, NEW, ignore_eos=True, concurrency=2)
    assert [g.token_ids for g in out] == dsv4_baseline
    rep = llm.metrics.report()
    assert rep.num_steps_without_drafts > 0 and rep.num_draft_tokens > 0


# -- sampling: the target distribution through mixed batches and the trim --------------------


def test_sampled_outputs_follow_the_target_through_the_decision() -> None:
    """Steps of 6 requests whose depths (0 or 3, mixed) were decided before drafting from
    the acceptance of earlier steps, drafts for the drafting requests only (Markov loop),
    Algorithm 1's trim on corrected confidences: the first and second committed tokens
    follow p_0 and p_1. The negative control decides the depth from the draft itself."""
    gen = torch.Generator().manual_seed(11)
    vocab, g, n, group = 6, 3, 30_000, 6
    markov = MarkovHead(vocab, 2, dtype=torch.float32, device="cpu")
    head = ConfidenceHead(4, 2, bias=True, dtype=torch.float32, device="cpu")
    for w in (markov.markov_w1.weight, markov.markov_w2.weight, head.proj.weight):
        torch.nn.init.normal_(w, std=1.5, generator=gen)
    base = torch.randn(1, g, vocab, generator=gen)
    hidden = torch.randn(1, g, 4, generator=gen)
    p = torch.softmax(torch.randn(g + 1, vocab, generator=gen), -1)  # [g+1, V]
    shared = torch.Generator().manual_seed(12)
    profile = StepCost(requests=[1, 8], drafts=[0, 3], seconds=[[1.0, 1.1], [1.0, 1.1]])
    speculation = Speculation(g, cost=OnlineStepCost(profile), trim=True)
    # the trim prices rows from the profile alone: this test's wall times (microseconds)
    # must not move it, so that the run is the same every time
    speculation.cost.update = lambda *args: 0.0  # type: ignore[method-assign,union-attr]
    # every 13th step drafts nothing (its 6 requests all get 0), the others mix 0 and 3
    pattern = Pattern([0] * 6 + [3, 3, 0, 3, 3, 0, 3])
    speculation.force = pattern
    params = [SamplingParams(temperature=1.0)] * group
    histories = [speculation.new_history() for _ in range(group)]
    firsts, seconds, lengths_seen = [], [], []
    for _ in range(n // group):
        depths = speculation.depths(params, histories, [g] * group)
        rows = [b for b, d in enumerate(depths) if d > 0]
        drafts = torch.zeros(group, g, dtype=torch.long)
        q = torch.zeros(group, g, vocab)
        conf = torch.zeros(group, g)
        if rows:
            k = len(rows)
            d, qq, prev = sample_block(
                base.expand(k, -1, -1),
                torch.zeros(k, dtype=torch.long),
                markov,
                params[:k],
                [shared] * k,
            )
            drafts[rows], q[rows] = d, qq
            conf[rows] = head(hidden.expand(k, -1, -1), markov.embed(prev)).detach()
        lengths = speculation.trim(conf, depths) if rows else depths
        lengths_seen.append(lengths)
        out = rejection_sample(p.expand(group, -1, -1), drafts, q, [shared] * group, lengths)
        tokens = out.output_tokens
        speculation.observe(histories, lengths, out.num_accepted.tolist())
        firsts.append(tokens[:, 0])
        seconds.append(tokens[:, 1])
    assert any(0 in s and any(x > 0 for x in s) for s in lengths_seen)  # mixed batches
    assert any(not any(s) for s in lengths_seen)  # steps that verified nothing
    flat = [x for s in lengths_seen for x in s]
    assert len(set(flat)) > 2  # the trim made ragged prefixes
    first = torch.cat(firsts)
    second = torch.cat(seconds)
    assert_follows(first, p[0], "first committed token")
    second = second[second >= 0]
    assert second.numel() > n / 50  # rows that verified and accepted d_1
    assert_follows(second, p[1], "second committed token")

    # negative control: verify d_1 only when it is the token the draft over-proposes
    k = n
    d, qq, _ = sample_block(
        base.expand(k, -1, -1),
        torch.zeros(k, dtype=torch.long),
        markov,
        [params[0]] * k,
        [shared] * k,
    )
    t = int((qq[0, 0] - p[0]).argmax())
    cheat = (d[:, 0] == t).long().tolist()
    bad = rejection_sample(p.expand(k, -1, -1), d, qq, [shared] * k, cheat).output_tokens
    stat, dof = chi_square(bad[:, 0], p[0])
    assert stat > CHI2_CRIT_0001[dof - 1], f"negative control passed: chi2={stat:.1f}"


# -- the decision on fixed numbers ------------------------------------------------------------


def test_choose_depths_from_expected_tokens_per_second() -> None:
    # at R=8 each verify row costs 0.1 s and the draft forward 0.5 s: with these survivals
    # nothing pays, a plain step
    cost = OnlineStepCost(COST)
    low = [[0.3, 0.1, 0.05, 0.01, 0.0]] * 8
    assert choose_depths(low, [5] * 8, cost.line(8)) == [0] * 8
    # one request, near-certain drafts, cheap rows: draft all 5
    high = [[0.99, 0.98, 0.97, 0.96, 0.95]]
    assert choose_depths(high, [5], cost.line(1)) == [5]
    # caps (budgets / schedule) bound every depth; a zero cap never drafts
    assert choose_depths(high * 2, [2, 0], cost.line(2)) == [2, 0]
    # mixed: requests whose drafts survive draft, the others do not
    cheap_draft = StepCost(COST.requests, COST.drafts, COST.seconds, draft_seconds=[0.1, 0.1])
    mixed = [[0.99, 0.98, 0.97, 0.96, 0.95], [0.05, 0.0, 0.0, 0.0, 0.0]] * 4
    depths = choose_depths(mixed, [5] * 8, OnlineStepCost(cheap_draft).line(8))
    assert all(d == 0 for d in depths[1::2]) and all(d > 0 for d in depths[0::2]), depths


def test_the_other_kind_of_step_is_measured_a_few_times_when_close() -> None:
    """Far apart (drafting 1.86x a plain step), the decision never takes the worse kind;
    close (within 15 %), it measures both kinds a few times at this batch size."""
    cost = StepCost(
        requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.2]] * 2, draft_seconds=[0.1] * 2
    )
    s = Speculation(2, cost=OnlineStepCost(cost))
    params, histories = [SamplingParams()], [s.new_history()]
    kinds = []
    for _ in range(4):
        depths = s.depths(params, histories, [2])
        kinds.append(depths[0] > 0)
        s.cost.update(1, 1 + depths[0], int(depths[0] > 0), 1.0 + 0.1 * depths[0])  # type: ignore[union-attr]
        s.last = None
    # survivals 0.7, 0.49: drafting 2.19 tokens / 1.18 s vs plain 1 / 1.0: 1.86x, beyond the
    # margin, so no exploration; a flatter estimate is within it
    assert kinds == [True] * 4
    s2 = Speculation(2, cost=OnlineStepCost(cost))
    s2.acceptance.regimes["greedy"] = s2.acceptance.regimes.get("greedy") or _flat(s2, 0.12)
    kinds = []
    for _ in range(4):
        depths = s2.depths(params, [None], [2])
        kinds.append(depths[0] > 0)
        s2.cost.update(1, 1 + depths[0], int(depths[0] > 0), 1.0 + 0.1 * depths[0])  # type: ignore[union-attr]
        value = s2.last.value  # type: ignore[union-attr]
        s2.value_check.observe(depths[0] > 0, 1, value, value)  # delivered as predicted
    # plain is predicted best (1.12 / 1.14 s per drafted step vs 1 / 1.0 s), drafting within
    # the margin: both kinds get measured at this batch size
    assert True in kinds and False in kinds, kinds
    assert s2.value_check.steps(True, 1) >= 1 and s2.value_check.steps(False, 1) >= 1
    # ... a bounded few: EXPLORE_STEPS of the other kind per batch-size bucket
    assert kinds.count(True) <= 2, kinds


def test_the_plain_or_drafting_choice_follows_what_such_steps_delivered() -> None:
    """The model predicts drafting 1.86x a plain step (above). When drafting steps deliver
    only 0.3 of what was predicted for them (and plain steps what was predicted), the
    step is plain; the depths of a drafting step stay the model's."""
    v = ValueCheck()
    assert v.factor(True) == v.factor(False) == 1.0  # no data: the model as it is
    for _ in range(30):
        v.observe(True, 1, 100.0, 30.0)
    overall = (30 * 0.3 + 2) / 32  # shrunk to 1 by 2 pseudo-steps
    assert v.factor(True) == pytest.approx(overall)
    assert v.factor(True, 1) == pytest.approx((30 * 0.3 + 2 * overall) / 32)  # to the kind's
    assert v.factor(False) == v.factor(False, 1) == 1.0
    # another batch-size bucket starts from the kind's factor, then follows its own steps
    assert v.factor(True, 32) == pytest.approx(overall)
    for _ in range(10):
        v.observe(True, 30, 100.0, 100.0)  # 30 requests: the bucket of 23-45
    assert v.factor(True, 32) > 0.8 > v.factor(True, 1)
    assert v.steps(True, 32) == 10 and v.steps(True, 2) == 0
    cost = StepCost(
        requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.2]] * 2, draft_seconds=[0.1] * 2
    )
    s = Speculation(2, cost=OnlineStepCost(cost))
    params, histories = [SamplingParams()], [s.new_history()]
    assert s.depths(params, histories, [2]) == [2]
    s.observe(histories, [2], [1])  # a drafting step: its realised value is taken in
    assert (s.value_check.steps(False, 1), s.value_check.steps(True, 1)) == (0, 1)
    s = Speculation(2, cost=OnlineStepCost(cost))  # (that step's wall time is not the test's)
    histories = [s.new_history()]
    assert s.depths(params, histories, [2]) == [2]
    for _ in range(30):
        s.value_check.observe(True, 1, 1.0, 0.3)
        s.value_check.observe(False, 1, 1.0, 1.0)
    for _ in range(3):  # no exploration either: drafting at about 0.6x plain is beyond the margin
        assert s.depths(params, histories, [2]) == [0]
        s.cost.update(1, 1, 0, 1.0)  # type: ignore[union-attr]


def _shut_out(drafting_ratio: float) -> Speculation:
    """One request whose drafting steps delivered ``drafting_ratio`` of their predicted
    value over 30 steps (plain steps: as predicted)."""
    cost = StepCost(
        requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.2]] * 2, draft_seconds=[0.1] * 2
    )
    s = Speculation(2, cost=OnlineStepCost(cost))
    for _ in range(30):
        s.value_check.observe(True, 1, 1.0, drafting_ratio)
        s.value_check.observe(False, 1, 1.0, 1.0)
    return s


def _kinds(s: Speculation, steps: int, delivered: float) -> list[bool]:
    """``steps`` decisions for one request: drafting steps deliver ``delivered`` of their
    predicted value, plain steps their prediction."""
    params, histories = [SamplingParams()], [s.new_history()]
    kinds = []
    for _ in range(steps):
        drafting = s.depths(params, histories, [2])[0] > 0
        kinds.append(drafting)
        value = s.last.value  # type: ignore[union-attr]
        s.value_check.observe(drafting, 1, value, value * (delivered if drafting else 1.0))
    return kinds


def test_a_kind_of_step_shut_out_is_taken_again_now_and_then() -> None:
    """Drafting steps delivered 0.3 of their prediction (about 0.56x a plain step's value:
    beyond the 15 % margin): the steps are plain, and a drafting step measures it again
    once every ``max(EXPLORE_EVERY, gap / EXPLORE_BUDGET)`` steps (what was learnt of a kind
    never taken would otherwise never change; spaced by its gap, re-exploring costs at most
    EXPLORE_BUDGET of the throughput)."""
    s = _shut_out(0.3)
    # the model: drafting 2.19 tokens / 1.18 s against plain 1 / 1.0 s, times the factors
    gap = 1 - (2.19 / 1.18) * s.value_check.factor(True, 1) / s.value_check.factor(False, 1)
    assert 0.4 < gap < EXPLORE_WIDE
    wait = gap / EXPLORE_BUDGET
    assert wait > EXPLORE_EVERY
    kinds = _kinds(s, int(3 * wait) + 2, 0.3)
    explored = [i for i, k in enumerate(kinds) if k]
    assert len(explored) == 3, explored
    assert explored[0] == math.ceil(wait) - 1, (explored, wait)
    for a, b in itertools.pairwise(explored):  # (the factors move a little with each)
        assert 0.9 * wait < b - a < wait + 2, (explored, wait)


def test_a_kind_shut_out_by_a_stale_factor_comes_back() -> None:
    """Drafting was shut out by a bad spell (0.3 of its prediction), but now delivers what
    the model predicts: the re-exploring step weighs as much as the stale figure, so
    drafting is back after a couple of them, and stays."""
    s = _shut_out(0.3)
    kinds = _kinds(s, 400, 1.0)
    back = next(i for i in range(len(kinds) - 1) if kinds[i] and kinds[i + 1])
    assert sum(kinds[:back]) <= 2, kinds  # two re-explorations at most before it is back
    # ... and stays: from there on, plain only as its own re-explorations (single steps,
    # spaced by at least EXPLORE_EVERY)
    plain = [i for i in range(back, len(kinds)) if not kinds[i]]
    assert plain and all(b - a > EXPLORE_EVERY for a, b in itertools.pairwise(plain)), plain


def test_observe_takes_a_given_step_time() -> None:
    """``seconds`` (a simulated machine's step time) is what the cost model and the value
    check take in, not the wall clock."""
    cost = StepCost(
        requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.2]] * 2, draft_seconds=[0.1] * 2
    )
    s = Speculation(2, cost=OnlineStepCost(cost))
    histories = [s.new_history()]
    assert s.depths([SamplingParams()], histories, [2]) == [2]
    s.observe(histories, [2], [1], seconds=4.0)
    assert s.cost.summary()["measured_ms_mean"] == pytest.approx(4000.0)  # type: ignore[union-attr]
    assert s.value_check.steps(True, 1) == 1


def test_a_kind_far_behind_is_not_re_explored() -> None:
    """Drafting far below plain (gap beyond EXPLORE_WIDE): never re-explored."""
    s = _shut_out(0.1)
    assert not any(_kinds(s, 300, 0.1))


def _flat(s: Speculation, c: float) -> Any:
    """A regime whose realised conditional acceptance is ``c`` at every position."""
    from xspec.spec.adaptive import _Decayed

    counts = _Decayed(s.gamma, 1.0)
    counts.reached, counts.hits = [1e6] * s.gamma, [c * 1e6] * s.gamma
    return counts


def test_acceptance_model_learns_per_regime_and_request() -> None:
    m = AcceptanceModel(3, request_weight=1.0, prior_weight=1.0)
    good, bad = m.new_history(), m.new_history()
    for _ in range(50):
        m.observe("greedy", good, 3, 3)  # accepts everything
        m.observe("greedy", bad, 3, 0)  # rejects the first draft
    a_good, a_bad = m.survivals("greedy", good), m.survivals("greedy", bad)
    assert a_good[0] > 0.9 and a_bad[0] < 0.1
    assert all(x >= y for x, y in itertools.pairwise(a_good))  # survivals fall with j
    # another regime has seen nothing: its prior
    assert m.survivals("T=0.8", None)[0] == pytest.approx(0.7)


def test_confidence_correction_moves_confidences_towards_realised() -> None:
    c = ConfidenceCorrection(2, weight=1.0)
    for _ in range(200):  # the head says 0.9, half of the drafts survive
        c.observe("T=0.8", [0.9, 0.9], 2, 0 if _ % 2 else 2)
    corrected = c.apply(torch.tensor([[0.9, 0.9]]), ["T=0.8"])
    assert corrected[0, 0] == pytest.approx(0.5, abs=0.02)
    untouched = c.apply(torch.tensor([[0.9, 0.9]]), ["greedy"])  # no data for greedy
    assert untouched.tolist() == [[pytest.approx(0.9), pytest.approx(0.9)]]


def test_online_step_cost_moves_from_the_profile_to_measured_times() -> None:
    cost = OnlineStepCost(COST, prior_weight=2.0)
    assert cost.seconds_at(1, 1, 0) == pytest.approx(1.0)  # the profile: verify only
    assert cost.seconds_at(1, 6, 1) == pytest.approx(1.5 + 0.5)  # 5 drafts + the draft forward
    for _ in range(20):
        predicted = cost.update(1, 1, 0, 2.0)  # plain steps measure twice the profile
    assert predicted == pytest.approx(2.0, rel=0.05)
    assert cost.seconds_at(1, 1, 0) == pytest.approx(2.0, rel=0.02)
    # the plain-step scale carries to other batch sizes; drafting steps are not touched
    assert cost.seconds_at(8, 8, 0) == pytest.approx(2.0, rel=0.02)
    assert cost.seconds_at(1, 6, 1) == pytest.approx(2.0)
    summary = cost.summary()
    assert summary["steps"] == 20 and summary["measured_ms_mean"] == pytest.approx(2000.0)
    assert summary["predicted_ms_mean"] < 2000.0  # early predictions were the profile's
    cost.reset_report()  # the report starts afresh, what was learnt stays
    assert cost.summary()["steps"] == 0 and cost.summary()["measured_ms_mean"] is None
    assert cost.seconds_at(1, 1, 0) == pytest.approx(2.0, rel=0.02)


def test_online_step_cost_learns_factors_never_a_cost_per_row() -> None:
    """Steps measured at two row counts, one of them in a slow spell, move every row count
    of that batch size and kind by one factor: what one more row costs stays the profile's
    and a prediction never falls as rows grow (per-row buckets made 3 rows the cheapest of
    2..6, and the trim verified 3 in most steps, never measuring the others again)."""
    cost = OnlineStepCost(COST, prior_weight=2.0)
    for _ in range(10):
        cost.update(1, 4, 1, 3.0)  # 3 drafts of 1 request, slow (the profile: 1.8)
        cost.update(1, 6, 1, 2.0)  # 5 drafts, as profiled
    line = [cost.seconds_at(1, rows, 1) for rows in range(2, 7)]
    assert all(b > a for a, b in itertools.pairwise(line))  # monotone in rows
    profile = [COST.seconds_at(1, rows, 1) for rows in range(2, 7)]
    factor = line[0] / profile[0]
    assert 1.0 < factor < 3.0 / 1.8
    assert line == pytest.approx([factor * p for p in profile])  # one factor for every row
    assert cost.seconds_at(1, 1, 0) == pytest.approx(1.0)  # plain steps of R=1 not moved
    # another batch size of the same kind, never measured, moves with the kind's scale
    assert cost.seconds_at(8, 16, 8) / COST.seconds_at(8, 16, 8) == pytest.approx(factor, rel=0.1)


def test_gamma_for_batch_and_caps() -> None:
    rule = [[1, 5], [8, 3], [16, 0]]
    assert [gamma_for_batch(rule, b) for b in (1, 7, 8, 15, 16, 64)] == [5, 5, 3, 3, 0, 0]
    s = Speculation(4, gamma_schedule=rule)
    assert s.caps(2, [9, 1, 0]) == [4, 1, 0]  # gamma and the budgets bound the rule
    assert s.caps(20, [9]) == [0]


def test_regime_labels() -> None:
    assert regime_of(SamplingParams()) == "greedy"
    assert regime_of(SamplingParams(temperature=0.8)) == "T=0.8"
    assert regime_of(SamplingParams(temperature=1.0, top_k=5, top_p=0.9)) == "T=1,top_k=5,top_p=0.9"


# -- calibration regimes ----------------------------------------------------------------------


def test_a_file_with_several_regimes_picks_each_requests_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy and T=0.8 fits in one file: each request reads its own regime's
    temperatures (silently); T=0.5 has none, gets the nearest (0.8) with a warning."""
    from xspec.spec.calibration import load_calibration

    greedy = ConfidenceCalibration(temperatures=[1.0, 2.0], sampling_temperature=0.0)
    hot = ConfidenceCalibration(temperatures=[3.0, 4.0], sampling_temperature=0.8)
    greedy.regimes = [hot]
    path = tmp_path / "cal.json"
    save_calibration(greedy, path)
    cal = load_calibration(path, 2, "here")
    assert cal == greedy and cal.regimes[0].temperatures == [3.0, 4.0]
    assert cal.select(SamplingParams())[0].temperatures == [1.0, 2.0]
    assert cal.select(SamplingParams(temperature=0.8)) == (hot, None)
    fit, why = cal.select(SamplingParams(temperature=0.5))
    assert fit == hot and why is not None and "none of its 2 fits" in why
    check = RegimeCheck(cal, path)
    with caplog.at_level(logging.WARNING, logger="xspec.spec.calibration"):
        check([SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
        assert caplog.records == []
        check([SamplingParams(temperature=0.5)])
    assert len(caplog.records) == 1 and "temperature 0.5" in caplog.records[0].getMessage()
    # the drafter divides each request's logits by its own regime's temperatures
    from xspec.spec.block import BlockDrafter

    drafter = BlockDrafter.__new__(BlockDrafter)
    drafter.calibration, drafter.device, drafter._temperatures = cal, torch.device("cpu"), {}
    temps = drafter.temperatures([SamplingParams(), SamplingParams(temperature=0.8)])
    assert temps is not None and temps.tolist() == [[1.0, 2.0], [3.0, 4.0]]


def test_the_shipped_calibration_fits_greedy_and_sampled() -> None:
    from xspec.models.presets import ASSETS
    from xspec.spec.calibration import CALIBRATION_FILE, load_calibration

    cal = load_calibration(ASSETS / "dsv4_tiny_dspark" / CALIBRATION_FILE, 5, "asset")
    assert cal.select(SamplingParams())[1] is None
    assert cal.select(SamplingParams(temperature=0.8))[1] is None


# -- spec.gamma_schedule validation -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("[[2,5]]", "must start at 1 and increase strictly"),
        ("[[1,5],[8,3],[8,0]]", "must start at 1 and increase strictly"),
        ("[[1,-1]]", "gamma must be >= 0"),
        ("[[1,5,3]]", r"list of \[min_batch, gamma\] pairs"),
        ("[]", r"list of \[min_batch, gamma\] pairs"),
        ("[[1,9]]", "drafts more than spec.num_speculative_tokens=5"),
    ],
)
def test_gamma_schedule_validation(value: str, match: str) -> None:
    cfg = compose_run(
        [
            "model=dsv4_tiny",
            "spec=dspark",
            "spec.num_speculative_tokens=5",
            f"spec.gamma_schedule={value}",
        ]
    )
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


def test_gamma_schedule_above_the_drafters_gamma_is_refused_before_loading() -> None:
    from xspec.build import check

    cfg = compose_run(["model=dsv4_tiny", "spec=dspark", "spec.gamma_schedule=[[1,9]]"])
    assert any("drafts more than spec.num_speculative_tokens=5" in p for p in check(cfg))
    ok = compose_run(["model=dsv4_tiny", "spec=dspark", "spec.gamma_schedule=[[1,5],[16,0]]"])
    assert check(ok) == []
