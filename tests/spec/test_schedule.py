"""The adaptive-verification scheduler (Algorithm 1) against hand-computed cases and a
literal reference implementation; the step-cost table's interpolation."""

from __future__ import annotations

import pytest
import torch

from xspec.spec.adaptive import scan
from xspec.spec.adaptive.cost import StepCost
from xspec.spec.adaptive.scan import schedule_rows, schedule_verify, survivals


def table(values: dict[int, float]):
    """SPS(B) from a hand-written table (exact B only: a missing B is a test bug)."""
    return lambda rows: values[rows]


def test_early_stop_at_the_first_non_improvement() -> None:
    """a: r0 = 0.9, 0.45, 0.225; r1 = 0.6, 0.3, 0.27. Order (0,1) (1,1) (0,2) ...
    theta: start 2 * 1.0 = 2; (0,1): 2.9 * 0.8 = 2.32 keep; (1,1): 3.5 * 0.7 = 2.45 keep;
    (0,2): 3.95 * 0.6 = 2.37 <= 2.45 stop -> [1, 1]. A search over the whole order would
    take 4.52 * 0.6 = 2.712 at B = 7 ([2, 3]): the early stop must not look there."""
    c = torch.tensor([[0.9, 0.5, 0.5], [0.6, 0.5, 0.9]])
    sps = table({2: 1.0, 3: 0.8, 4: 0.7, 5: 0.6, 6: 0.6, 7: 0.6, 8: 0.6})
    assert schedule_verify(c, [3, 3], sps) == [1, 1]


def test_ties_by_position_then_request() -> None:
    # equal survival at the same position: request 0 first. theta 2 -> 3 (keep) -> 2.8 (stop)
    c = torch.tensor([[1.0, 0.5], [1.0, 0.5]])
    assert schedule_verify(c, [2, 2], table({2: 1.0, 3: 1.0, 4: 0.7})) == [1, 0]
    # a_{1,1} = a_{0,2} = a_{1,2} = 0.8: position 1 before position 2, whatever the request.
    # theta 2 -> 3 (0,1) -> 3.8 (1,1) -> 4.6 * 0.7 = 3.22 stop -> [1, 1]
    # (request-first ties would admit (0,2) before (1,1): [2, 0])
    c = torch.tensor([[1.0, 0.8], [0.8, 1.0]])
    assert schedule_verify(c, [2, 2], table({2: 1.0, 3: 1.0, 4: 1.0, 5: 0.7})) == [1, 1]


def test_prefix_order_with_certain_later_drafts() -> None:
    """c = 1 after position 1 makes every survival of a request equal: each request still
    verifies a prefix (position j only after j-1), never a gap."""
    c = torch.tensor([[0.5, 1.0, 1.0], [0.5, 1.0, 1.0]])
    sps = table({2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 6: 0.1, 7: 0.1, 8: 0.1})
    # order (0,1) (1,1) (0,2) (1,2) ...: theta 2 -> 2.5 -> 3 -> 3.5 -> (1,2) 4 * 0.1 stop
    assert schedule_verify(c, [3, 3], sps) == [2, 1]


def test_budgets_and_nothing_worth_verifying() -> None:
    c = torch.full((2, 3), 0.9)
    flat = table(dict.fromkeys(range(2, 9), 1.0))
    assert schedule_verify(c, [0, 3], flat) == [0, 3]  # request 0 may verify no draft
    assert schedule_verify(c, [1, 2], flat) == [1, 2]
    zero = torch.zeros(2, 3)  # a = 0 adds no expected token: theta never improves
    assert schedule_verify(zero, [3, 3], flat) == [0, 0]
    with pytest.raises(ValueError, match="max_drafts has 1 entries for 2 requests"):
        schedule_verify(c, [3], flat)


def reference(c: torch.Tensor, max_drafts: list[int], sps) -> list[int]:
    """Algorithm 1 written literally: sort (a, j, r), scan with the early stop."""
    R, G = c.shape
    a = [[float(torch.prod(c[r, : j + 1].double())) for j in range(G)] for r in range(R)]
    cands = sorted(
        ((a[r][j], j, r) for r in range(R) for j in range(max_drafts[r])),
        key=lambda t: (-t[0], t[1], t[2]),
    )
    lengths, B, tau = [0] * R, R, float(R)
    best = tau * sps(B)
    for s, j, r in cands:
        theta = (tau + s) * sps(B + 1)
        if theta <= best:
            break
        assert lengths[r] == j, "a candidate out of prefix order"
        lengths[r], B, tau, best = j + 1, B + 1, tau + s, theta
    return lengths


def test_matches_the_literal_algorithm_on_random_cases() -> None:
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        R, G = (
            int(torch.randint(1, 9, (1,), generator=gen)),
            int(torch.randint(1, 7, (1,), generator=gen)),
        )
        c = torch.rand(R, G, generator=gen) ** 0.3  # mostly confident
        if case % 3 == 0:  # ties: confidences on a coarse grid
            c = (c * 4).round() / 4
        budgets = torch.randint(0, G + 1, (R,), generator=gen).tolist()
        slope = float(torch.rand(1, generator=gen)) * 0.3
        sps = lambda b, s=slope: 1.0 / (1.0 + s * b)  # noqa: E731
        got = schedule_verify(c, budgets, sps)
        assert got == reference(c, budgets, sps), (case, c, budgets)
        assert all(0 <= n <= m for n, m in zip(got, budgets))


def test_small_scan_in_python_equals_the_tensor_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """Few candidates run in plain Python: the same lengths as the tensor path, ties,
    out-of-range confidences and budgets included."""
    gen = torch.Generator().manual_seed(1)
    for case in range(300):
        R, G = (
            int(torch.randint(1, 9, (1,), generator=gen)),
            int(torch.randint(1, 7, (1,), generator=gen)),
        )
        c = torch.rand(R, G, generator=gen, dtype=torch.float64) * 1.2 - 0.05
        if case % 2:
            c = (c * 4).round() / 4  # ties
        budgets = torch.randint(0, G + 1, (R,), generator=gen).tolist()
        slope = float(torch.rand(1, generator=gen)) * 0.3
        sps = lambda b, s=slope: 1.0 / (1.0 + s * b)  # noqa: E731
        monkeypatch.setattr(scan, "SMALL_SCAN", 10**9)
        small = schedule_verify(c, budgets, sps)
        assert schedule_rows(c.tolist(), budgets, sps) == small  # host rows, as they are
        monkeypatch.setattr(scan, "SMALL_SCAN", -1)
        assert small == schedule_verify(c, budgets, sps), (case, c, budgets)
        assert schedule_rows(c.tolist(), budgets, sps) == small  # host rows, as a tensor


def test_survivals_are_the_cumulative_product() -> None:
    c = torch.tensor([[0.5, 0.5, 1.0], [0.9, 0.1, 0.5]])
    torch.testing.assert_close(
        survivals(c), torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.09, 0.045]], dtype=torch.float64)
    )


# -- the step-cost table ---------------------------------------------------------------------

COST = StepCost(requests=[1, 4], drafts=[0, 2, 4], seconds=[[1.0, 2.0, 3.0], [4.0, 6.0, 8.0]])


@pytest.mark.parametrize(
    ("requests", "rows", "seconds"),
    [
        (1, 1, 1.0),  # a measured point: R = 1, x = 0
        (1, 2, 1.5),  # x = 1: halfway between x = 0 and 2
        (4, 12, 6.0),  # R = 4, x = 2
        (4, 14, 6.5),  # x = 2.5: a quarter of the way to x = 4
        (2, 6, 2.0 + (6.0 - 2.0) / 3),  # x = 2, R a third of the way from 1 to 4
        (8, 8, 4.0),  # beyond the largest R: clamped to R = 4 (x = 0)
        (1, 10, 3.0),  # beyond the largest x: clamped to x = 4
        (4, 4, 4.0),
    ],
)
def test_step_cost_interpolation(requests: int, rows: int, seconds: float) -> None:
    assert COST.seconds_at(requests, rows) == pytest.approx(seconds)
    assert COST.sps(requests)(rows) == pytest.approx(1.0 / seconds)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"requests": [2, 1]}, "requests must be a non-empty ascending"),
        ({"requests": [0, 4]}, "requests must be a non-empty ascending list >= 1"),
        ({"drafts": [0, 2]}, r"seconds must be \[2\]\[2\]"),
        ({"seconds": [[1.0, 2.0, 0.0], [4.0, 6.0, 8.0]]}, "seconds must all be > 0"),
    ],
)
def test_step_cost_rejects_malformed_tables(kwargs: dict, match: str) -> None:
    fields = {"requests": COST.requests, "drafts": COST.drafts, "seconds": COST.seconds}
    with pytest.raises(ValueError, match=match):
        StepCost(**(fields | kwargs))
