"""``python -m xspec.train``: bad input is one message and exit code 2, nothing written;
an older xspec's pickles are refused unopened; a full disk is one message and exit 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


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


# in-process from here on: xspec.train.__main__.main, stderr through capsys


def test_a_planted_pickle_state_is_refused_unopened(tmp_path, capsys) -> None:
    """An older xspec's ``target_state.pt`` (here a pickle that would create a marker
    file) stops the stage with one message naming it and saying what to do; none of its
    code runs."""
    from tests.train.test_loop import plant_pickle
    from xspec.train.__main__ import main

    work, out, marker = tmp_path / "work", tmp_path / "out", tmp_path / "marker"
    work.mkdir()
    plant_pickle(work / "target_state.pt", marker)
    assert main(["export", "--work", str(work), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert str(work / "target_state.pt") in err and "not loaded" in err
    assert "the target stage trains again from step 0" in err and "Traceback" not in err
    assert not marker.exists() and not out.exists()


def test_the_stages_refuse_a_planted_pickle_through_the_api(tmp_path) -> None:
    """The same through the Python API (no CLI pre-check): the export and drafters stages
    read states and the regenerated text only through loaders that refuse pickles."""
    from tests.train.test_loop import plant_pickle
    from xspec.errors import CheckpointError
    from xspec.train.pipeline import Recipe, finished, stage_regen

    marker = tmp_path / "marker"
    plant_pickle(tmp_path / "mtp_state.pt", marker)
    with pytest.raises(CheckpointError, match=r"mtp_state.pt is a pickle file"):
        finished(tmp_path, "mtp", 1)
    plant_pickle(tmp_path / "regen.pt", marker)
    with pytest.raises(CheckpointError, match=r"regen.pt is a pickle file"):
        stage_regen(tmp_path, Recipe())
    assert not marker.exists()


def test_a_full_disk_is_one_error_line(tmp_path, monkeypatch, capsys) -> None:
    """A stage whose state save hits a full disk: exit 1, one line, no traceback; the
    previous state file is untouched."""
    from tests.train.test_loop import _job, _toy, no_space
    from xspec.train import pipeline
    from xspec.train.__main__ import main
    from xspec.train.loop import run

    work = tmp_path / "work"
    run(_job(_toy(), 3), work, progress=False)
    before = (work / "toy_state.safetensors").read_bytes()

    def stage_target(work: Path, recipe: object, *, progress: bool) -> dict:
        return run(_job(_toy(), 6), work, progress=progress)

    monkeypatch.setattr(pipeline, "stage_target", stage_target)
    monkeypatch.setattr(os, "fsync", no_space)
    assert main(["target", "--work", str(work), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot write ")
    assert "toy_state.safetensors: No space left on device" in err
    assert (work / "toy_state.safetensors").read_bytes() == before
