"""The CLI prints the memory plan at start-up and exits 2 when the budget cannot hold
one sequence (the message names needed vs available bytes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "xspec", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )


def test_cli_budget_too_small_exits_2() -> None:
    r = run_cli("model=qwen3_tiny", "spec=none", "platform=cpu", "engine.memory_budget=1000")
    assert r.returncode == 2, r.stderr
    assert "1000 bytes available but at least" in r.stderr and "Traceback" not in r.stderr


def test_cli_prints_the_plan() -> None:
    r = run_cli(
        "model=qwen3_tiny",
        "spec=none",
        "platform=cpu",
        "workload.num_requests=1",
        "workload.max_new_tokens=2",
        "workload.warmup_requests=0",
        "engine.memory_budget=0.01",
    )
    assert r.returncode == 0, r.stderr
    assert "memory plan: budget" in r.stdout and "concurrent sequences" in r.stdout
