"""A CLI run whose requests fail while it runs (their logits turn NaN/Inf): a run in
which every request failed measured nothing and exits 1, results.json and the summary
still written; a run in which some failed says how many under its figures, exit 0."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from tests.clirun import run_cli_in_process

BASE = ["spec=none", "platform=cpu", "workload.max_new_tokens=3", "workload.num_requests=2",
        "workload.warmup_requests=0", "workload.prompts=[Zebra,hello]"]  # fmt: skip


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the Qwen3 tiny preset whose final norm weight is 3e38: finite, so it
    loads, but every logit overflows to Inf (the head multiplies the normed hidden)."""
    from xspec.models.qwen3.tiny import tiny_dir

    ckpt = tmp_path_factory.mktemp("ckpt") / "overflowing"
    shutil.copytree(tiny_dir(False), ckpt)
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"]["model.norm.weight"]
    tensors = load_file(shard)
    tensors["model.norm.weight"].fill_(3e38)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return ckpt


def test_a_run_where_every_request_failed_exits_1(tmp_path: Path, overflowing: Path) -> None:
    out = tmp_path / "out"
    r = run_cli_in_process(
        "model=qwen3", f"model.path={overflowing}", "model.tokenizer=byte", *BASE,
        f"hydra.run.dir={out}", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert (
        "xspec: error: every one of the 2 requests failed (the errors are above and in "
        "results.json), so this run measured nothing; exit code 1"
    ) in r.stderr
    assert "Traceback" not in r.stderr and "TTFT, TPOT and throughput n/a" in r.stdout
    job = json.loads((out / "results.json").read_text())
    assert all("logits became NaN/Inf" in q["error"] for q in job["requests"])
    assert (out / "summary.md").is_file()


def test_a_sweep_says_which_jobs_served_nothing(tmp_path: Path, overflowing: Path) -> None:
    r = run_cli_in_process(
        "-m", "model=qwen3", f"model.path={overflowing}", "model.tokenizer=byte", *BASE,
        "spec=none,oracle", f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 1, r.stderr
    assert "xspec: error: in 2 of 2 jobs every request failed" in r.stderr


def test_some_failed_requests_are_said_under_the_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Request 0 (its prompt holds a "Z") gets NaN logits at its prefill, as a checkpoint
    that overflows on one token would give it; request 1 is served: exit 0, one line."""
    from xspec.models.qwen3.model import Qwen3Model

    forward = Qwen3Model.forward

    def poisoned(self: Qwen3Model, batch: Any) -> Any:
        out = forward(self, batch)
        rows = range(len(batch.input_ids)) if batch.logit_rows is None else batch.logit_rows
        start = 0
        for n in batch.seq_lens:
            if n > 1 and ord("Z") in batch.input_ids[start : start + n].tolist():  # a prefill
                out.logits[[k for k, r in enumerate(rows) if start <= r < start + n]] = math.nan
            start += n
        return out

    monkeypatch.setattr(Qwen3Model, "forward", poisoned)
    r = run_cli_in_process(
        "model=qwen3_tiny", *BASE,
        f"hydra.run.dir={tmp_path / 'out'}", cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "xspec: request 0: the target's logits became NaN/Inf" in r.stderr
    assert (
        "xspec: warning: 1 of 2 requests failed (the errors are above and in results.json); "
        "the timings are over the 1 that did not"
    ) in r.stderr
