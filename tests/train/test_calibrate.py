"""Sequential Temperature Scaling: the fit recovers a known miscalibration, lowers ECE and
keeps the order of the confidences; the calibration file format and its bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from xspec.errors import ConfigError
from xspec.train.calibrate import ece, fit_sts
from xspec.workers.calibration import (
    CALIBRATION_FILE,
    ConfidenceCalibration,
    calibration_path,
    load_calibration,
    save_calibration,
)


def synthetic(n: int, gamma: int, scale: float, seed: int) -> tuple[torch.Tensor, ...]:
    """Rows whose true conditional acceptance at position k is sigmoid(u_k); the "head"
    reports ``scale * u_k`` (scale > 1: overconfident). Acceptance is sampled left to
    right; some rows verified fewer positions (their later columns carry no label)."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(n, gamma, generator=gen, dtype=torch.float64) * 1.5 + 0.5
    ok = torch.rand(n, gamma, generator=gen, dtype=torch.float64) < torch.sigmoid(u)
    drafted = torch.randint(1, gamma + 1, (n,), generator=gen)
    drafted[: n // 2] = gamma
    first_reject = torch.where(ok.all(1), gamma, (~ok).double().argmax(1))  # [n]
    accepted = torch.minimum(first_reject, drafted)
    return scale * u, drafted, accepted


def test_sts_recovers_the_temperature_and_lowers_ece() -> None:
    logits, drafted, accepted = synthetic(20_000, 3, scale=2.5, seed=0)
    cal = fit_sts(logits, drafted, accepted)
    assert len(cal.temperatures) == 3 and cal.num_samples == 20_000
    for t in cal.temperatures:
        assert t == pytest.approx(2.5, rel=0.2)
    for before, after in zip(cal.ece_before, cal.ece_after):
        assert after < before / 3 and after < 0.03
    assert cal.num_samples_per_position[0] == 20_000
    assert cal.num_samples_per_position[2] == int((drafted > 2).sum())


def test_sts_keeps_a_calibrated_head_and_the_order() -> None:
    logits, drafted, accepted = synthetic(20_000, 2, scale=1.0, seed=1)
    cal = fit_sts(logits, drafted, accepted)
    for t in cal.temperatures:
        assert t == pytest.approx(1.0, rel=0.2)
    assert all(a <= b + 1e-12 for a, b in zip(cal.ece_after, cal.ece_before))
    scaled = torch.sigmoid(logits / torch.tensor(cal.temperatures))
    for k in range(2):  # a positive temperature never reorders a position's confidences
        assert torch.equal(torch.argsort(scaled[:, k]), torch.argsort(logits[:, k]))


def test_ece_by_hand() -> None:
    pred = torch.tensor([0.1, 0.1, 0.9, 0.9])
    label = torch.tensor([0.0, 1.0, 1.0, 1.0])
    # bin of 0.1: mean p 0.1, mean y 0.5 (2 rows); bin of 0.9: 0.9 vs 1.0 (2 rows)
    assert ece(pred, label) == pytest.approx(0.5 * 0.4 + 0.5 * 0.1)


def test_file_round_trip_and_auto_lookup(tmp_path: Path) -> None:
    cal = ConfidenceCalibration(temperatures=[1.5, 2.0], num_samples=10)
    save_calibration(cal, tmp_path / CALIBRATION_FILE)
    assert load_calibration(tmp_path / CALIBRATION_FILE, 2, "here") == cal
    assert calibration_path("auto", tmp_path) == tmp_path / CALIBRATION_FILE
    assert calibration_path("auto", tmp_path / "nothing") is None
    assert calibration_path("off", tmp_path) is None
    assert calibration_path("/x/y.json", tmp_path) == Path("/x/y.json")


def test_wrong_number_of_positions_and_malformed_files(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    save_calibration(ConfidenceCalibration(temperatures=[1.0, 2.0, 3.0]), path)
    with pytest.raises(ConfigError, match=r"has 3 temperatures .* this run drafts 5 positions"):
        load_calibration(path, 5, "spec.adaptive.calibration")
    path.write_text(
        json.dumps({"format": "xspec.confidence_calibration.v1", "temperatures": [1, 0]})
    )
    with pytest.raises(ConfigError, match="numbers > 0"):
        load_calibration(path, 2, "spec.adaptive.calibration")
    path.write_text(json.dumps({"temperatures": [1.0]}))
    with pytest.raises(ConfigError, match="not an xspec confidence calibration"):
        load_calibration(path, 1, "spec.adaptive.calibration")
    with pytest.raises(ConfigError, match="does not exist"):
        load_calibration(tmp_path / "missing.json", 1, "spec.adaptive.calibration")


def test_calibrate_command_writes_a_table_the_run_reads(tmp_path: Path) -> None:
    """``python -m xspec.train calibrate``: the tiny Qwen3 DSpark draft on a short workload
    gives one temperature per position; an adaptive run reads the file. A method without
    a confidence head exits 2 with the reason, before loading."""
    import os
    import subprocess
    import sys

    import xspec

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = tmp_path / "cal.json"
    cmd = [sys.executable, "-m", "xspec.train", "calibrate", "--out", str(out)]
    run = [
        *cmd,
        "model=qwen3_tiny",
        "spec=dspark",
        "workload.num_requests=4",
        "workload.max_new_tokens=24",
    ]
    r = subprocess.run(run, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "calibrated 4 positions" in r.stdout and str(out) in r.stdout
    body = json.loads(out.read_text())
    assert len(body["temperatures"]) == 4 and body["num_samples"] > 0
    llm = xspec.LLM(
        model="qwen3_tiny",
        spec="dspark",
        platform="cpu",
        overrides={"spec.adaptive.calibration": str(out)},
    )
    assert llm._built.drafter.calibration_file == out  # type: ignore[attr-defined]
    bad = subprocess.run(
        [*cmd, "model=dsv4_tiny_random", "spec=mtp"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert bad.returncode == 2 and "needs a drafter with a confidence head" in bad.stderr
