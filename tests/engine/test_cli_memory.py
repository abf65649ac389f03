"""The CLI prints the memory plan at start-up and exits 2 when the budget cannot hold
one sequence (the message names needed vs available bytes)."""

from __future__ import annotations

from pathlib import Path

from tests.test_cli import run_cli


def test_cli_budget_too_small_exits_2(xspec_cache: Path) -> None:
    r = run_cli(
        "model=qwen3_tiny", "spec=none", "platform=cpu", "engine.memory_budget=1000",
        cache=xspec_cache,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "1000 bytes available but at least" in r.stderr and "Traceback" not in r.stderr


def test_cli_prints_the_plan(xspec_cache: Path) -> None:
    r = run_cli(
        "model=qwen3_tiny",
        "spec=none",
        "platform=cpu",
        "workload.num_requests=1",
        "workload.max_new_tokens=2",
        "workload.warmup_requests=0",
        "engine.memory_budget=0.01",
        cache=xspec_cache,
    )
    assert r.returncode == 0, r.stderr
    assert "memory plan: budget" in r.stdout and "concurrent sequences" in r.stdout
