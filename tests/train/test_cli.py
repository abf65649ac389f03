"""``python -m xspec.train``: bad input is one message and exit code 2, nothing written."""

from __future__ import annotations

import subprocess
import sys


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xspec.train", *args], capture_output=True, text=True, timeout=120
    )


def test_unknown_stage(tmp_path) -> None:
    r = _run("bogus", "--work", str(tmp_path))
    assert r.returncode == 2 and "invalid choice: 'bogus'" in r.stderr


def test_export_before_training(tmp_path) -> None:
    work, out = tmp_path / "work", tmp_path / "out"
    r = _run("export", "--work", str(work), "--out", str(out))
    assert r.returncode == 2
    assert "target has trained 0/" in r.stderr and "python -m xspec.train target" in r.stderr
    assert "Traceback" not in r.stderr
    assert not out.exists()
