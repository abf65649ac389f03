"""The training loop: schedule, logging, and resuming to the same result as one run; its
state files are safetensors + JSON (a pickle is refused unopened), written atomically."""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from xspec.errors import CheckpointError, OutputError
from xspec.train.loop import Job, Schedule, run
from xspec.train.state import load_state


def _job(module: nn.Module, steps: int, fail_at: int | None = None) -> Job:
    calls = {"n": 0}

    def loss_fn(gen: torch.Generator) -> tuple[torch.Tensor, dict[str, float]]:
        calls["n"] += 1
        if fail_at is not None and calls["n"] == fail_at:
            raise KeyboardInterrupt  # an interrupted run
        x = torch.randn(16, 4, generator=gen)
        loss = (module(x) - x.sum(-1, keepdim=True)).square().mean()
        return loss, {"loss": loss.item()}

    sched = Schedule(steps=steps, lr=0.05, warmup=2, save_every=3, log_every=1)
    return Job("toy", module, list(module.parameters()), loss_fn, sched, seed=5)


def _toy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def test_loss_decreases_and_log_lines(tmp_path) -> None:
    module = _toy()
    result = run(_job(module, 20), tmp_path, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "toy_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 21))
    assert lines[-1]["loss"] < 0.2 * lines[0]["loss"]
    assert all(x["step_s"] > 0 for x in lines)  # progress: tokens/s = tokens a step / step_s
    assert result["step"] == 20 and (tmp_path / "toy_state.safetensors").exists()


def test_resume_after_interrupt_equals_one_run(tmp_path) -> None:
    straight = _toy()
    run(_job(straight, 10), tmp_path / "a", progress=False)
    resumed = _toy()
    with pytest.raises(KeyboardInterrupt):
        run(_job(resumed, 10, fail_at=8), tmp_path / "b", progress=False)  # saved at step 6
    again = _toy()  # a fresh process: weights come back from the state file
    run(_job(again, 10), tmp_path / "b", progress=False)
    for a, b in zip(straight.parameters(), again.parameters()):
        assert torch.equal(a, b)
    logged = [json.loads(x) for x in (tmp_path / "b" / "toy_log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in logged] == list(range(1, 11))  # no line twice


def test_schedule_warmup_then_cosine() -> None:
    s = Schedule(steps=100, lr=1.0, warmup=10, min_lr_ratio=0.1)
    assert s.lr_at(0) == pytest.approx(0.1) and s.lr_at(9) == pytest.approx(1.0)
    assert s.lr_at(10) == pytest.approx(1.0) and s.lr_at(100) == pytest.approx(0.1)
    assert s.lr_at(55) == pytest.approx(0.55)


class Planted:
    """Unpickling this calls ``open(marker, "w")``: creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (str(self.marker), "w"))


def plant_pickle(path: Path, marker: Path) -> None:
    """A ``torch.save`` file whose loading with ``weights_only=False`` runs code."""
    torch.save({"step": 0, "module": Planted(marker)}, path)


def test_state_file_is_safetensors_with_a_json_header(tmp_path) -> None:
    """Tensors by name, the rest JSON; the optimiser comes back as it was (betas a tuple)."""
    module = _toy()
    run(_job(module, 4), tmp_path, progress=False)
    path = tmp_path / "toy_state.safetensors"
    with safe_open(str(path), "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
    assert {"module.weight", "module.bias", "generator"} <= keys
    assert {"optimizer.state.0.exp_avg", "optimizer.state.1.exp_avg_sq"} <= keys
    body = json.loads(meta["xspec"])
    assert body["step"] == 4 and body["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.95]
    state = load_state(path)
    assert state.step == 4 and torch.equal(state.module["weight"], module.weight)
    opt = torch.optim.AdamW(module.parameters(), lr=1.0, betas=(0.9, 0.95))
    from xspec.train.state import restore_optimizer

    restore_optimizer(opt, state.optimizer)
    assert opt.param_groups[0]["betas"] == (0.9, 0.95)
    assert torch.equal(opt.state[module.weight]["exp_avg"], state.optimizer["state"][0]["exp_avg"])


@pytest.mark.parametrize("name", ["toy_state.pt", "toy_state.safetensors"])
def test_a_crafted_pickle_is_refused_and_never_run(tmp_path, name) -> None:
    """A pickle planted as the old state file (or under the new name) is an error naming
    the file; none of its code runs."""
    marker = tmp_path / "marker"
    plant_pickle(tmp_path / name, marker)
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / name))) as info:
        run(_job(_toy(), 4), tmp_path, progress=False)
    assert not marker.exists()
    want = "is a pickle file" if name.endswith(".pt") else "is not a readable xspec training"
    assert want in str(info.value) and "elete it" in str(info.value)


def test_a_state_of_another_job_is_a_clear_error(tmp_path) -> None:
    run(_job(_toy(), 3), tmp_path, progress=False)
    bigger = nn.Linear(4, 2)
    job = _job(bigger, 4)
    job.loss_fn = lambda gen: (bigger(torch.randn(2, 4, generator=gen)).sum(), {"loss": 0.0})
    with pytest.raises(CheckpointError, match=r"toy_state.safetensors does not fit this toy job"):
        run(job, tmp_path, progress=False)


def no_space(fd: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_keeps_the_previous_state(tmp_path, monkeypatch) -> None:
    """The save is a temp file, fsynced, then renamed: when the disk is full the previous
    state stays byte-identical, no temp file is left, and the error is one OutputError."""
    run(_job(_toy(), 3), tmp_path, progress=False)  # saved at step 3
    path = tmp_path / "toy_state.safetensors"
    before = path.read_bytes()
    monkeypatch.setattr(os, "fsync", no_space)
    with pytest.raises(OutputError, match=r"cannot write .*toy_state.safetensors: No space"):
        run(_job(_toy(), 6), tmp_path, progress=False)  # saves at step 6
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy_log.jsonl", "toy_state.safetensors"]
    monkeypatch.undo()
    straight, resumed = _toy(), _toy()
    run(_job(straight, 6), tmp_path / "one", progress=False)
    run(_job(resumed, 6), tmp_path, progress=False)  # resumes from step 3, as before
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_no_pickle_loading_in_the_training_code() -> None:
    """A grep test: nothing under xspec/train unpickles (torch.load, pickle)."""
    root = Path(__file__).resolve().parents[2] / "xspec" / "train"
    for path in root.glob("*.py"):
        src = path.read_text()
        for banned in ("torch.load(", "import pickle", "weights_only"):
            assert banned not in src, f"{path.name} uses {banned}"
