"""benchmarks/bench_adaptive.py's turns: how much of a run one turn steps, and when the
children exit."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
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


# a stand-in for a ``--turns --child`` process: ``turns`` turns, then its figures; it
# exits when its stdin closes and leaves a file saying so; on its last turn it waits up
# to a second for ``peer``'s file (another child's exit), and reports whether it came
_CHILD = r"""
import json, os, sys, time
exited, turns, peer = sys.argv[1], int(sys.argv[2]), sys.argv[3]
print("ready", flush=True)
saw = False
for t in range(turns):
    sys.stdin.readline()
    if t == turns - 1 and peer:
        end = time.monotonic() + 1.0
        while not saw and time.monotonic() < end:
            saw = os.path.exists(peer)
            time.sleep(0.01)
    print("stepped" if t < turns - 1 else "done", flush=True)
print(json.dumps({"saw_an_exit": saw}), flush=True)
sys.stdin.read()
open(exited, "w").close()
"""


def test_no_child_exits_before_every_one_is_done(tmp_path: Path) -> None:
    """A child done early stays alive until the last is done: its exit would run beside
    the turns of those still measuring."""
    early, late = tmp_path / "early", tmp_path / "late"
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(exited), str(turns), str(peer)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, exited, turns, peer in (("early", early, 1, ""), ("late", late, 3, early))
    }
    with contextlib.ExitStack() as stack:
        logs = {name: stack.enter_context(tempfile.TemporaryFile("w+")) for name in procs}
        for p in procs.values():
            stack.enter_context(p)  # on the way out: its pipes closed, waited for
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        results = bench_adaptive.drive_turns(procs, logs)
        assert results == {"early": {"saw_an_exit": False}, "late": {"saw_an_exit": False}}
        for p in procs.values():  # released: each exits on its own
            assert p.wait(timeout=10) == 0
        assert early.exists() and late.exists()


def test_a_child_in_turns_exits_only_when_its_stdin_closes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench_adaptive, "child", lambda spec, turns: {"tok_s": 1.0})
    stdin = io.StringIO("left over\n")
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "argv", ["bench_adaptive.py", "--turns", "--child", "{}"])
    bench_adaptive.main()
    assert json.loads(capsys.readouterr().out) == {"tok_s": 1.0}
    assert stdin.read() == ""  # it read its stdin to the end before returning


@pytest.mark.parametrize(
    ("per_slot", "least", "c", "want"),
    [
        (None, None, 4, 8),
        (2, None, 8, 16),
        (8, None, 4, 32),
        (8, None, 1, 8),
        (2, 32, 4, 32),
        (2, 32, 8, 32),
        (2, 32, 32, 64),
        (None, 1, 1, 2),
    ],
)
def test_a_run_has_requests_per_slot_times_the_concurrency(
    per_slot: int | None, least: int | None, c: int, want: int
) -> None:
    """``max(--requests-per-slot * c, --min-requests)`` requests (2 per slot and at least
    8 when a caller's namespace has no such fields)."""
    a = argparse.Namespace(
        overrides=[], prompts=bench_adaptive.PROMPTS, max_new=48, gamma=5, concurrency=[c]
    )
    if per_slot is not None:
        a.requests_per_slot = per_slot
    if least is not None:
        a.min_requests = least
    o = bench_adaptive.overrides_for("fixed", a, 0.8, c, 3)
    assert o["workload.num_requests"] == str(want) and o["workload.concurrency"] == str(c)


@pytest.mark.parametrize("flag", ["--requests-per-slot", "--min-requests"])
def test_fewer_than_one_request_is_refused(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_adaptive.py", flag, "0"])
    with pytest.raises(SystemExit) as e:
        bench_adaptive.main()
    assert e.value.code == 2 and f"{flag} must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("n", [2, 8, 9, 16, 24, 32, 64])
@pytest.mark.parametrize("spread", [0, 3, 8, 16])
def test_spread_lengths_keep_the_mean_and_mix_each_wave(n: int, spread: int) -> None:
    lengths = bench_adaptive.spread_lengths(n, 48, spread)
    assert len(lengths) == n and sum(lengths) == 48 * n  # the same tokens as unspread
    assert min(lengths) == 48 - spread and max(lengths) == 48 + spread
    assert sorted(lengths) == sorted(
        48 - spread + round(2 * spread * j / (n - 1)) for j in range(n)
    )
    if spread and n >= 8:  # the first half (a wave) is not all the short ones
        half = sorted(lengths[: n // 2])
        assert half != sorted(lengths)[: n // 2] and half != sorted(lengths)[n - n // 2 :]


def test_a_child_gives_each_request_its_spread_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's runs get ``spread_lengths`` (the workload's max_new_tokens is the
    longest's, so every request fits the plan)."""
    a = argparse.Namespace(
        overrides=[],
        prompts=bench_adaptive.PROMPTS,
        max_new=12,
        gamma=5,
        concurrency=[4],
        threads=1,
        warmup="two",
        turn_ms=0.0,
        max_new_spread=4,
    )
    spec = bench_adaptive.child_spec("fixed", a, 0.0, 4, 0)
    assert spec["overrides"]["workload.max_new_tokens"] == "16"
    seen: list[list[int]] = []
    import xspec.engine.engine as engine_mod

    run = engine_mod.Engine.run

    def spy(self: Any, requests: Any, concurrency: int) -> Any:
        seen.append([r.max_new_tokens for r in requests])
        return run(self, requests, concurrency)

    monkeypatch.setattr(engine_mod.Engine, "run", spy)
    out = bench_adaptive.child(spec)
    want = bench_adaptive.spread_lengths(8, 12, 4)
    assert seen[-1] == want and sorted(set(want)) != [12]
    assert out["steps"] > 0


@pytest.mark.parametrize("spread", ["-1", "48"])
def test_a_spread_outside_0_to_max_new_is_refused(
    spread: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(
        sys, "argv", ["bench_adaptive.py", "--max-new", "48", "--max-new-spread", spread]
    )
    with pytest.raises(SystemExit) as e:
        bench_adaptive.main()
    assert (
        e.value.code == 2
        and "--max-new-spread must be in [0, --max-new)" in capsys.readouterr().err
    )


def test_the_simulation_mode_finds_plain_right_on_its_default_machine(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--simulate``: the decision on a synthetic machine where plain steps are right
    (the defaults) drafts only a few exploring steps of the big batch."""
    argv = ["bench_adaptive.py", "--simulate", "--seeds", "1", "--steps", "300"]
    monkeypatch.setattr(sys, "argv", [*argv, "--spells", "20:1.0"])
    bench_adaptive.main()
    out = capsys.readouterr().out
    assert "so plain is right (share 0)" in out
    share = float(out.split("mean ")[1].split()[0])
    assert share < 0.1, out


def test_no_benchmark_reaches_into_private_state() -> None:
    """Benchmarks use the public API (``xspec.LLM``'s ``engine`` and ``built``), never
    ``llm._built`` or another object's private attributes."""
    import re

    root = Path(__file__).resolve().parents[2] / "benchmarks"
    private = re.compile(r"\b(?!self\b|torch\b)[a-z_]\w*\.(_[a-z]\w*)")
    hits = [
        f"{p.name}:{i}: {m.group(0)}"
        for p in sorted(root.glob("*.py"))
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if not line.lstrip().startswith(("import ", "from "))  # module paths, not objects
        for m in private.finditer(line)
        if not m.group(1).startswith("__")
    ]
    assert hits == []


def _prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]


def test_the_heldout_prompts_share_no_line_with_the_tuning_prompts() -> None:
    """The judged set: the default workload's prompts first, then held-out-file prompts,
    none of them (nor any of its lines) a tuning prompt's."""
    import yaml

    from benchmarks import heldout_prompts as h

    tuning, judged = _prompts(bench_adaptive.PROMPTS), _prompts(bench_adaptive.HELDOUT)
    workload = yaml.safe_load(h.WORKLOAD.read_text())["prompts"]
    assert judged[: len(workload)] == workload and len(judged) == len(workload) + 24
    assert len(set(judged)) == len(judged)
    seen = set().union(*map(h._lines, tuning))
    assert not any(h._lines(p) & seen for p in judged)


def test_judging_on_both_sets_runs_each_cell_on_each_set_side_by_side(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--judge both``: per repeat and cell a run of each configuration on each prompt
    set (the set's file in its overrides), and a table of both sets' ratios."""
    calls: list[tuple[str, str, int]] = []

    def run_one(config: str, a: argparse.Namespace, t: float, c: int, seed: int = 0) -> dict:
        calls.append((config, Path(a.prompts).name, seed))
        speed = {"none": 100.0, "fixed": 200.0, "adaptive": 190.0}[config]
        return {"tok_s": speed * (1.1 if a.prompts == bench_adaptive.HELDOUT else 1.0)}

    monkeypatch.setattr(bench_adaptive, "run_one", run_one)
    monkeypatch.setattr(bench_adaptive, "details", lambda a, runs: "")
    argv = ["x", "--judge", "both", "--configs", "none", "fixed", "adaptive"]
    argv += ["--concurrency", "1", "--temperatures", "0.8", "--reps", "2"]
    monkeypatch.setattr(sys, "argv", argv)
    bench_adaptive.main()
    assert len(calls) == 2 * 2 * 3  # reps x sets x configurations
    for seed in (0, 1):
        for name in ("adaptive_prompts.jsonl", "heldout_prompts.jsonl"):
            assert {c for c, n, s in calls if n == name and s == seed} == {
                "none",
                "fixed",
                "adaptive",
            }
    out = capsys.readouterr().out
    assert "| T=0.8 | 1 | 0.95 | 0.95 | 0.95 | 0.95 |" in out  # tuning, then heldout


def test_ratios_need_none_fixed_and_adaptive(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["x", "--configs", "none", "adaptive"])
    with pytest.raises(SystemExit) as e:
        bench_adaptive.main()
    assert e.value.code == 2 and "must include none fixed adaptive" in capsys.readouterr().err
