"""Spec-decode metrics from hand-built committed output matrices (xspec/metrics.py)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from xspec.metrics import SpecDecodeMetrics, acceptance_length

NAMES = [
    "xspec_spec_decode_num_drafts_total",
    "xspec_spec_decode_num_draft_tokens_total",
    "xspec_spec_decode_num_accepted_tokens_total",
    "xspec_spec_decode_num_committed_tokens_total",
    "xspec_spec_decode_num_accepted_tokens_per_pos_total",
    "xspec_spec_decode_mean_tokens_per_step",
    "xspec_spec_decode_acceptance_length",
]

# vLLM's spec-decode counters and the xspec counters that mirror them (docs/metrics.md)
VLLM_MIRRORS = {
    "vllm:spec_decode_num_drafts": "xspec_spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens": "xspec_spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens": "xspec_spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos": (
        "xspec_spec_decode_num_accepted_tokens_per_pos_total"
    ),
}


def _scrape(metrics: SpecDecodeMetrics) -> dict[tuple[str, str], float]:
    """Parse the exposition text back: {(sample name, position label or ""): value}."""
    out = {}
    for family in text_string_to_metric_families(metrics.exposition()):
        for s in family.samples:
            out[(s.name, s.labels.get("position", ""))] = s.value
    return out


def test_xllm_reference_case() -> None:
    # xLLM SpeculativeOutputMetricsTest: gamma 5, one row accepts 2, one accepts all.
    m = SpecDecodeMetrics()
    m.observe_step(
        torch.tensor([[10, 11, 12, -1, -1, -1], [20, 21, 22, 23, 24, 25]]), torch.tensor([5, 5])
    )
    r = m.report()
    assert r.num_committed_tokens == 9
    assert r.accepted_per_position == [2, 2, 1, 1, 1]
    assert (r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens) == (2, 10, 7)
    assert (
        r.acceptance_rate == 0.7 and r.mean_accepted_length == 3.5 and r.mean_tokens_per_step == 4.5
    )
    assert r.survival == [1.0, 1.0, 0.5, 0.5, 0.5]
    assert (r.full_block_fraction, r.zero_accept_fraction) == (0.5, 0.0)


def test_rejected_first_draft_correction_is_not_accepted() -> None:
    m = SpecDecodeMetrics()
    # Row 0 rejected its first draft: only the correction token, 0 accepted.
    m.observe_step(torch.tensor([[7, -1, -1]]), torch.tensor([2]))
    r = m.report()
    assert (r.num_accepted_tokens, r.num_committed_tokens) == (0, 1)
    assert r.accepted_per_position == [0, 0]
    assert (r.zero_accept_fraction, r.full_block_fraction, r.acceptance_rate) == (1.0, 0.0, 0.0)
    assert _scrape(m)[("xspec_spec_decode_num_accepted_tokens_total", "")] == 0.0


def test_full_acceptance_and_baseline_rows() -> None:
    m = SpecDecodeMetrics()
    # Row 0 full block (3 drafts + bonus), row 1 baseline (no drafts), row 2 partial,
    # row 3 carried only one draft and accepted it (a full block of its own width).
    out = torch.tensor([[1, 2, 3, 4], [5, -1, -1, -1], [6, 7, -1, -1], [8, 9, -1, -1]])
    m.observe_step(out, torch.tensor([3, 0, 3, 1]))
    r = m.report()
    assert (r.num_steps, r.num_row_steps, r.num_drafts, r.num_draft_tokens) == (1, 4, 3, 7)
    assert (r.num_accepted_tokens, r.num_committed_tokens) == (5, 9)
    assert r.accepted_per_position == [3, 1, 1]
    assert (r.num_full_blocks, r.num_zero_accepts) == (2, 0)
    assert r.mean_tokens_per_step == 9 / 4 and r.mean_accepted_length == 5 / 3
    assert r.survival == [1.0, 1 / 3, 1 / 3]


def test_baseline_only_has_no_drafts_and_no_nan() -> None:
    m = SpecDecodeMetrics()
    for _ in range(3):
        m.observe_step(torch.tensor([[4], [5]]), torch.tensor([0, 0]))
    r = m.report()
    assert (r.num_drafts, r.num_draft_tokens, r.num_accepted_tokens) == (0, 0, 0)
    assert r.num_committed_tokens == 6
    assert r.mean_tokens_per_step == 1.0
    assert (r.acceptance_rate, r.mean_accepted_length, r.full_block_fraction) == (0.0, 0.0, 0.0)
    assert r.accepted_per_position == [] and r.survival == []
    assert "mean tokens per step" in r.format()


def _random_step(gen: torch.Generator, gamma: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A valid step: ``out [rows, gamma+1]`` (-1 padded) and ``drafted [rows]``."""
    drafted = torch.randint(0, gamma + 1, (rows,), generator=gen)  # [B]
    accepted = (torch.rand(rows, generator=gen) * (drafted + 1)).long()  # [B] <= drafted
    out = torch.full((rows, gamma + 1), -1)
    out[torch.arange(gamma + 1)[None, :] <= accepted[:, None]] = 3
    return out, drafted


def test_invariants_over_random_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    m = SpecDecodeMetrics()
    for step in range(20):
        m.observe_step(*_random_step(gen, 1 + step % 4, 5))
    r = m.report()
    pos = r.accepted_per_position
    assert all(a >= b for a, b in itertools.pairwise(pos)), (
        f"per-position not non-increasing: {pos}"
    )
    assert r.num_committed_tokens == r.num_accepted_tokens + r.num_row_steps
    assert sum(pos) == r.num_accepted_tokens
    assert pos[0] == r.num_drafts - r.num_zero_accepts


def test_exposition_contains_names_and_values() -> None:
    m = SpecDecodeMetrics()
    m.observe_step(torch.tensor([[1, 2, -1], [3, -1, -1]]), torch.tensor([2, 0]))
    text = m.exposition()
    for name in NAMES:
        assert name in text, name
    got = _scrape(m)
    assert got[("xspec_spec_decode_num_drafts_total", "")] == 1.0
    assert got[("xspec_spec_decode_num_draft_tokens_total", "")] == 2.0
    assert got[("xspec_spec_decode_num_accepted_tokens_total", "")] == 1.0
    assert got[("xspec_spec_decode_num_committed_tokens_total", "")] == 3.0
    assert got[("xspec_spec_decode_num_accepted_tokens_per_pos_total", "0")] == 1.0
    assert got[("xspec_spec_decode_num_accepted_tokens_per_pos_total", "1")] == 0.0
    assert got[("xspec_spec_decode_mean_tokens_per_step", "")] == 1.5


def test_two_instances_do_not_collide() -> None:
    a, b = SpecDecodeMetrics(), SpecDecodeMetrics()
    a.observe_step(torch.tensor([[1, 2]]), torch.tensor([1]))
    assert a.registry is not b.registry
    assert _scrape(a)[("xspec_spec_decode_num_committed_tokens_total", "")] == 2.0
    assert _scrape(b)[("xspec_spec_decode_num_committed_tokens_total", "")] == 0.0
    assert b.report().num_steps == 0


def test_format_is_an_aligned_table() -> None:
    m = SpecDecodeMetrics()
    m.observe_step(torch.tensor([[1, 2, -1]]), torch.tensor([2]))
    lines = m.report().format().splitlines()
    assert lines[0].startswith("decode steps") and lines[-1].startswith("survival[1]")
    value_cols = {len(line) - len(line.split("  ", 1)[1].lstrip()) for line in lines}
    assert len(value_cols) == 1, f"values not aligned:\n{m.report().format()}"


@pytest.mark.parametrize(
    ("out", "drafted", "match"),
    [
        ([[1, -1, 2]], [2], "left-aligned"),  # a token after the padding
        ([[-1, -1]], [1], "1..drafts\\+1"),  # nothing committed
        ([[1, 2, 3]], [1], "1..drafts\\+1"),  # more accepted than drafted
    ],
)
def test_bad_matrices_raise(out: list[list[int]], drafted: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SpecDecodeMetrics().observe_step(torch.tensor(out), torch.tensor(drafted))


def test_confidence_calibration_per_position() -> None:
    """Predicted survival prod_{i<=k} c_i vs realised acceptance, over the rows that drafted k."""
    m = SpecDecodeMetrics()
    out = torch.tensor([[5, 6, 7, -1], [8, -1, -1, -1]])  # accepted 2 of 3, 0 of 2
    conf = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.8, 0.3]])
    m.observe_step(out, torch.tensor([3, 2]), conf)
    cal = m.report().calibration
    assert len(cal) == 3
    for (pred, real), (want_pred, want_real) in zip(
        cal, [(0.75, 0.5), ((0.25 + 0.8) / 2, 0.5), (0.125, 0.0)]
    ):
        assert pred == pytest.approx(want_pred) and real == pytest.approx(want_real)
    assert "confidence[2]" in m.report().format()
    assert "predicted_accepted_tokens_per_pos" in m.exposition()
    assert SpecDecodeMetrics().report().calibration == []


def test_a_nan_confidence_is_left_out_of_the_calibration() -> None:
    """A drafter whose confidence head returns NaN: the row counts as drafted and
    accepted as usual but not in predicted-vs-realised (results.json is strict JSON)."""
    m = SpecDecodeMetrics()
    out = torch.tensor([[5, 6, -1], [8, 9, -1]])  # both accepted 1 of 2
    conf = torch.tensor([[float("nan"), 0.5], [0.8, 0.5]])
    m.observe_step(out, torch.tensor([2, 2]), conf)
    r = m.report()
    assert r.calibration == [(pytest.approx(0.8), 1.0), (pytest.approx(0.4), 0.0)]
    assert r.predicted_acceptance_rate is not None
    assert math.isfinite(r.predicted_acceptance_rate)
    assert r.num_accepted_tokens == 2


def test_target_rows_wasted_rows_and_predicted_acceptance() -> None:
    """Rows scored (anchor + verified drafts), verified drafts rejected, and the draft's
    expected accepted tokens vs the realised ones, in the report and the export."""
    m = SpecDecodeMetrics()
    out = torch.tensor(
        [[5, 6, 7, -1], [8, -1, -1, -1], [9, -1, -1, -1]]
    )  # 2 of 3, 0 of 2, baseline
    conf = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.8, 0.3], [0.9, 0.9, 0.9]])
    m.observe_step(out, torch.tensor([3, 2, 0]), conf)
    r = m.report()
    assert r.num_target_rows == 4 + 3 + 1 and r.mean_target_rows == pytest.approx(8 / 3)
    assert r.num_wasted_target_rows == 5 - 2
    # predicted: (0.5 + 1.0) + (0.25 + 0.8) + 0.125 over 5 verified drafts; realised 2 of 5
    assert r.predicted_acceptance_rate == pytest.approx(2.675 / 5)
    assert r.realised_acceptance_rate == pytest.approx(2 / 5)
    got = _scrape(m)
    assert got[("xspec_spec_decode_num_target_rows_total", "")] == 8.0
    assert got[("xspec_spec_decode_num_wasted_target_rows_total", "")] == 3.0
    assert "acceptance predicted/realised" in r.format()
    plain = SpecDecodeMetrics()
    plain.observe_step(torch.tensor([[1, 2, -1]]), torch.tensor([2]))
    assert plain.report().predicted_acceptance_rate is None


def test_absorbed_replicas_equal_one_engine_over_all_rows() -> None:
    """DP replicas' counters add up (rank 0 absorbs the others'): the report and the
    Prometheus text equal one engine that saw every row, step by step."""
    gen = torch.Generator().manual_seed(1)
    whole, halves = SpecDecodeMetrics(), [SpecDecodeMetrics(), SpecDecodeMetrics()]
    for step in range(12):
        gamma = 1 + step % 3
        out, drafted = _random_step(gen, gamma, 6)
        conf = torch.rand(6, gamma, generator=gen)
        whole.observe_step(out, drafted, conf)
        for h, rows in zip(halves, (slice(0, 4), slice(4, 6))):  # replicas of 4 and 2 rows
            h.observe_step(out[rows], drafted[rows], conf[rows])
    halves[0].absorb(halves[1].totals())
    merged, ref = halves[0].report(), whole.report()
    assert merged.num_steps == 2 * ref.num_steps  # each replica counts its own steps
    flat = [x for pair in merged.calibration for x in pair]
    assert flat == pytest.approx([x for pair in ref.calibration for x in pair])
    for k in ("predicted_acceptance_rate", "realised_acceptance_rate"):
        assert getattr(merged, k) == pytest.approx(getattr(ref, k))
    skip = ("num_steps", "calibration", "predicted_acceptance_rate", "realised_acceptance_rate")
    assert {k: v for k, v in vars(merged).items() if k not in skip} == {
        k: v for k, v in vars(ref).items() if k not in skip
    }
    assert _scrape(halves[0]) == pytest.approx(_scrape(whole))


def test_acceptance_length_is_vllms_and_sglangs_definition() -> None:
    """Hand-counted, over two steps with a baseline row: vLLM's ``1 + accepted / drafts``
    (drafting rows only, bonus included), one more than xspec's mean accepted length, and
    not the committed tokens per row once a row carried no drafts."""
    m = SpecDecodeMetrics()
    # step 1, gamma 2: full block (2 accepted + bonus), rejected first draft (0 + correction)
    m.observe_step(torch.tensor([[1, 2, 3], [4, -1, -1]]), torch.tensor([2, 2]))
    # step 2, gamma 3: 1 of 3 accepted, 3 of 3 accepted, a baseline row (no drafts)
    out = torch.tensor([[5, 6, -1, -1], [7, 8, 9, 10], [11, -1, -1, -1]])
    m.observe_step(out, torch.tensor([3, 3, 0]))
    r = m.report()
    # drafting rows: 4; accepted drafts 2 + 0 + 1 + 3 = 6; committed 3 + 1 + 2 + 4 + 1 = 11
    assert (r.num_drafts, r.num_accepted_tokens, r.num_committed_tokens) == (4, 6, 11)
    assert r.acceptance_length == 1 + 6 / 4 == 2.5
    assert r.mean_accepted_length == 6 / 4
    assert r.acceptance_length == r.mean_accepted_length + 1
    assert r.mean_tokens_per_step == 11 / 5  # the baseline row pulls this one down
    assert r.accepted_per_position == [3, 2, 1]  # rows with >= 1, >= 2, >= 3 accepted
    got = _scrape(m)
    assert got[("xspec_spec_decode_acceptance_length", "")] == 2.5
    line = next(x for x in r.format().splitlines() if x.startswith("acceptance length (vLLM)"))
    assert line.split()[-1] == "2.5000"
    assert acceptance_length(6, 4) == 2.5 and acceptance_length(0, 0) == 1.0


def test_acceptance_length_when_every_row_drafts_equals_tokens_per_step() -> None:
    m = SpecDecodeMetrics()
    m.observe_step(torch.tensor([[1, 2, -1], [3, -1, -1], [4, 5, 6]]), torch.tensor([2, 2, 2]))
    r = m.report()
    assert r.acceptance_length == r.mean_tokens_per_step == 2.0  # (2 + 1 + 3) / 3


def test_baseline_acceptance_length_is_one() -> None:
    m = SpecDecodeMetrics()
    m.observe_step(torch.tensor([[4], [5]]), torch.tensor([0, 0]))
    assert m.report().acceptance_length == 1.0
    assert _scrape(m)[("xspec_spec_decode_acceptance_length", "")] == 1.0


def test_vllm_counters_are_mirrored_with_a_position_label() -> None:
    """Each vLLM spec-decode counter has its xspec twin holding the same count: 2 drafting
    rows, 4 draft tokens, 3 accepted (2 + 1), per position [2, 1]."""
    m = SpecDecodeMetrics()
    m.observe_step(torch.tensor([[1, 2, 3], [4, 5, -1]]), torch.tensor([2, 2]))
    got = _scrape(m)
    want = {"num_drafts": 2.0, "num_draft_tokens": 4.0, "num_accepted_tokens": 3.0}
    for vllm_name, ours in VLLM_MIRRORS.items():
        if vllm_name.endswith("per_pos"):
            assert (got[(ours, "0")], got[(ours, "1")]) == (2.0, 1.0)
        else:
            assert got[(ours, "")] == want[vllm_name.removeprefix("vllm:spec_decode_")]


def test_per_regime_counts_sum_over_rows_and_steps() -> None:
    """Verified drafts, predicted accepted (the confidences' survival over the verified
    positions) and accepted drafts per sampling regime, in the report and in Prometheus;
    a row that verified nothing counts for no regime."""
    m = SpecDecodeMetrics()
    m.observe_step(
        torch.tensor([[5, 6, 7, -1], [5, -1, -1, -1], [5, -1, -1, -1]]),
        torch.tensor([3, 2, 0]),
        torch.tensor([[0.9, 0.5, 0.5], [0.8, 0.5, 0.1], [0.7, 0.7, 0.7]]),
        depths=[3, 2, 0],
        regimes=["greedy", "T=0.8", "greedy"],
    )
    m.observe_step(
        torch.tensor([[5, 6, -1, -1]]),
        torch.tensor([1]),
        torch.tensor([[0.5, 0.5, 0.5]]),
        depths=[1],
        regimes=["greedy"],
    )
    greedy, sampled = m.report().regimes["greedy"], m.report().regimes["T=0.8"]
    assert greedy["draft_tokens"] == 4 and sampled["draft_tokens"] == 2
    # 0.9 + 0.9*0.5 + 0.9*0.5*0.5, then 0.5; 0.8 + 0.8*0.5 (2 verified of 3)
    assert greedy["predicted_rate"] == pytest.approx((1.575 + 0.5) / 4)
    assert sampled["predicted_rate"] == pytest.approx(1.2 / 2)
    assert greedy["realised_rate"] == pytest.approx(3 / 4) and sampled["realised_rate"] == 0.0
    scraped = {
        (s.name, s.labels.get("regime", "")): s.value
        for family in text_string_to_metric_families(m.exposition())
        for s in family.samples
    }
    prefix = "xspec_spec_decode_regime"
    assert scraped[(f"{prefix}_draft_tokens_total", "greedy")] == 4
    assert scraped[(f"{prefix}_predicted_accepted_tokens_total", "T=0.8")] == pytest.approx(1.2)
    assert scraped[(f"{prefix}_accepted_tokens_total", "greedy")] == 3
    assert scraped[(f"{prefix}_accepted_tokens_total", "T=0.8")] == 0
