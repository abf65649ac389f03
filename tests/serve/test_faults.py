"""One request cannot stall or kill the server: stop strings past their limits get a 400
naming ``stop`` at once, and a request whose engine step raises fails alone. In each
case a normal streamed request in flight beside the bad one completes with its exact
text within twice its solo time, measured in this run just before and just after (the
slower of the two: other processes on a 2-core machine move a solo run by 2x)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.serve.conftest import LiveServer, start_server
from xspec.engine.engine import CANARY_PROMPT, Delta, Generation, Request
from xspec.engine.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS
from xspec.sampling import SamplingParams

NORMAL = [5, 17, 42, 99, 3]
N = 48


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server("dsv4_tiny_random", "none", {"server.concurrency": 4})
    yield server
    server.stop()


class Streamed(threading.Thread):
    """The normal request, streamed through the openai client: its text, finish reason
    and seconds; ``first`` is set at its first chunk."""

    def __init__(self, live: LiveServer) -> None:
        super().__init__(daemon=True)
        self.live, self.first = live, threading.Event()
        self.text, self.finish, self.seconds = "", None, 0.0

    def run(self) -> None:
        t0 = time.perf_counter()
        client = self.live.openai(timeout=120)
        for chunk in client.completions.create(
            model=self.live.name, prompt=NORMAL, max_tokens=N, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        ):  # fmt: skip
            self.first.set()
            if chunk.choices:
                self.text += chunk.choices[0].text
                self.finish = chunk.choices[0].finish_reason or self.finish
        self.seconds = time.perf_counter() - t0
        client.close()

    def alone(self) -> Streamed:
        self.start()
        self.join(120)
        return self


def solo_seconds(live: LiveServer, before: Streamed) -> float:
    """The slower of the solo run ``before`` and one more now."""
    return max(before.seconds, Streamed(live).alone().seconds)


def through_loop(live: LiveServer, ids: list[int]) -> Generation:
    """The greedy generation of ``ids`` (the served engine: through its loop)."""
    done, box = threading.Event(), []

    def take(d: Delta) -> None:
        if d.finished:
            box.append(d.generation)
            done.set()

    live.ctx.loop.submit(Request(ids, N, SamplingParams(), ignore_eos=True), take)
    assert done.wait(120)
    return box[0]


def post(live: LiveServer, **fields: object) -> httpx.Response:
    body = {"model": live.name, "temperature": 0, "ignore_eos": True, **fields}
    return httpx.post(live.url + "/v1/completions", json=body, timeout=120)


def test_stop_strings_are_bounded_and_stall_nobody(live: LiveServer) -> None:
    """Too many or too long stop strings: 400 naming ``stop``, before the engine sees
    them (400,000 of them were taken and checked on every token: the engine stalled).
    A request at both limits runs beside the normal one and stops at its stop string."""
    solo = Streamed(live).alone()
    assert solo.finish == "length"
    full = solo.text
    at = next(k for k in range(3, len(full) - 2) if "\ufffd" not in full[k : k + 2])
    stop = full[at : at + 2]
    beside = Streamed(live)
    beside.start()
    assert beside.first.wait(60)
    assert "zq" not in full
    many = post(live, prompt=NORMAL, max_tokens=200, stop=["zq"] * 400_000)
    long = post(live, prompt=NORMAL, max_tokens=8, stop=["z" * (MAX_STOP_CHARS + 1)])
    filler = [chr(0x4E00 + i) * MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS - 1)]
    limits = post(live, prompt=NORMAL, max_tokens=N, stop=[*filler, stop])
    beside.join(120)
    for r, words in ((many, "400000 stop strings; at most"), (long, "characters each")):
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("stop: ") and words in r.text
    assert limits.status_code == 200, limits.text
    choice = limits.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(stop)]
    assert beside.text == full and beside.finish == "length"
    solo_s = solo_seconds(live, solo)
    assert beside.seconds < 2 * solo_s, (beside.seconds, solo_s)


def test_a_step_that_raises_fails_its_request_alone(live: LiveServer) -> None:
    """A prompt holding a token that layer 0's hash-routing table sends to expert 1000
    (of 8; planted in the loaded table, as a checkpoint did before tables were
    range-checked at load): its step raises, it gets a 500 (streamed: an error event,
    then ``[DONE]``), the normal request beside it is unaffected, and the server goes on
    (``/health`` 200, later requests served)."""
    table = live.llm._built.target.layers[0].ffn.gate.tid2eid
    normal_ids = set(NORMAL) | set(through_loop(live, NORMAL).token_ids) | set(CANARY_PROMPT)
    bad = next(t for t in range(10, 500) if t not in normal_ids)
    solo = Streamed(live).alone()
    saved = table.clone()
    table[bad, 0] = 1000
    try:
        beside = Streamed(live)
        beside.start()
        assert beside.first.wait(60)
        plain = post(live, prompt=[7, bad, 9], max_tokens=8)
        body = {"model": live.name, "prompt": [bad], "max_tokens": 8, "stream": True}
        with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=60) as r:
            events = [line for line in r.iter_lines() if line]
        beside.join(120)
        after = post(live, prompt=[11, 12, 13], max_tokens=4)
    finally:
        table.copy_(saved)
    assert plain.status_code == 500, plain.text
    assert "engine step it was in raised RuntimeError" in plain.json()["error"]["message"]
    assert '"code":500' in events[0] and events[-1] == "data: [DONE]", events
    assert beside.text == solo.text and beside.finish == "length"
    solo_s = solo_seconds(live, solo)
    assert beside.seconds < 2 * solo_s, (beside.seconds, solo_s)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(live.url + "/health").status_code == 200
    assert live.ctx.loop.in_flight == 0 and live.llm._built.engine.pool.reserved == 0
