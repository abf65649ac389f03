"""The step-cost profile's measurement: interleaved timing and the robust line."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from xspec.engine.step_cost import fastest_interleaved, line_fit


def test_line_through_the_drafting_points_keeps_the_plain_step() -> None:
    # the rejection sampler makes x=0 -> 1 a jump; drafts then cost 1 ms each
    assert line_fit([0, 1, 2, 5], [10.0, 14.0, 15.0, 18.0]) == pytest.approx([10, 14, 15, 18])


def test_one_spike_moves_neither_slope_nor_intercept() -> None:
    got = line_fit([0, 1, 2, 5], [10.0, 14.0, 30.0, 17.0])
    assert got == pytest.approx([10.0, 14.0, 14.75, 17.0])  # Theil-Sen slope 0.75


def test_a_plain_step_is_never_dearer_than_one_draft() -> None:
    assert line_fit([0, 1, 2, 5], [20.0, 14.0, 15.0, 18.0])[0] == pytest.approx(14.0)


def test_more_rows_never_faster_and_short_grids_kept() -> None:
    assert line_fit([0, 1, 2, 5], [10.0, 16.0, 15.0, 14.0])[1:] == pytest.approx([15.0] * 3)
    assert line_fit([0, 1], [3.0, 5.0]) == [3.0, 5.0]


def test_runs_are_interleaved_and_the_fastest_kept() -> None:
    calls: list[str] = []

    def fn(name: str, seconds: float) -> Callable[[], None]:
        def run() -> None:
            calls.append(name)
            time.sleep(seconds)

        return run

    best = fastest_interleaved([fn("a", 0.004), fn("b", 0.0)], 3, lambda: None)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then one of each per round
    assert best[0] >= 0.004 > best[1]
