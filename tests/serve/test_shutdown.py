"""``python -m xspec.serve`` keeps its shutdown grace whatever the engine is doing: a
SIGTERM that comes while the engine is inside a long step (a prompt of 2000 tokens:
one prefill) still ends every open request when ``server.shutdown_grace_s`` runs out,
each stream with its last chunk and ``[DONE]``, and the process exits 0, without a
traceback, once that step has returned.

The step's length is measured in this run (the same prompt alone); the bounds are
fractions of it, not wall-clock limits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai

ROOT = Path(__file__).resolve().parents[2]
MODEL = "dsv4_tiny_random"
GRACE = 0.2
LONG = [10 + i % 240 for i in range(2000)]  # one prefill step: 1-2 s on one CPU thread
# as long, with no block in common with LONG (the prefix cache would serve LONG again)
OTHER_LONG = [11 + i % 240 for i in range(2000)]


def url_of(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("xspec.serve:"):
            return line.rsplit(" at ", 1)[1].strip()
    raise AssertionError(f"the server did not start (exit {proc.wait()})")


def test_sigterm_during_a_long_step_keeps_the_grace() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "xspec.serve", f"model={MODEL}", "spec=none", "platform=cpu",
         "server.port=0", f"server.shutdown_grace_s={GRACE}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # as the tests' torch: no oversubscription
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=url_of(proc), api_key="none", max_retries=0, timeout=120)
        t0 = time.monotonic()
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=1)
        step_s = time.monotonic() - t0  # the long prefill step (and its HTTP)
        stream = client.completions.create(
            model=MODEL, prompt=[5, 17, 42], max_tokens=3000, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        assert next(chunks).choices
        long: list[openai.types.Completion] = []
        other = threading.Thread(
            target=lambda: long.append(
                client.completions.create(model=MODEL, prompt=OTHER_LONG, max_tokens=1)
            )
        )
        other.start()
        time.sleep(0.2 * step_s)  # its prefill is under way: the stream waits for it
        t_signal = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        last = list(chunks)[-1]  # raises if the connection is cut
        ended_s = time.monotonic() - t_signal
        assert proc.wait(60) == 0
        exit_s = time.monotonic() - t_signal
        other.join(60)
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert last.choices[0].finish_reason == "abort"
    assert long and long[0].choices[0].finish_reason == "abort"
    # the grace, not the rest of the step (0.8 of it), ends the requests
    assert ended_s < GRACE + 0.4 * step_s, (ended_s, step_s)
    # grace + the rest of the step, + the interpreter's exit (1-2 s of it under load)
    assert exit_s < GRACE + 3 * step_s, (exit_s, step_s)
    assert proc.stdout is not None
    with proc.stdout:
        rest = proc.stdout.read()
    assert "Traceback" not in rest and "ERROR" not in rest, rest
