"""The server under torchrun's environment (2 ranks, gloo): rank 0 serves HTTP and hands
each iteration's requests to both ranks. Greedy outputs equal the single-process
server's for ``parallel.ep=2`` (lockstep EP) and ``parallel.dp=2`` (requests spread over
replicas, deltas gathered to rank 0); a killed rank makes rank 0 answer 503 and exit
with code 3 within ``parallel.timeout_s``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.serve.conftest import LiveServer, start_server

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model=dsv4_tiny_random", "spec=mtp", "platform=cpu"]
PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 90)), [7, 8, 9], [200, 3, 11, 12, 13, 14]]
N = 10
TIMEOUT_S = 10
PEER_FAILURE_EXIT = 3


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, layout: list[str]) -> tuple[list[subprocess.Popen], Path, str]:
    """Two ranks of ``python -m xspec.serve`` with torchrun's environment."""
    master, http = _free_port(), _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master), "WORLD_SIZE": "2",
               "RANK": str(rank), "LOCAL_RANK": str(rank)}  # fmt: skip
        log = tmp / f"rank{rank}.log"
        args = [*MODEL, *layout, f"parallel.timeout_s={TIMEOUT_S}", f"server.port={http}"]
        with open(log, "w") as f:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "xspec.serve", *args],
                    env=env,
                    cwd=tmp,
                    stdout=f,
                    stderr=subprocess.STDOUT,
                )
            )
    url = f"http://127.0.0.1:{http}"
    log0 = tmp / "rank0.log"
    end = time.monotonic() + 240
    while "xspec.serve:" not in log0.read_text():
        if time.monotonic() > end or any(p.poll() is not None for p in procs):
            stop(procs)
            raise AssertionError(log0.read_text()[-3000:] + (tmp / "rank1.log").read_text()[-2000:])
        time.sleep(0.2)
    return procs, log0, url


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def outputs(url: str, model: str) -> list[tuple[str, int]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    out = []
    for p in PROMPTS:
        r = client.completions.create(
            model=model, prompt=p, max_tokens=N, temperature=0, extra_body={"ignore_eos": True}
        )
        out.append((r.choices[0].text, r.usage.completion_tokens))
    return out


@pytest.fixture(scope="module")
def reference() -> Iterator[list[tuple[str, int]]]:
    live: LiveServer = start_server("dsv4_tiny_random", "mtp")
    try:
        yield outputs(live.url, live.name)
    finally:
        live.stop()


@pytest.mark.parametrize(
    "layout",
    [["parallel.ep=2"], pytest.param(["parallel.dp=2"], marks=pytest.mark.slow)],
    ids=["ep2", "dp2"],
)
def test_parallel_server_equals_single_process(tmp_path, reference, layout) -> None:
    procs, log0, url = launch(tmp_path, layout)
    try:
        assert outputs(url, "dsv4_tiny_random") == reference
        # requests in flight together (a mixed batch on both ranks)
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            both = list(pool.map(lambda _: outputs(url, "dsv4_tiny_random"), range(2)))
        assert both == [reference, reference]
        procs[0].send_signal(signal.SIGINT)  # Ctrl-C: rank 0 stops every rank's loop
        assert procs[0].wait(60) == 0, log0.read_text()[-3000:]
        assert procs[1].wait(60) == 0, (tmp_path / "rank1.log").read_text()[-3000:]
    finally:
        stop(procs)


def test_a_dead_rank_makes_the_server_answer_503_and_exit(tmp_path) -> None:
    procs, log0, url = launch(tmp_path, ["parallel.ep=2"])
    try:
        procs[1].kill()
        t0 = time.monotonic()
        code = procs[0].wait(timeout=TIMEOUT_S + 30)
        waited = time.monotonic() - t0
    finally:
        stop(procs)
    text = log0.read_text()
    assert code == PEER_FAILURE_EXIT, text[-3000:]
    assert waited < TIMEOUT_S + 10 and "rank 0 of 2" in text, text[-3000:]
    with pytest.raises(httpx.ConnectError):  # it no longer listens
        httpx.get(url + "/health", timeout=2)
