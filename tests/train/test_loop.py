"""The training loop: schedule, logging, and resuming to the same result as one run."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from xspec.train.loop import Job, Schedule, run


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
    assert result["step"] == 20 and (tmp_path / "toy_state.pt").exists()


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
