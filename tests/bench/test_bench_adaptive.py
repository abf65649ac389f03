"""benchmarks/bench_adaptive.py's turns: how much of a run one turn steps."""

from __future__ import annotations

import io
from typing import Any

import pytest

from benchmarks import bench_adaptive


class _Engine:
    """What run_in_turns drives: ``steps`` iterations of ``step_s`` seconds each, on a
    clock of its own (``perf_counter``: the harness's clock in these tests)."""

    def __init__(self, steps: int, step_s: float) -> None:
        self.left, self.step_s, self.concurrency, self.now = steps, step_s, 0, 0.0

    def perf_counter(self) -> float:
        return self.now

    def reset_clock(self) -> None:
        pass

    def add(self, i: int, request: Any, arrived_at: float) -> int:
        return i

    @property
    def busy(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.now += self.step_s
        self.left -= 1


def _turns(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    steps: int,
    turn_s: float,
) -> tuple[int, float]:
    engine = _Engine(steps, 0.01)
    monkeypatch.setattr(bench_adaptive, "time", engine)
    go = io.StringIO("go\n" * steps)
    gens, seconds = bench_adaptive.run_in_turns(engine, [None] * 2, 2, go, turn_s)
    lines = capsys.readouterr().out.split()
    assert gens == [0, 1] and lines[0] == "ready" and lines[-1] == "done"
    assert set(lines[1:-1]) <= {"stepped"} and not engine.busy
    return len(lines) - 2, seconds  # turns taken (ready and done aside: the last is done)


def test_a_turn_of_zero_seconds_is_one_iteration(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    turns, seconds = _turns(capsys, monkeypatch, 6, 0.0)
    assert turns + 1 == 6  # every iteration a turn of its own
    assert seconds == pytest.approx(6 * 0.01)


def test_a_turn_steps_until_its_seconds(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 10 ms iterations, 25 ms turns: three iterations a turn (the third crosses 25 ms),
    # so 7 iterations take 3 turns (3 + 3 + 1), and the run's seconds are all 7
    turns, seconds = _turns(capsys, monkeypatch, 7, 0.025)
    assert turns + 1 == 3
    assert seconds == pytest.approx(7 * 0.01)
    turns, _ = _turns(capsys, monkeypatch, 4, 10.0)  # a turn longer than the run
    assert turns + 1 == 1
