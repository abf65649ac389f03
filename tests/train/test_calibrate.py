"""Sequential Temperature Scaling: the fit recovers a known miscalibration, lowers ECE and
keeps the order of the confidences; the recorder keeps the head's raw logits (no
saturation); the calibration file format, its sampling regime, its bad inputs and its
atomic write."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch

from xspec.errors import ConfigError, OutputError
from xspec.models.draft_heads import ConfidenceHead
from xspec.spec.adaptive.calibration import (
    CALIBRATION_FILE,
    ConfidenceCalibration,
    calibration_path,
    load_calibration,
    save_calibration,
)
from xspec.train.calibrate import ConfidenceRecorder, LogitTap, ece, fit_sts


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


def test_the_recorder_keeps_raw_logits_past_sigmoid_saturation() -> None:
    """Confidences of z = 30 or 18 are exactly 1.0 in fp32 (logit(clamp(c, 1e-6)) would
    record 13.8 for both): the recorder keeps the head's z itself, for the rows and the
    prefix of positions the step verified."""
    head = ConfidenceHead(2, 0, bias=False, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        head.proj.weight.copy_(torch.tensor([[1.0, 0.0]]))  # z = h[..., 0]
    z_want = torch.tensor([[30.0, -40.0, 2.0, 5.0], [0.5, 18.0, -1.0, 7.0]])
    h = torch.stack([z_want, torch.zeros_like(z_want)], dim=-1)  # [2, 4, 2]
    tap = LogitTap()
    recorder = ConfidenceRecorder(tap)
    with tap.installed(head):
        z = head.logits(h, None)  # what the drafter's propose calls: [2, 4]
        confidence = torch.sigmoid(z)[:, :3]  # the step verifies 3 of the 4 proposed
        assert confidence[0, 0] == 1.0 and confidence[1, 1] == 1.0  # saturated in fp32
        output = torch.tensor([[7, 7, 7, 7], [7, 7, -1, -1]])  # accepted 3, 1
        recorder.observe_step(output, torch.tensor([3, 3]), confidence)
    assert "logits" not in vars(head)  # the tap is removed again
    logits, drafted, accepted = recorder.samples(3)
    assert torch.equal(logits, z_want[:, :3].double())
    assert drafted.tolist() == [3, 3] and accepted.tolist() == [3, 1]
    with pytest.raises(RuntimeError, match="do not match the confidence head"):
        recorder.observe_step(output, torch.tensor([3, 3]), confidence)  # no head call since


def _cal(**regime: object) -> ConfidenceCalibration:
    return ConfidenceCalibration(temperatures=[1.0], **regime)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("regime", "params", "differs"),
    [
        ({"sampling_temperature": 0.0}, {}, False),
        ({"sampling_temperature": 0.0}, {"temperature": 1e-6, "top_k": 5}, False),  # greedy
        ({"sampling_temperature": 0.0}, {"temperature": 0.8}, True),
        ({"sampling_temperature": 0.8}, {}, True),
        ({"sampling_temperature": 0.8}, {"temperature": 0.8}, False),
        ({"sampling_temperature": 0.8}, {"temperature": 1.0}, True),
        (
            {"sampling_temperature": 0.8, "sampling_top_k": 0},
            {"temperature": 0.8, "top_k": 20},
            True,
        ),
        ({"sampling_temperature": 0.8, "sampling_top_p": 0.9}, {"temperature": 0.8}, True),
        ({"sampling_temperature": 0.8}, {"temperature": 0.8, "top_p": 0.9}, False),  # unrecorded
        ({}, {}, True),  # an older file: regime unknown
    ],
)
def test_regime_mismatch(regime: dict, params: dict, differs: bool) -> None:
    from xspec.sampling import SamplingParams

    why = _cal(**regime).mismatch(SamplingParams(**params))
    assert (why is not None) == differs, why


def test_regime_check_warns_once_per_regime(caplog: pytest.LogCaptureFixture) -> None:
    """A greedy fit applied to requests at T = 0.8: one warning naming the file and both
    regimes, however many steps; another regime warns again; greedy requests never."""
    import logging

    from xspec.sampling import SamplingParams
    from xspec.spec.adaptive.calibration import RegimeCheck

    check = RegimeCheck(_cal(sampling_temperature=0.0), Path("/d/cal.json"))
    hot, warm = SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=0.5)
    with caplog.at_level(logging.WARNING, logger="xspec.spec.adaptive.calibration"):
        check([SamplingParams()] * 3)
        assert caplog.records == []
        for _ in range(3):
            check([hot, SamplingParams(temperature=0.8, seed=2), SamplingParams()])
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert "/d/cal.json" in msg and "fitted at greedy (temperature 0)" in msg
        assert "requests sample at temperature 0.8" in msg and "calibration=off" in msg
        check([warm])
        assert len(caplog.records) == 2 and "temperature 0.5" in caplog.records[1].getMessage()


def test_an_older_file_without_a_regime_loads_and_warns(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The files written before the regime was recorded still load; applying one warns
    that its regime is unknown."""
    import logging

    from xspec.sampling import SamplingParams
    from xspec.spec.adaptive.calibration import RegimeCheck

    path = tmp_path / "old.json"
    path.write_text(json.dumps({"format": "xspec.confidence_calibration.v1", "temperatures": [2]}))
    cal = load_calibration(path, 1, "here")
    assert cal.sampling_temperature is None and cal.fitted_regime() == "an unknown sampling regime"
    with caplog.at_level(logging.WARNING, logger="xspec.spec.adaptive.calibration"):
        RegimeCheck(cal, path)([SamplingParams()])
    assert "does not record the sampling regime" in caplog.text


def test_the_shipped_calibration_records_greedy() -> None:
    from xspec.models.presets import ASSETS
    from xspec.sampling import SamplingParams

    cal = load_calibration(ASSETS / "dsv4_tiny_dspark" / CALIBRATION_FILE, 5, "asset")
    assert cal.sampling_temperature == 0.0 and cal.mismatch(SamplingParams()) is None
    assert cal.mismatch(SamplingParams(temperature=0.8)) is not None


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("sampling_temperature", "hot", "sampling_temperature must be a number >= 0"),
        ("sampling_temperature", -1, "sampling_temperature must be a number >= 0"),
        ("sampling_top_k", 1.5, "sampling_top_k must be an integer >= 0"),
        ("sampling_top_p", 0, r"sampling_top_p must be a number in \(0, 1\]"),
    ],
)
def test_a_malformed_regime_is_refused(tmp_path: Path, key: str, value: object, match: str) -> None:
    path = tmp_path / "cal.json"
    body = {"format": "xspec.confidence_calibration.v1", "temperatures": [1.0], key: value}
    path.write_text(json.dumps(body))
    with pytest.raises(ConfigError, match=match):
        load_calibration(path, 1, "spec.adaptive.calibration")


def no_space(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_keeps_the_previous_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The file is a temp file beside it, fsynced, renamed: when the disk is full the
    previous file is byte-identical, no temp file is left, and the command prints one
    error line (exit 1), not a traceback."""
    from xspec.train import calibrate

    path = tmp_path / CALIBRATION_FILE
    save_calibration(ConfidenceCalibration(temperatures=[1.5, 2.0]), path)
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OutputError, match=r"cannot write .*: No space left on device"):
        save_calibration(ConfidenceCalibration(temperatures=[3.0, 4.0]), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]

    def fit_and_save(overrides: list[str], out: Path | None, temperatures: object = None) -> tuple:
        cal = ConfidenceCalibration(temperatures=[3.0, 4.0])
        save_calibration(cal, path)  # what calibrate() ends with
        return cal, path

    monkeypatch.setattr(calibrate, "calibrate", fit_and_save)
    assert calibrate.main(["--out", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot write" in err and "No space left" in err
    assert path.read_bytes() == before


def test_calibrate_command_writes_a_table_the_run_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """``python -m xspec.train calibrate`` (in process): the tiny Qwen3 DSpark draft on a
    short sampled workload gives one temperature per position and records the sampling
    regime; an adaptive run reads the file. A method without a confidence head exits 2
    with the reason, before loading."""
    import xspec
    from xspec.train.__main__ import main

    out = tmp_path / "cal.json"
    run = [
        "calibrate",
        "--out",
        str(out),
        "model=qwen3_tiny",
        "spec=dspark",
        "workload.num_requests=4",
        "workload.max_new_tokens=24",
        "sampling.temperature=0.7",
        "sampling.top_k=40",
    ]
    assert main(run) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "calibrated 4 positions" in printed and str(out) in printed
    body = json.loads(out.read_text())
    assert len(body["temperatures"]) == 4 and body["num_samples"] > 0
    regime = {k: body[k] for k in ("sampling_temperature", "sampling_top_k", "sampling_top_p")}
    assert regime == {"sampling_temperature": 0.7, "sampling_top_k": 40, "sampling_top_p": 1.0}
    llm = xspec.LLM(
        model="qwen3_tiny",
        spec="dspark",
        platform="cpu",
        overrides={"spec.adaptive.calibration": str(out)},
    )
    assert llm._built.drafter.calibration_file == out  # type: ignore[attr-defined]
    assert main(["calibrate", "model=dsv4_tiny_random", "spec=mtp"]) == 2
    assert "needs a drafter with a confidence head" in capsys.readouterr().err
