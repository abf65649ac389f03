"""Outputs are atomic and a failed job of a sweep loses nothing (xspec/atomic.py,
xspec/__main__.py): a full disk leaves the previous file byte-identical and prints one
error; a sweep whose job crashes still writes the summary of the others."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from tests.clirun import run_cli_in_process
from xspec import atomic
from xspec.errors import OutputError

RUN = ["model=qwen3_tiny", "platform=cpu", "workload.max_new_tokens=3", "workload.num_requests=1"]


def enospc(*_: object, **__: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_atomic_write_replaces_whole_file_and_keeps_mode(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "r.json"
    atomic.write_json(path, {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1}
    path.chmod(0o640)
    atomic.write_json(path, {"a": 2})
    assert json.loads(path.read_text()) == {"a": 2}
    assert path.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in path.parent.iterdir()] == ["r.json"]  # no temp file left


def test_full_disk_leaves_the_previous_file_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "results.json"
    atomic.write_json(path, {"kept": [1, 2, 3]})
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", enospc)
    with pytest.raises(OutputError, match=r"cannot write .*results.json: No space left on device"):
        atomic.write_json(path, {"kept": "overwritten"})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_writer_that_fails_midway_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "x.bin"
    with pytest.raises(RuntimeError), atomic.atomic_path(path) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("writer failed")
    assert list(tmp_path.iterdir()) == []


def test_nan_is_refused_before_writing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Out of range float"):
        atomic.write_json(tmp_path / "r.json", {"x": float("nan")})
    assert list(tmp_path.iterdir()) == []


def test_cli_full_disk_keeps_results_json_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's results.json cannot be written: the previous one stays, one message, exit 1."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text('{"previous": true}\n')
    before = (out / "results.json").read_bytes()
    monkeypatch.setattr(os, "fsync", enospc)
    r = run_cli_in_process(*RUN, "spec=none", f"hydra.run.dir={out}", cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    assert (out / "results.json").read_bytes() == before
    assert r.stderr.count("xspec: error:") == 1 and "No space left on device" in r.stderr
    assert "Traceback" not in r.stderr


def test_multirun_with_a_crashed_job_writes_the_summary_of_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job 1 (spec=oracle) crashes at run time: job 0 and 2 still run, the summary lists
    them and marks job 1 failed, the traceback is in its directory, exit 1."""
    import xspec.run.report as report

    real = report.run_workload

    def crash_on_oracle(built, *args, **kwargs):  # type: ignore[no-untyped-def]
        if built.cfg.spec.method == "oracle":
            raise RuntimeError("simulated crash in the oracle job")
        return real(built, *args, **kwargs)

    monkeypatch.setattr(report, "run_workload", crash_on_oracle)
    sweep = tmp_path / "sweep"
    r = run_cli_in_process(
        "-m", *RUN, "spec=none,oracle,wrong", f"hydra.sweep.dir={sweep}", cwd=tmp_path
    )
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    assert "job 1 (" in r.stderr and "RuntimeError: simulated crash" in r.stderr
    assert "1 of 3 jobs failed" in r.stderr
    rows = json.loads((sweep / "summary.json").read_text())
    assert [(row["status"], row.get("spec")) for row in rows] == [
        ("ok", "none"), ("ok", "wrong"), ("failed", None)
    ]  # fmt: skip
    assert rows[2]["job"] == 1 and "spec=oracle" in rows[2]["overrides"]
    assert "failed jobs:" in (sweep / "summary.md").read_text()
    assert (sweep / "0" / "results.json").exists() and (sweep / "2" / "results.json").exists()
    assert not (sweep / "1" / "results.json").exists()
    assert "simulated crash" in (sweep / "1" / "error.txt").read_text()
