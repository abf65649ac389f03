"""Multi-process runs of the CLI on the CPU (gloo), against the single-process run.

``torchrun --standalone --nproc-per-node N -m xspec parallel.dp=D parallel.ep=E ...``:
greedy outputs must equal the single process's token for token, the acceptance counters
aggregated on rank 0 must equal its counters, each rank must hold 1/ep of the routed
expert bytes, and nothing may hang when a DP rank has no requests. Fault tests launch
the ranks directly with torchrun's environment (so no agent kills the survivors for us):
a killed or stopped rank makes the other exit with code 3 and a message within
``parallel.timeout_s``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BASE = [
    "model=dsv4_tiny_random",
    "platform=cpu",
    "workload.max_new_tokens=12",
    "workload.num_requests=4",
    "workload.concurrency=4",
    "workload.print_outputs=false",
    "workload.warmup_requests=1",
]
TIMEOUT_S = 10  # parallel.timeout_s of the fault tests
PEER_FAILURE_EXIT = 3


def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "XSPEC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1"}  # fmt: skip


def single(args: list[str], tmp: Path, cache: Path) -> dict[str, Any]:
    out = tmp / "single"
    r = subprocess.run(
        [sys.executable, "-m", "xspec", *BASE, *args, f"hydra.run.dir={out}"],
        env=_env(cache), cwd=tmp, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "results.json").read_text())


def torchrun(nproc: int, args: list[str], tmp: Path, cache: Path) -> dict[str, Any]:
    out = tmp / f"torchrun{nproc}"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={nproc}", "-m", "xspec", *BASE, *args,
         "parallel.timeout_s=60", f"hydra.run.dir={out}"],
        env=_env(cache), cwd=tmp, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert r.stdout.count("xspec: results in") == 1  # rank 0 alone reports
    return json.loads((out / "results.json").read_text())


def assert_same_run(par: dict[str, Any], ref: dict[str, Any]) -> None:
    """Token-for-token outputs and the same acceptance counters (summed over replicas)."""
    tokens = [r["output_token_ids"] for r in par["requests"]]
    assert tokens == [r["output_token_ids"] for r in ref["requests"]]
    a, b = dict(par["spec_decode"]), dict(ref["spec_decode"])
    for d in (a, b):
        d.pop("num_steps")  # batch steps: each replica steps its own batch
    calib_a, calib_b = a.pop("calibration"), b.pop("calibration")
    pred_a, pred_b = a.pop("predicted_acceptance_rate"), b.pop("predicted_acceptance_rate")
    assert a == b
    if pred_b is None:  # no confidence head
        assert pred_a is None
    else:
        assert pred_a == pytest.approx(pred_b, rel=1e-4)
    # the confidence head's mean prediction is a float of MoE outputs: experts see other
    # batch sizes under EP, so it agrees to float rounding (its realised rates exactly)
    assert [r for _, r in calib_a] == [r for _, r in calib_b]
    assert [p for p, _ in calib_a] == pytest.approx([p for p, _ in calib_b], rel=1e-4)


def assert_expert_share(par: dict[str, Any], ref: dict[str, Any]) -> None:
    p = par["parallel"]
    [whole] = ref["parallel"]["expert_bytes_per_rank"]
    assert p["expert_bytes_per_rank"] == [whole // p["ep"]] * p["world"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One preset cache for the module (the presets are generated once)."""
    return Path(os.environ["XSPEC_CACHE_DIR"])


def test_ep2_mtp_equals_single_process(tmp_path, cache):
    ref = single(["spec=mtp"], tmp_path, cache)
    par = torchrun(2, ["spec=mtp", "parallel.ep=2"], tmp_path, cache)
    assert_same_run(par, ref)
    assert_expert_share(par, ref)
    assert par["parallel"]["moe_exchange"] == "all_to_all"


def test_dp_rank_without_requests_while_another_decodes(tmp_path, cache):
    """One request, two DP replicas sharing the experts: rank 1 never has a request but
    must serve rank 0's MTP and target MoE layers every step until rank 0 is done."""
    args = ["spec=mtp", "workload.num_requests=1", "workload.warmup_requests=0"]
    ref = single(args, tmp_path, cache)
    par = torchrun(2, [*args, "parallel.dp=2", "parallel.ep=2"], tmp_path, cache)
    assert_same_run(par, ref)
    assert ref["spec_decode"]["num_draft_tokens"] > 0  # it really decoded speculatively


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["none", "mtp", "dspark"])
@pytest.mark.parametrize(
    ("nproc", "layout"),
    [
        (2, ["parallel.ep=2"]),
        (2, ["parallel.dp=2", "parallel.ep=2", "parallel.moe_exchange=all_gather"]),
        (4, ["parallel.dp=2", "parallel.ep=2"]),
        (4, ["parallel.dp=4", "parallel.ep=4", "workload.num_requests=3"]),
    ],
)
def test_parallel_layouts_equal_single_process(tmp_path, cache, spec, nproc, layout):
    requests = [a for a in layout if a.startswith("workload.")]
    ref = single([f"spec={spec}", *requests], tmp_path, cache)
    par = torchrun(nproc, [f"spec={spec}", *layout], tmp_path, cache)
    assert_same_run(par, ref)
    assert_expert_share(par, ref)


# -- faults ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Path, cache: Path, world: int = 2) -> list[tuple[subprocess.Popen, Path]]:
    """The ranks of a long EP run, started with torchrun's environment; rank r's output in
    ``tmp/rank{r}.log``."""
    port = _free_port()
    procs = []
    for rank in range(world):
        log = tmp / f"rank{rank}.log"
        env = _env(cache) | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                             "WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}  # fmt: skip
        args = [*BASE, "spec=mtp", "workload.max_new_tokens=2000", "parallel.ep=2",
                f"parallel.timeout_s={TIMEOUT_S}", f"hydra.run.dir={tmp / 'run'}"]  # fmt: skip
        with open(log, "w") as f:
            cmd = [sys.executable, "-m", "xspec", *args]
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=f, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    return procs


def _wait_for(log: Path, text: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < end, f"{text!r} not in {log}:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


@pytest.mark.parametrize(
    ("sig", "expected"),
    [  # gloo's words; the hung case waits out parallel.timeout_s (-m slow)
        (signal.SIGKILL, "by peer"),
        pytest.param(signal.SIGSTOP, "Timed out", marks=pytest.mark.slow),
    ],
    ids=["killed", "hung"],
)
def test_a_dead_or_hung_rank_ends_the_run_with_a_message(tmp_path, cache, sig, expected):
    (rank0, log0), (rank1, _) = procs = _launch(tmp_path, cache)
    try:
        # built: the run starts decoding (a wait, not a bound: on a loaded 2-core CI
        # machine, with the presets still being generated, 120 s once ran out)
        _wait_for(log0, "memory plan", timeout=600)
        time.sleep(3)
        assert rank0.poll() is None, log0.read_text()[-3000:]
        rank1.send_signal(sig)
        t0 = time.monotonic()
        code = rank0.wait(timeout=TIMEOUT_S + 30)
        waited = time.monotonic() - t0
    finally:
        for p, _ in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait()
    text = log0.read_text()
    assert code == PEER_FAILURE_EXIT, text[-3000:]
    assert "xspec: error: rank 0 of 2:" in text and expected in text, text[-3000:]
    assert f"parallel.timeout_s={TIMEOUT_S}s" in text
    assert waited < TIMEOUT_S + 5, f"rank 0 took {waited:.1f}s to give up"
    assert "Traceback" not in text
