"""The per-step speculation decision (``xspec/spec/adaptive/``): how many tokens each
request drafts and verifies, 0 included, decided before drafting.

Greedy outputs equal ``spec=none`` through steps that draft nothing and mixed batches of
0 and 5 drafts (forced by a depth policy of the test's own, and through
``spec.gamma_schedule``); sampled outputs follow the target through mixed batches and the
trim (chi-square, with a negative control); the decision itself on fixed numbers; the
calibration regimes; the gamma schedule's validation."""

from __future__ import annotations

import itertools
import logging
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import xspec
from tests.spec.test_dspark import NEW, PROMPTS, bigram_draft
from tests.spec.test_verify_stats import CHI2_CRIT_0001, assert_follows, chi_square
from xspec.compose import compose_run
from xspec.config import validate
from xspec.engine.engine import Request
from xspec.errors import ConfigError
from xspec.models.base import ForwardBatch
from xspec.models.draft_heads import ConfidenceHead, MarkovHead
from xspec.sampling import SamplingParams, regime_of
from xspec.spec.adaptive import policy
from xspec.spec.adaptive.acceptance import AcceptanceModel, ConfidenceCorrection, YieldCheck
from xspec.spec.adaptive.calibration import ConfidenceCalibration, RegimeCheck, save_calibration
from xspec.spec.adaptive.cost import StepCost
from xspec.spec.adaptive.explore import (
    EXPLORE_BUDGET,
    EXPLORE_EVERY,
    EXPLORE_RUN,
    EXPLORE_STEPS,
    EXPLORE_WIDE,
)
from xspec.spec.adaptive.online import OnlineStepCost
from xspec.spec.adaptive.policy import MIN_EVIDENCE, PLAIN_MARGIN, AdaptiveDepth, gamma_for_batch
from xspec.spec.adaptive.scan import Choice, choose_depths
from xspec.spec.block import sample_block
from xspec.spec.policy import DepthPolicy, PolicySeq
from xspec.spec.step import decode_step, prefill
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


def dspark_dsv4(policy: DepthPolicy, overrides: dict[str, Any] | None = None) -> xspec.LLM:
    """``dsv4_tiny_random`` with DSpark at gamma 5 deciding depths by ``policy``."""
    return xspec.LLM(
        model="dsv4_tiny_random",
        spec="dspark",
        platform="cpu",
        overrides={"spec.num_speculative_tokens": 5, **(overrides or {})},
        depth_policy=policy,
    )


class Pattern(DepthPolicy):
    """Forced depths: step k gives request r ``depths[(k + r) % len(depths)]`` (within its
    cap), so the steps mix drafting and non-drafting requests, and every
    ``len(depths)``-th step of a batch whose pattern is all zero drafts nothing. A depth
    policy of its own, and a ``force`` for :class:`AdaptiveDepth`."""

    def __init__(self, depths: list[int]) -> None:
        self.depths, self.step, self.seen = depths, 0, []

    def __call__(self, caps: list[int]) -> list[int]:
        out = [self.depths[(self.step + r) % len(self.depths)] for r in range(len(caps))]
        self.step += 1
        self.seen.append([min(d, c) for d, c in zip(out, caps)])
        return out

    def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
        self(caps)
        return self.seen[-1]


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
    pattern = Pattern(depths)
    llm = dspark_dsv4(pattern, {"spec.draft_path": str(bigram_dsv4)})
    proposed: list[int] = []
    propose = llm.built.drafter.propose

    def spy(states: list, requests: list, n: int) -> Any:
        proposed.append(len(states))
        return propose(states, requests, n)

    llm.built.drafter.propose = spy  # type: ignore[method-assign]
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


def test_draft_context_after_mixed_batches_equals_one_written_from_scratch() -> None:
    """What the greedy equality above cannot see (a wrong draft context only lowers the
    acceptance): after decode steps that mix drafting and non-drafting requests, plain
    steps, and a request that does not draft for longer than its held buffer (its rows go
    to its backlog), every request's DSpark context rings equal those of a cache written
    from the target's captures of its whole committed sequence at once."""
    pattern = Pattern([0, 0, 0, 5, 5])

    class Late(DepthPolicy):  # request 0: no draft for its first 20 steps
        def decide(self, seqs: Sequence[PolicySeq], caps: list[int]) -> list[int]:
            depths = pattern.decide(seqs, caps)
            return [0 if r == 0 and pattern.step <= 20 else d for r, d in enumerate(depths)]

    b = dspark_dsv4(Late()).built
    draft = b.drafter.model
    params = SamplingParams(temperature=0.8, seed=1)
    seqs = [b.engine._start(Request(p, 36, params)) for p in (*PROMPTS, PROMPTS[0])]
    prefill(b.target, b.drafter, seqs, b.capture, 2048)
    while any(s.remaining > 0 for s in seqs):
        live = [s for s in seqs if s.remaining > 0]
        decode_step(b.target, b.drafter, live, b.capture, b.engine.metrics, policy=b.engine.policy)
    assert any(not any(d) for d in pattern.seen) and any(0 in d and 5 in d for d in pattern.seen)
    for s in seqs:
        draft.flush_context([s.draft_state])
        n = len(s.token_ids) - 1  # every committed position but the last anchor
        assert s.draft_state.num_tokens == n
        target_state = b.target.new_state(n)
        out = b.target.forward(
            ForwardBatch(torch.tensor(s.token_ids[:n]), [n], [target_state], b.capture)
        )
        ref = draft.new_cache(5)
        draft.write_context([ref], out.aux_hidden, [n])
        draft.flush_context([ref])
        for got, want in zip(s.draft_state.rings, ref.rings):
            torch.testing.assert_close(got.data, want.data, atol=1e-4, rtol=1e-4)


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
    # every 13th step drafts nothing (its 6 requests all get 0), the others mix 0 and 3
    pattern = Pattern([0] * 6 + [3, 3, 0, 3, 3, 0, 3])
    speculation = AdaptiveDepth(g, cost=OnlineStepCost(profile), trim=True, force=pattern)
    # the trim prices rows from the profile alone: this test's wall times (microseconds)
    # must not move it, so that the run is the same every time
    speculation.cost.update = lambda *args: 0.0  # type: ignore[method-assign,union-attr]
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
        speculation.learn(histories, lengths, out.num_accepted.tolist())
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


# one request, drafts at most 2: a step costs 1 s plus 0.04 s per verify row, the draft
# forward 0.1 s
LINE = StepCost(requests=[1, 8], drafts=[0, 5], seconds=[[1.0, 1.2]] * 2, draft_seconds=[0.1] * 2)


def _machine(
    s: AdaptiveDepth,
    steps: int,
    draft_cost: float | Callable[[int], float],
    speed: Callable[[int], float] = lambda t: 1.0,
    profile: StepCost = LINE,
) -> list[bool]:
    """``steps`` decisions for one request whose drafts all survive (2 drafts: 3 tokens in
    1.18 s by the profile, 2.54x a plain step's 1 token in 1.0 s) on a synthetic machine:
    a step takes the profile's time times ``speed(t)``, times ``draft_cost`` (or
    ``draft_cost(t)``) when it drafts. Returns which steps drafted. ``profile``: the
    step-cost model's and the machine's, when not LINE."""
    s.acceptance.regimes["greedy"] = _flat(s, 1.0)
    params, kinds = [SamplingParams()], []
    for t in range(steps):
        d = s.depths(params, [None], [2])[0]
        cost = draft_cost(t) if callable(draft_cost) else draft_cost
        seconds = profile.seconds_at(1, 1 + d, int(d > 0)) * speed(t) * (cost if d else 1.0)
        s.learn([None], [d], [d], seconds=seconds)
        kinds.append(d > 0)
    return kinds


def _runs(kinds: list[bool], kind: bool) -> list[int]:
    """Where the steps of ``kind`` are (indices)."""
    return [i for i, k in enumerate(kinds) if k == kind]


def _spans(steps: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive step indices: ``(first, last)`` each."""
    spans: list[tuple[int, int]] = []
    for i in steps:
        if spans and i == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], i)
        else:
            spans.append((i, i))
    return spans


def _re_explored(steps: list[int], every: float) -> bool:
    """``steps`` (of a kind not taken) are re-explorations: runs of at most EXPLORE_RUN
    steps, each started at least ``every`` steps after the last one ended."""
    spans = _spans(steps)
    return all(b - a < EXPLORE_RUN for a, b in spans) and all(
        b[0] - a[1] >= every for a, b in itertools.pairwise(spans)
    )


def test_each_kind_of_step_is_measured_a_few_times_whatever_the_gap() -> None:
    """Before its first contrasts the model cannot tell the machine's speed from the cost
    of drafting, so in the first batch-size bucket seen the kind predicted worse is taken
    EXPLORE_STEPS times, in runs of EXPLORE_RUN alternating with runs as long of the best
    (each run a contrast, from its steps after the first), even far behind (drafting
    2.54x a plain step here); then, far behind, never again. (A bucket seen later: the
    next test.)"""
    assert EXPLORE_RUN == 2 and EXPLORE_STEPS == 4
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    kinds = _machine(s, 200, 1.0)
    assert _runs(kinds, False) == [2, 3, 6, 7], kinds[:10]  # DD PP DD PP DD ...
    assert s.exploration.kinds.steps(False, 1) == 4 and s.exploration.kinds.steps(True, 1) == 196
    assert s.cost.contrasts(1) == 3  # type: ignore[union-attr]  # 3 sandwiches
    # another batch-size bucket is explored on its own
    assert s.exploration.kinds.steps(False, 8) == 0


def _batch(
    s: AdaptiveDepth, requests: int, steps: int, c: float, *, as_expected: bool = False
) -> list[bool]:
    """``steps`` decisions for ``requests`` requests, 2 drafts each at most, a conditional
    acceptance of ``c`` per position, on the profile's machine; which steps drafted.
    Every draft is accepted, or with ``as_expected`` what ``c`` makes (its expected
    count, as a running total rounded down per request: the yield check stays at 1)."""
    s.acceptance.regimes["greedy"] = _flat(s, c)
    params, kinds = [SamplingParams()] * requests, []
    owed = [0.0] * requests  # expected accepted drafts so far, per request
    for _ in range(steps):
        d = s.depths(params, [None] * requests, [2] * requests)
        rows, drafting = requests + sum(d), sum(k > 0 for k in d)
        seconds = LINE.seconds_at(requests, rows, drafting)
        accepted = d
        if as_expected:
            before = [math.floor(o) for o in owed]
            owed = [o + sum(c**j for j in range(1, k + 1)) for o, k in zip(owed, d)]
            accepted = [math.floor(o) - b for o, b in zip(owed, before)]
        s.learn([None] * requests, d, accepted, seconds=seconds)
        kinds.append(drafting > 0)
    return kinds


def _gap(s: AdaptiveDepth, requests: int, c: float) -> float:
    """1 - plain's value / drafting's (every request drafting 2) at ``requests``."""
    assert s.cost is not None
    line = s.cost.line(requests, 3 * requests)
    drafting = (requests * (1 + c + c * c)) / line(3 * requests, requests)
    return 1 - (requests / line(requests, 0)) / drafting


@pytest.mark.parametrize("c", [1.0, 0.35], ids=["far-apart", "within-wide"])
def test_a_new_bucket_is_explored_late_and_only_near_a_tie_once_another_has_contrasts(
    c: float,
) -> None:
    """A bucket first seen after another's contrasts (the speed is known then; only its
    relative cost of drafting is not): plain, far behind drafting (a gap beyond
    EXPLORE_WIDE), is not explored; within it, explored EXPLORE_STEPS times, each after
    EXPLORE_EVERY steps of the bucket without it (a bucket a workload visits a few steps
    at a time, the tail of a wave, pays no exploration for them). With no contrast
    anywhere, a bucket is explored at once, alternating, whatever the gap. (Each
    exploration: EXPLORE_RUN = 2 steps.)"""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    _machine(s, 20, 1.0)  # one request: explored, three contrasts
    assert s.cost is not None and s.cost.contrasted() and s.cost.contrasted(2)
    assert not s.cost.contrasted(1)  # (but its own bucket's)
    gap = _gap(s, 2, c)
    assert gap > 0 and (gap > EXPLORE_WIDE) == (c == 1.0), gap
    kinds = _batch(s, 2, 3 * EXPLORE_EVERY, c, as_expected=True)  # a bucket of its own
    plain = _runs(kinds, False)
    E = EXPLORE_EVERY
    assert plain == ([] if c == 1.0 else [E, E + 1, 2 * E + 2, 2 * E + 3]), kinds
    fresh = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    assert not fresh.cost.contrasted()  # type: ignore[union-attr]
    assert _runs(_batch(fresh, 2, 20, c, as_expected=True), False) == [2, 3, 6, 7]


def test_a_drafting_step_dearer_than_profiled_turns_the_choice_to_plain() -> None:
    """Drafting steps take 3x their profiled time on this machine (plain steps as
    profiled): 2.54 / 3 = 0.85x a plain step's value. The contrasts of the first steps
    teach the model that, and the steps turn plain."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    kinds = _machine(s, 200, 3.0)
    drafted = _runs(kinds[10:], True)  # past the first exploration: re-explorations only
    assert _re_explored(drafted, EXPLORE_EVERY), drafted
    assert math.exp(s.cost.relative_cost(1)) == pytest.approx(3.0, rel=0.25)  # type: ignore[union-attr]


@pytest.mark.parametrize("draft_cost", [3.0, 1.5], ids=["plain-right", "drafting-right"])
def test_a_slow_spell_does_not_flip_the_plain_or_drafting_choice(draft_cost: float) -> None:
    """The machine slows down 2x for a spell of 100 steps, then back, over and over. The
    speed moves both kinds alike: whichever kind is right (plain, drafting at 3x its
    profiled time, 0.85x plain's value; drafting, at 1.5x, 1.69x plain's) stays the
    choice, but for re-explorations (runs of EXPLORE_RUN) spaced by at least
    EXPLORE_EVERY."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    kinds = _machine(s, 800, draft_cost, speed=lambda t: 2.0 if (t // 100) % 2 else 1.0)
    wrong = _runs(kinds[100:], draft_cost > 2.54)  # the kind that is not right
    assert len(_spans(wrong)) <= 700 / EXPLORE_EVERY + 1, wrong
    assert _re_explored(wrong, EXPLORE_EVERY), wrong


@pytest.mark.parametrize("ahead", [1.02, 1.10], ids=["within-margin", "beyond-margin"])
def test_drafting_must_be_predicted_a_margin_ahead_of_plain(ahead: float) -> None:
    """A machine (and profile) on which drafting 2 drafts, all accepted, makes ``ahead`` x
    a plain step's value (3 tokens in ``3 / ahead`` s, a plain step 1 token in 1 s):
    2 % ahead, within PLAIN_MARGIN, the steps are plain (drafting only as the first
    exploration and re-explorations, runs of EXPLORE_RUN spaced by at least EXPLORE_EVERY);
    10 % ahead, they draft (plain only so)."""
    assert 0.02 < PLAIN_MARGIN < 0.10
    # verify 1.0 s plus 0.2 * (s5 - 1.0) per draft row, the draft forward 0.1 s
    s5 = 1.0 + (3 / ahead - 1.1) / 0.4
    near = StepCost(
        requests=[1, 8], drafts=[0, 5], seconds=[[1.0, s5]] * 2, draft_seconds=[0.1] * 2
    )
    assert near.seconds_at(1, 3, 1) == pytest.approx(3 / ahead)
    s = AdaptiveDepth(2, cost=OnlineStepCost(near))
    kinds = _machine(s, 400, 1.0, profile=near)
    wrong = _runs(kinds[10:], ahead < 1 + PLAIN_MARGIN)  # the kind the margin rules out
    assert len(_spans(wrong)) <= 390 / EXPLORE_EVERY + 1, wrong
    assert _re_explored(wrong, EXPLORE_EVERY), wrong


def test_observe_takes_a_given_step_time() -> None:
    """``seconds`` (a simulated machine's step time) is what the cost model takes in, not
    the wall clock."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    histories = [s.new_history()]
    assert s.depths([SamplingParams()], histories, [2]) == [2]
    s.learn(histories, [2], [1], seconds=4.0)
    assert s.cost.summary()["measured_ms_mean"] == pytest.approx(4000.0)  # type: ignore[union-attr]
    assert s.exploration.kinds.steps(True, 1) == 1


def test_drafting_steps_that_commit_less_than_expected_turn_the_choice_to_plain() -> None:
    """The acceptance model expects 1.19 accepted drafts of a drafting step (survivals 0.7,
    0.49: 2.19 tokens in 1.18 s, 1.86x a plain step); drafting steps commit 1 token (all
    rejected): :class:`YieldCheck` corrects the drafting value by what such steps
    committed (0.46x: a factor of about 0.5 after 60 such steps, shrunk to 1 by 8
    pseudo-steps), and the steps are plain."""
    y = YieldCheck()
    assert y.factor() == y.factor(1) == 1.0  # no data: the model as it is
    for _ in range(60):
        y.observe(1, 1.19, 0)
    n, ratio = sum(0.95**k for k in range(60)), 1 / 2.19  # decayed steps; realised/expected
    overall = (n * ratio + 8) / (n + 8)  # shrunk to 1 by 8 pseudo-steps
    assert y.factor() == pytest.approx(overall)
    assert y.factor(1) == pytest.approx((n * ratio + 8 * overall) / (n + 8))  # to the overall
    assert y.factor(1) < 0.52
    # another batch-size bucket starts from the overall factor, then follows its own steps
    assert y.factor(32) == pytest.approx(overall)
    for _ in range(30):
        y.observe(30, 10.0, 10)  # 30 requests (the bucket of 23-45): as expected
    assert y.factor(32) > 0.85 > y.factor(1)
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    params, histories = [SamplingParams()], [s.new_history()]
    assert s.depths(params, histories, [2]) == [2]
    s.yield_check = y
    kinds = []
    while s.acceptance.evidence("greedy") < MIN_EVIDENCE:  # (the next test)
        depths = s.depths(params, [None], [2])
        s.learn([None], depths, [0], seconds=LINE.seconds_at(1, 1 + depths[0], depths[0]))
        kinds.append(depths[0] > 0)
    assert kinds.count(False) <= 2  # the exploration of plain steps; else drafting
    for _ in range(4):  # plain from then on
        assert s.depths(params, [None], [2]) == [0]
        s.learn([None], [0], [0], seconds=LINE.seconds_at(1, 1, 0))


# four requests: a step costs 1 s plus 0.05 s per verify row beyond one per request, the
# draft forward 0.5 s; drafting all 5 drafts each pays above 1.5 expected accepted drafts
# per request (survivals summed)
FOUR = StepCost(requests=[1, 4], drafts=[0, 5], seconds=[[1.0, 2.0]] * 2, draft_seconds=[0.5] * 2)
UNLUCKY = [0, 1, 0, 0, 1, 0, 0, 1]  # accepted drafts of 8 request-steps (5 verified each)


@pytest.mark.parametrize("rule", [True, False], ids=["with-rule", "without"])
def test_plain_is_not_chosen_on_too_little_acceptance(
    monkeypatch: pytest.MonkeyPatch, rule: bool
) -> None:
    """Two unlucky drafting steps of four requests (3 of 8 request-steps past the first
    draft, where a true 0.8 per position makes 2.7 accepted drafts a request-step) put
    the estimates at 0.48, 0.40, 0.7, ... per position (0.97 expected accepted drafts
    of 5: plain wins; the best drafting option, 2 drafts each, makes 0.88 of its value,
    within EXPLORE_WIDE). A plain step
    learns nothing of the acceptance, so a plain choice would stand on those 8
    request-steps until a re-exploration: the steps draft until the regime has
    MIN_EVIDENCE request-steps (but for the exploration of plain steps), and only that
    evidence, as unlucky, turns them plain. Without the rule the first decision is
    plain."""
    if not rule:
        monkeypatch.setattr(policy, "MIN_EVIDENCE", 0)
    s = AdaptiveDepth(5, cost=OnlineStepCost(FOUR))
    params = [SamplingParams(temperature=0.8)] * 4
    for a in UNLUCKY:
        s.acceptance.observe("T=0.8", None, 5, a)
    first = s.depths(params, [None] * 4, [5] * 4)
    if not rule:
        assert first == [0] * 4
        return
    assert all(d > 0 for d in first), first  # the drafting option's depths
    line = OnlineStepCost(FOUR).line(4, 24)
    kinds = []
    for t in itertools.count():
        if s.acceptance.evidence("T=0.8") >= MIN_EVIDENCE:
            break
        d = s.depths(params, [None] * 4, [5] * 4)
        accepted = [min(k, UNLUCKY[(4 * t + r) % 8]) for r, k in enumerate(d)]
        rows, drafting = 4 + sum(d), sum(k > 0 for k in d)
        s.learn([None] * 4, d, accepted, seconds=line(rows, drafting))
        kinds.append(drafting > 0)
    assert kinds.count(True) >= len(kinds) - 2, kinds  # drafting, but two explorations
    assert len(kinds) <= MIN_EVIDENCE // 4 + 8  # MIN_EVIDENCE (decayed) / R + explorations
    # the evidence is in, as unlucky: plain from then on (the drafting step is within
    # EXPLORE_WIDE: only spaced re-explorations take it again)
    for _ in range(EXPLORE_EVERY - 4):
        d = s.depths(params, [None] * 4, [5] * 4)
        assert d == [0] * 4
        s.learn([None] * 4, d, [0] * 4, seconds=line(4, 0))


def test_a_kind_of_step_shut_out_is_taken_again_now_and_then() -> None:
    """Drafting steps take 4x their profiled time (0.64x a plain step's value, a gap of
    0.36-0.39 with PLAIN_MARGIN): the steps are plain, and a run of EXPLORE_RUN drafting
    steps measures it again once every ``max(EXPLORE_EVERY, EXPLORE_RUN * gap *
    (drafting / plain seconds) / EXPLORE_BUDGET)`` steps, about 1400 here (what was
    learnt of a kind never taken would otherwise never change; spaced so, re-exploring
    costs at most EXPLORE_BUDGET of the time)."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    kinds = _machine(s, 7000, 4.0)
    gap = 1 - 2.54 / 4.0 / (1 + PLAIN_MARGIN)
    slower = LINE.seconds_at(1, 3, 1) * 4.0 / LINE.seconds_at(1, 1, 0)
    wait = EXPLORE_RUN * gap * slower / EXPLORE_BUDGET
    assert gap < EXPLORE_WIDE and wait > EXPLORE_EVERY
    explored = _spans(_runs(kinds[12:], True))
    assert all(b - a == EXPLORE_RUN - 1 for a, b in explored), explored  # runs of 2
    # spaced by the gap the model has learnt, which approaches the machine's from below
    # as the contrasts grow in number (the relative cost is shrunk to the profile's)
    spacing = [b[0] - a[1] for a, b in itertools.pairwise(explored)]
    assert len(spacing) >= 3 and all(EXPLORE_EVERY <= x < wait + 2 for x in spacing), spacing
    assert spacing[-1] > 0.8 * wait, (spacing, wait)


def test_a_kind_shut_out_comes_back_when_it_pays_again() -> None:
    """Drafting was shut out (4x its profiled time), then the machine changes and drafting
    steps take their profiled time again: the next re-exploration's contrast brings it
    back, and it stays (plain only as its own re-explorations, runs of EXPLORE_RUN spaced
    by at least EXPLORE_EVERY)."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    kinds = _machine(s, 3000, lambda t: 4.0 if t < 300 else 1.0)
    assert sum(kinds[12:300]) <= EXPLORE_RUN, kinds[12:300]  # shut out
    back = next(i for i in range(300, len(kinds) - 2) if all(kinds[i : i + 3]))
    assert sum(kinds[300:back]) <= 2 * EXPLORE_RUN, kinds[300:back]  # two re-explorations
    plain = _runs(kinds[back:], False)
    assert plain and _re_explored(plain, EXPLORE_EVERY), plain


def test_a_kind_far_behind_is_not_re_explored() -> None:
    """Drafting at 10x its profiled time (0.25x a plain step, a gap beyond EXPLORE_WIDE):
    after the first contrasts, never re-explored."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    assert not any(_machine(s, 400, 10.0)[20:])


def _explorations(s: AdaptiveDepth, gaps: list[float]) -> list[int]:
    """Feed ``_explore`` one drafting choice per gap (plain predicted ``1 - gap`` of its
    value, in 0.6 of its seconds) after both kinds were measured; the steps it explored."""
    for kind in [False] * EXPLORE_STEPS + [True]:
        s.exploration.kinds.observe(kind, 1)
    explored = []
    for t, gap in enumerate(gaps):
        choice = Choice([2], 1.0, [0], 1.0 - gap, 1.5, 0.0, seconds=1.0, other_seconds=0.6)
        plain = s.exploration.explore(1, choice)
        s.exploration.kinds.observe(not plain, 1)
        if plain:
            explored.append(t)
    return explored


def test_one_steps_dip_of_the_gap_does_not_re_explore() -> None:
    """The gap goes by its bucket's EMA: at 0.6 (beyond EXPLORE_WIDE) with one step in 10
    at 0.3 (one request's bad step), the kind not taken is never re-explored; held at 0.3
    it is, in runs of EXPLORE_RUN spaced by the wait of that gap."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
    assert _explorations(s, [0.3 if t % 10 == 9 else 0.6 for t in range(600)]) == []
    explored = _explorations(AdaptiveDepth(2, cost=OnlineStepCost(LINE)), [0.3] * 1200)
    wait = max(EXPLORE_EVERY, EXPLORE_RUN * 0.3 * 0.6 / EXPLORE_BUDGET)
    assert len(_spans(explored)) >= int(1200 / wait) - 1, explored  # at that pace
    assert _re_explored(explored, wait), explored


def _flat(s: AdaptiveDepth, c: float) -> Any:
    """A regime whose realised conditional acceptance is ``c`` at every position."""
    from xspec.spec.adaptive.acceptance import _Decayed

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


def test_a_few_unlucky_steps_move_a_request_less_than_its_regime_holds() -> None:
    """A request of a regime accepting 0.8 at its first position, its own steps like its
    regime's, then five steps whose first draft is rejected (bad luck at T=0.8): its
    first position's estimate stays above 0.6 (the default shrinkage to its regime, 10
    pseudo-observations); with 3 (the weight before 2026-12-05) it falls to 0.56, and at
    one request such dips turned the decision plain for 10-25 steps of a run."""

    def after_bad_luck(m: AcceptanceModel) -> tuple[float, float]:
        h = m.new_history()
        for i in range(200):  # 4 of every 5 first drafts accepted, then the second
            m.observe("T=0.8", h, 5, 2 if i % 5 else 0)
        regime = m.conditional("T=0.8", None)[0]
        for _ in range(5):
            m.observe("T=0.8", h, 5, 0)
        return regime, m.conditional("T=0.8", h)[0]

    regime, own = after_bad_luck(AcceptanceModel(5))
    assert regime == pytest.approx(0.8, abs=0.02)
    assert own > 0.6
    _, own3 = after_bad_luck(AcceptanceModel(5, request_weight=3.0))
    assert own3 < 0.6


def test_steps_without_drafts_age_a_requests_history_back_to_its_regime() -> None:
    """A step that verified nothing decays every count of the request (held as one
    factor, applied at its next count): its estimate drifts back to its regime's, the
    same as decaying each count step by step."""
    m = AcceptanceModel(3, request_weight=1.0, prior_weight=1.0)
    bad, fresh = m.new_history(), m.new_history()
    for _ in range(20):
        m.observe("greedy", bad, 3, 1)  # its second draft is always rejected
        m.observe("greedy", None, 3, 3)  # the regime accepts everything
    before = m.conditional("greedy", bad)[1]
    for _ in range(30):
        m.observe("greedy", bad, 0, 0)  # plain steps
    aged = m.conditional("greedy", bad)[1]
    regime = m.conditional("greedy", fresh)[1]
    assert before < 0.2 and before < aged < regime
    # the counts as decayed one step at a time (request_decay per plain step)
    c = bad.counts
    assert c.scale == pytest.approx(m.request_decay**30)
    hits, reached = [c.scale * h for h in c.hits], [c.scale * r for r in c.reached]
    assert aged == pytest.approx((hits[1] + m.batch_rates("greedy")[1]) / (reached[1] + 1.0))
    m.observe("greedy", bad, 1, 1)  # a count applies the held ageing first
    assert c.scale == 1.0
    assert c.reached[0] == pytest.approx(reached[0] * m.request_decay + 1.0)
    assert (c.reached[1], c.hits[1]) == pytest.approx((reached[1], hits[1]))  # aged only


def test_confidence_correction_moves_confidences_towards_realised() -> None:
    c = ConfidenceCorrection(2, weight=1.0)
    for _ in range(200):  # the head says 0.9, half of the drafts survive
        c.observe("T=0.8", [0.9, 0.9], 2, 0 if _ % 2 else 2)
    corrected = c.apply([[0.9, 0.9], [1.5, -0.5]], ["T=0.8", "T=0.8"])
    assert corrected[0][0] == pytest.approx(0.5, abs=0.02)
    assert corrected[1] == [pytest.approx(1.5 * corrected[0][0] / 0.9), 0.0]  # clamped
    untouched = c.apply([[0.9, 0.9]], ["greedy"])  # no data for greedy
    assert untouched == [[pytest.approx(0.9), pytest.approx(0.9)]]


def test_online_step_cost_moves_from_the_profile_to_measured_times() -> None:
    cost = OnlineStepCost(COST, prior_weight=2.0)
    assert cost.seconds_at(1, 1, 0) == pytest.approx(1.0)  # the profile: verify only
    assert cost.seconds_at(1, 6, 1) == pytest.approx(1.5 + 0.5)  # 5 drafts + the draft forward
    for _ in range(20):
        predicted = cost.update(1, 1, 0, 2.0)  # plain steps measure twice the profile
    assert predicted == pytest.approx(2.0, rel=0.05)
    assert cost.seconds_at(1, 1, 0) == pytest.approx(2.0, rel=0.02)
    # the machine's speed moves both kinds (no contrast: the relative cost is the
    # profile's) and carries to a batch size not seen yet
    assert cost.seconds_at(1, 6, 1) == pytest.approx(2.0 * 2.0, rel=0.02)
    assert cost.seconds_at(8, 8, 0) == pytest.approx(2.0, rel=0.02)
    summary = cost.summary()
    assert summary["steps"] == 20 and summary["measured_ms_mean"] == pytest.approx(2000.0)
    assert summary["predicted_ms_mean"] < 2000.0  # early predictions were the profile's
    assert summary["speed"] == pytest.approx(2.0, rel=0.02)
    cost.reset_report()  # the report starts afresh, what was learnt stays
    assert cost.summary()["steps"] == 0 and cost.summary()["measured_ms_mean"] is None
    assert cost.seconds_at(1, 1, 0) == pytest.approx(2.0, rel=0.02)


@pytest.mark.parametrize("line_of", [lambda r: r, lambda r: r + 1])
def test_a_step_is_learnt_alike_from_the_decisions_line_or_a_fresh_read(
    line_of: Callable[[int], int],
) -> None:
    """:meth:`AdaptiveDepth.observe` hands the cost model the line the step was decided on
    (the profile's figures and the prediction are read once per step): what is learnt
    is what a fresh read of the model gives, and a line of another batch size (a caller
    that decided on another batch) is not taken for this one."""
    given, fresh = OnlineStepCost(COST), OnlineStepCost(COST)
    steps = [(1, 1, 0, 2.0), (1, 6, 1, 5.0), (1, 6, 1, 5.1), (1, 1, 0, 2.1), (1, 1, 0, 2.0)]
    steps += [(4, 12, 4, 9.0), (4, 4, 0, 4.5)]
    for _ in range(3):
        for requests, rows, drafting, seconds in steps:
            line = given.line(line_of(requests), line_of(requests) + 20)
            predicted = given.update(requests, rows, drafting, seconds, line)
            assert predicted == pytest.approx(fresh.update(requests, rows, drafting, seconds))
    assert given.levels.keys() == fresh.levels.keys()
    assert given.contrasts(1) == fresh.contrasts(1) > 0
    for r in given.levels:
        assert given.levels[r] == pytest.approx(fresh.levels[r])
        assert given.relative_cost(r) == pytest.approx(fresh.relative_cost(r))
    mine, theirs = given.summary(), fresh.summary()
    assert mine.pop("relative_cost_drafting") == pytest.approx(theirs.pop("relative_cost_drafting"))
    assert mine.pop("step_noise") == pytest.approx(theirs.pop("step_noise"))
    assert mine.pop("switch_cost") == pytest.approx(theirs.pop("switch_cost"))
    assert mine == pytest.approx(theirs)


def _sandwiches(cost: OnlineStepCost, n: int, plain: float, drafting: float) -> None:
    """``n`` times: two plain steps, two drafting steps, two plain steps (R=1, 5 drafts),
    taking ``plain`` and ``drafting`` times their profiled seconds."""
    for _ in range(n):
        for rows, drafts, factor in ((1, 0, plain), (6, 1, drafting), (1, 0, plain)):
            for _ in range(2):
                cost.update(1, rows, drafts, factor * COST.seconds_at(1, rows, drafts))


def test_the_relative_cost_of_drafting_is_learnt_from_contrasts_only() -> None:
    """Drafting steps take 2x their profile where plain steps take theirs: a run of drafting
    steps between two of plain ones (a contrast) teaches that. A slow spell (3x) in a run of
    plain steps then moves both kinds' predictions (the machine's speed) and leaves the
    relative cost alone. The earlier model's scale per kind kept drafting at the speed
    it was last measured at: plain 3x, drafting 2x, and the choice flipped to drafting."""
    cost = OnlineStepCost(COST)
    _sandwiches(cost, 10, 1.0, 2.0)
    assert cost.contrasts(1) == 19  # PP DD PPPP DD PPPP ...: each run but the ends
    assert math.exp(cost.relative_cost(1)) == pytest.approx(2.0, rel=0.03)
    assert cost.seconds_at(1, 1, 0) == pytest.approx(1.0, rel=0.03)
    assert cost.seconds_at(1, 6, 1) == pytest.approx(2.0 * 2.0, rel=0.03)
    relative = cost.relative_cost(1)
    for _ in range(40):
        cost.update(1, 1, 0, 3.0)  # a slow spell, plain steps only
    assert cost.relative_cost(1) == relative and cost.contrasts(1) == 19
    assert cost.seconds_at(1, 1, 0) == pytest.approx(3.0, rel=0.02)
    assert cost.seconds_at(1, 6, 1) == pytest.approx(3.0 * 2.0 * 2.0, rel=0.05)
    # drafting steps between plain steps of different speeds saw the speed change:
    # no contrast
    for rows, drafts, seconds in ((6, 1, 2.0 * COST.seconds_at(1, 6, 1)), (1, 0, 1.0)):
        for _ in range(2):
            cost.update(1, rows, drafts, seconds)
    assert cost.contrasts(1) == 19
    # nor do steps of the two kinds far apart (another batch size's steps between)
    for _ in range(10):
        cost.update(8, 8, 0, 1.0)
    for rows, drafts, seconds in ((6, 1, 2.0 * COST.seconds_at(1, 6, 1)), (1, 0, 1.0)):
        for _ in range(2):
            cost.update(1, rows, drafts, seconds)
    assert cost.contrasts(1) == 19
    # other batch-size buckets keep their own (none yet: the profile's)
    assert cost.relative_cost(8) == 0.0
    assert cost.summary()["relative_cost_drafting"] == {"1": pytest.approx(2.0, rel=0.03)}


def _switching(cost: OnlineStepCost, pairs: int, requests: int = 1) -> None:
    """``pairs`` times: 4 plain steps, 2 drafting steps (5 drafts a request), drafting at
    2x its profile, the first step of every run paying for the switch (plain 1.3x,
    drafting 1.1x: the engine's are 1.08x and 1.05x at 16 requests)."""
    for _ in range(pairs):
        for drafts, factor, n in ((0, 1.0, 4), (5, 2.0, 2)):
            rows, drafting = requests * (1 + drafts), requests if drafts else 0
            for k in range(n):
                switch = (1.1 if drafting else 1.3) if k == 0 else 1.0
                seconds = factor * switch * COST.seconds_at(requests, rows, drafting)
                cost.update(requests, rows, drafting, seconds)


def test_a_runs_first_step_pays_for_its_switch_and_teaches_nothing() -> None:
    """Drafting steps take 2x their profile, and the first step of every run pays for the
    switch (:func:`_switching`). The contrasts come from the runs' steps after their
    first, so the relative cost learnt is drafting's 2x; counting the first steps (the
    contrasts before 2026-12-05) put drafting 12 % cheaper (1.76x)."""
    cost = OnlineStepCost(COST)
    _switching(cost, 12)
    assert cost.contrasts(1) == 22  # 24 runs: each between two others
    assert math.exp(cost.relative_cost(1)) == pytest.approx(2.0, rel=0.02)


def test_what_a_switch_costs_is_learnt_from_the_runs_first_steps() -> None:
    """The first step of a run right after the other kind, over its second, is what a
    switch to that kind costs: 0.3 of a plain step, 0.1 of a drafting one here. Learnt
    per batch-size bucket, and a bucket that has seen no switch takes every bucket's; a
    run that starts after steps of another bucket (no switch in its own) teaches
    nothing, nor does a bucket's first run."""
    cost = OnlineStepCost(COST)
    assert cost.switch_cost(1, False) == cost.switch_cost(1, True) == 0.0  # nothing seen
    _switching(cost, 12)
    assert cost.switch_cost(1, False) == pytest.approx(0.3, rel=0.02)
    assert cost.switch_cost(1, True) == pytest.approx(0.1, rel=0.05)
    every = cost.summary()["switch_cost"]  # every bucket's (results.json)
    assert every == {
        "plain": pytest.approx(1.3 ** (11 / 12) - 1),
        "drafting": pytest.approx(1.1 ** (12 / 13) - 1),
    }
    # 8 requests: none seen, every bucket's (shrunk to 0 by one sample)
    assert cost.switch_cost(8, False) == pytest.approx(1.3 ** (11 / 12) - 1, rel=0.01)
    # a step of another bucket between the runs: their first steps teach nothing
    apart = OnlineStepCost(COST)
    for drafts in (0, 5, 0, 5):
        apart.update(1, 1 + drafts, int(drafts > 0), 1.5 * COST.seconds_at(1, 1 + drafts, 1))
        apart.update(1, 1 + drafts, int(drafts > 0), COST.seconds_at(1, 1 + drafts, 1))
        apart.update(8, 8, 0, COST.seconds_at(8, 8, 0))
    assert apart.switches == {}
    # steps dearer at no switch (a fresh bucket's first run, or steady) are no switch cost
    steady = OnlineStepCost(COST)
    steady.update(1, 1, 0, 2.0)
    steady.update(1, 1, 0, 1.0)
    assert steady.switch_cost(1, False) == 0.0


def test_re_exploring_pays_for_the_switches_too() -> None:
    """A re-exploration's loss counts the two switches it makes, at what the cost model
    learnt they cost: plain explored amid drafting (plain in 0.6 of drafting's seconds,
    0.3 behind) loses 2 x 0.3 x 0.6 best steps by the gap, and 0.3 x 0.6 + 0.1 more
    by the switches (plain 1.3x, drafting 1.1x), so the re-explorations are spaced
    by (0.36 + 0.28) / EXPLORE_BUDGET steps (256, not the gap's 144)."""
    s = AdaptiveDepth(2, cost=OnlineStepCost(COST))
    assert s.cost is not None
    _switching(s.cost, 40)
    plain, drafting = s.cost.switch_cost(1, False), s.cost.switch_cost(1, True)
    assert (plain, drafting) == (pytest.approx(0.3, rel=0.01), pytest.approx(0.1, rel=0.01))
    explored = _explorations(s, [0.3] * 1600)
    wait = (EXPLORE_RUN * 0.3 * 0.6 + plain * 0.6 + drafting) / EXPLORE_BUDGET
    assert 250 < wait < 260
    assert _re_explored(explored, wait), explored
    assert len(_spans(explored)) >= int(1600 / wait) - 1, explored  # at that pace


def test_a_contrast_among_noisy_steps_counts_for_less() -> None:
    """Drafting steps take 2x their profile, learnt on a quiet machine. Then two drafting
    steps read their profile, between plain steps at theirs: on a quiet machine that is a
    contrast to learn from, but where plain steps jump by 2.2x step to step (the noise
    of a loaded machine, where a run learnt the relative cost at 0.91 of the profile's
    and turned to drafting) it is one more noisy step and moves the relative cost less
    than a tenth as far. A contrast whose two switches differ counts less too."""
    quiet, noisy = OnlineStepCost(COST), OnlineStepCost(COST)
    for cost in (quiet, noisy):
        _sandwiches(cost, 10, 1.0, 2.0)
    learnt = quiet.relative_cost(1)
    assert noisy.relative_cost(1) == learnt and quiet.contrast_weight(1) == 1.0
    for k in range(8):
        quiet.update(1, 1, 0, 1.0)
        noisy.update(1, 1, 0, math.exp(0.4 if k % 2 else -0.4))
    assert noisy.contrast_weight(1) < 0.1
    assert noisy.summary()["step_noise"]["1"] > 0.3 and quiet.summary()["step_noise"]["1"] == 0
    moved = {}
    for name, cost in (("quiet", quiet), ("noisy", noisy)):
        for rows, drafts, seconds in ((6, 1, COST.seconds_at(1, 6, 1)), (1, 0, 1.0)):
            for _ in range(2):  # drafting at its profile, then plain
                cost.update(1, rows, drafts, seconds)
        assert cost.contrasts(1) == 20  # a contrast, each
        moved[name] = learnt - cost.relative_cost(1)
    assert moved["quiet"] > 0.1 and 0 < moved["noisy"] < 0.1 * moved["quiet"]
    assert quiet.contrast_weight(1, 0.25) == pytest.approx(0.1**2 / (0.25**2 / 2))


def test_a_long_stretch_of_the_other_kind_is_a_contrast_at_its_two_switches() -> None:
    """Plain steps, 12 drafting steps (a stretch the choice took itself, longer than any
    exploration), two plain steps, while the machine slows by 2 % a step: each switch is
    measured at one speed (the stretch's second step against the plain steps before it,
    its last ones against the second plain step after it), so the relative cost learnt
    is drafting's 1.5x and the drift cancels between the two switches. The sandwich had
    to fit in 8 steps before, and such a stretch taught nothing. A speed change at one
    of the switches teaches nothing."""

    def stretch(cost: OnlineStepCost, after: float, drift: float) -> None:
        steps = [(1, 0, 1.0)] * 3 + [(6, 1, 1.5)] * 12 + [(1, 0, after)] * 2
        for t, (rows, drafting, factor) in enumerate(steps):
            seconds = factor * math.exp(drift * t) * COST.seconds_at(1, rows, drafting)
            cost.update(1, rows, drafting, seconds)

    drifting = OnlineStepCost(COST)
    stretch(drifting, 1.0, 0.02)
    assert drifting.contrasts(1) == 1
    shrunk = 1 / (1 + drifting.relative_prior)  # one contrast, shrunk to the profile
    assert drifting.relative_cost(1) == pytest.approx(math.log(1.5) * shrunk, rel=0.02)
    jumped = OnlineStepCost(COST)
    stretch(jumped, 2.0, 0.0)  # the plain step after the stretch 2x slower
    assert jumped.contrasts(1) == 0 and jumped.relative_cost(1) == 0.0


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


def test_gamma_for_batch_and_caps() -> None:
    rule = [[1, 5], [8, 3], [16, 0]]
    assert [gamma_for_batch(rule, b) for b in (1, 7, 8, 15, 16, 64)] == [5, 5, 3, 3, 0, 0]
    s = AdaptiveDepth(4, gamma_schedule=rule)
    assert s.caps(2, [9, 1, 0]) == [4, 1, 0]  # gamma and the budgets bound the rule
    assert s.caps(20, [9]) == [0]


# -- calibration regimes ----------------------------------------------------------------------


def test_a_file_with_several_regimes_picks_each_requests_fit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy and T=0.8 fits in one file: each request reads its own regime's
    temperatures (silently); T=0.5 has none, gets the nearest (0.8) with a warning."""
    from xspec.spec.adaptive.calibration import load_calibration

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
    with caplog.at_level(logging.WARNING, logger="xspec.spec.adaptive.calibration"):
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
    from xspec.spec.adaptive.calibration import CALIBRATION_FILE, load_calibration

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
    assert any("gamma exceeds spec.num_speculative_tokens=5" in p for p in check(cfg))
    cfg.spec.num_speculative_tokens = 3
    assert any("gamma exceeds spec.num_speculative_tokens=3" in p for p in check(cfg))
    ok = compose_run(["model=dsv4_tiny", "spec=dspark", "spec.gamma_schedule=[[1,5],[16,0]]"])
    assert check(ok) == []


def test_regime_labels_given_by_the_caller_decide_as_the_sampling_parameters() -> None:
    """``depths(..., regimes=...)`` (the step passes each request's label, kept on its
    RunningSeq) is what the estimates are kept by: labels grouping the requests as their
    sampling parameters do decide the same, and the counts are under the given labels; a
    gamma schedule of 0 records no expected acceptance."""
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=1)] * 2
    assert [regime_of(p) for p in params[:2]] == ["greedy", "T=0.8"]
    labels = ["g", "s"] * 2
    twins = [AdaptiveDepth(2, cost=OnlineStepCost(LINE), trim=True) for _ in range(2)]
    histories = [[s.new_history() for _ in params] for s in twins]
    for step in range(40):
        got = [
            twins[0].depths(params, histories[0], [2] * 4),
            twins[1].depths(params, histories[1], [2] * 4, regimes=labels),
        ]
        assert got[0] == got[1], step
        assert twins[1].last is not None and twins[1].last.regimes == labels
        accepted = [min(d, (step + b) % 3) for b, d in enumerate(got[0])]
        for s, h in zip(twins, histories):
            s.learn(h, got[0], accepted, seconds=LINE.seconds_at(4, 4 + sum(got[0]), 4))
    assert set(twins[0].acceptance.regimes) == {"greedy", "T=0.8"}
    assert set(twins[1].acceptance.regimes) == {"g", "s"}
    plain = AdaptiveDepth(2, gamma_schedule=[[1, 0]])
    assert plain.depths(params, [None] * 4, [2] * 4, regimes=labels) == [0] * 4
    assert plain.last is not None and plain.last.expected == [[]] * 4


def test_plain_steps_reuse_one_scan_and_decide_as_if_they_scanned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While a batch steps plain nothing is verified, so nothing moves its survivals (no
    request's own counts here): the drafting option one scan found serves the next
    RESCAN_EVERY steps, re-valued at each step's times, and the decisions and the gaps
    they explore by are those of a scan at every step (plain right at a gap of about
    0.15, with spells of a slower machine and the re-explorations they bring; a drafting
    step, which verifies, is always followed by a scan). A batch of other requests
    scans at once."""
    scans: Counter[int] = Counter()
    real = policy.scan_depths

    def counted(*args: Any) -> Any:
        scans[policy.RESCAN_EVERY] += 1
        return real(*args)

    monkeypatch.setattr(policy, "scan_depths", counted)
    runs = {}
    for every in (1, policy.RESCAN_EVERY):
        monkeypatch.setattr(policy, "RESCAN_EVERY", every)
        s = AdaptiveDepth(2, cost=OnlineStepCost(LINE))
        kinds = _machine(s, 600, 3.0, speed=lambda t: 1.6 if (t // 50) % 3 == 2 else 1.0)
        runs[every] = (kinds, s.exploration.gaps, s)
    (kinds, gaps, _), (kinds_held, gaps_held, held) = runs.values()
    assert kinds == kinds_held
    assert 3 <= sum(kinds[100:]) <= 20  # re-explorations (each one drafting step)
    assert gaps_held == pytest.approx(gaps, rel=1e-12)
    assert scans[1] == 600
    assert scans[8] <= 600 / 8 + 2 * sum(kinds)
    before = scans[8]
    held.depths([SamplingParams()], [held.new_history()], [2])  # another request
    assert scans[8] == before + 1
