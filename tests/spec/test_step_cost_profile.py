"""The step-cost profile's measurement: interleaved timing and the robust line."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from xspec.spec.adaptive import profile as step_cost
from xspec.spec.adaptive.profile import line_fit, median_interleaved, tree_digest


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


def test_runs_are_interleaved_and_the_median_kept() -> None:
    calls: list[str] = []

    def fn(name: str, seconds: list[float]) -> Callable[[], None]:
        def run() -> None:
            calls.append(name)
            time.sleep(seconds.pop(0))

        return run

    # warm-up, then 3 runs: a spike (0.05) and a fast outlier (0.0) around 0.01
    a = fn("a", [0.0, 0.05, 0.0, 0.01])
    best = median_interleaved([a, fn("b", [0.0] * 4)], 3, lambda: None)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then one of each per round
    assert 0.01 <= best[0] < 0.05 and best[1] < 0.01


def test_a_cached_profile_is_named_by_the_source_that_measured_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit of any module, or a renamed one, names another cached profile (other files
    do not); the same key and source always name the same one."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("x = 1\n")
    (pkg / "sub" / "b.py").write_text("y = 2\n")
    first = tree_digest(pkg)
    (pkg / "notes.txt").write_text("not code")
    assert tree_digest(pkg) == first
    (pkg / "sub" / "b.py").write_text("y = 3\n")
    edited = tree_digest(pkg)
    (pkg / "sub" / "b.py").rename(pkg / "sub" / "c.py")
    assert len({first, edited, tree_digest(pkg)}) == 3

    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    key = {"gamma": 5}
    monkeypatch.setattr(step_cost, "source_digest", lambda: first)
    path = step_cost.cached_profile_path(key)
    assert path == step_cost.cached_profile_path(dict(key))
    assert path.parent == tmp_path / "cache" / "step_cost"
    monkeypatch.setattr(step_cost, "source_digest", lambda: edited)
    assert step_cost.cached_profile_path(key) != path


def test_the_source_digest_covers_the_whole_package() -> None:
    """A cached profile is named by every xspec module's source, wherever the profile
    module itself sits in the package."""
    import xspec

    assert step_cost.source_digest() == tree_digest(Path(xspec.__file__).parent)
