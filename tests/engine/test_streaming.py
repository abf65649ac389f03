"""The streaming core: requests added while others decode, aborts that free memory at
once, deltas that add up to the generation; the threaded loop; LLM.generate(stream=True).

Greedy outputs do not depend on what shares the batch (fp32 CPU), so a request added
mid-run must produce exactly its batch-run tokens."""

from __future__ import annotations

import threading
import time

import pytest

import xspec
from xspec.engine.engine import Delta, Engine, Request
from xspec.engine.loop import EngineLoop, LoopStopped, QueueFull
from xspec.errors import RequestError
from xspec.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [7, 8, 9], [200, 3, 11, 12, 13, 14]]
FP32 = {"model.dtype": "float32"}


@pytest.fixture(scope="module", params=["none", "dspark"])
def llm(request: pytest.FixtureRequest) -> xspec.LLM:
    model = "qwen3_tiny" if request.param == "none" else "dsv4_tiny"
    return xspec.LLM(model=model, spec=request.param, platform="cpu", overrides=FP32)


def greedy(n: int) -> Request:
    return Request(PROMPTS[n], 10, SamplingParams(), ignore_eos=True)


def test_requests_added_mid_run_and_aborted_ones(llm: xspec.LLM) -> None:
    """Two requests run; a third arrives after two steps, a fourth is aborted while it
    runs and a fifth while it waits: the survivors equal their batch-run outputs, the
    deltas add up to each generation, and the pool is empty at the end."""
    engine: Engine = llm._built.engine
    want = [g.token_ids for g in engine.run([greedy(i) for i in range(4)], concurrency=4)]
    engine.reset_clock()
    engine.concurrency = 3
    seen: dict[object, list[int]] = {}
    finished: dict[object, Delta] = {}

    def take(deltas: list[Delta]) -> None:
        for d in deltas:
            seen.setdefault(d.rid, []).extend(d.token_ids)
            if d.finished:
                assert d.rid not in finished, "a request ended twice"
                finished[d.rid] = d

    engine.add("a", greedy(0))
    engine.add("b", greedy(1))
    take(engine.step())  # prefill a, b
    take(engine.step())
    engine.add("c", greedy(2))
    engine.add("d", greedy(3))  # admitted: concurrency 3 holds a, b, c... d waits
    with pytest.raises(RequestError, match="already in flight"):
        engine.add("a", greedy(0))
    take(engine.step())  # prefill c; d waits (no slot)
    assert engine.num_waiting == 1 and engine.num_running == 3
    assert engine.abort("d") and not engine.abort("d")
    take(engine.step())
    assert engine.abort("b")
    plan = engine.plan
    assert plan is not None  # the aborted request's hold was returned at once
    assert engine.pool.reserved == sum(plan.seq_bytes(len(PROMPTS[i]), 10) for i in (0, 2))
    take(list(engine.drain()))
    assert engine.pool.reserved == 0
    assert not engine.busy and not engine.pool.held
    assert finished["a"].generation.token_ids == want[0] == seen["a"]
    assert finished["c"].generation.token_ids == want[2] == seen["c"]
    assert finished["a"].generation.finish_reason == "length"
    assert finished["d"].generation.finish_reason == "abort" and seen["d"] == []
    aborted = finished["b"].generation
    assert aborted.finish_reason == "abort" and aborted.token_ids == want[1][: len(seen["b"])]
    assert len(aborted.token_ids) < 10
    engine.add("a", greedy(0))  # an ended id may be used again
    assert list(engine.drain())[-1].generation.token_ids == want[0]


def test_the_clock_splits_prefill_from_decode(llm: xspec.LLM) -> None:
    """``prefill_s`` / ``prefills`` count the iterations that prefilled (what
    benchmarks/bench_adaptive.py splits a run's time by): three requests at concurrency 2
    prefill twice (the first two, then the third), every other iteration is a decode
    step, and ``reset_clock`` starts them afresh."""
    engine: Engine = llm._built.engine
    engine.reset_clock()
    engine.concurrency = 2
    for i in range(3):
        engine.add(i, greedy(i))
    kinds = []
    while engine.busy:
        before = engine.prefills
        engine.step()
        kinds.append(engine.prefills - before)
    assert kinds[0] == 1 and sum(kinds) == engine.prefills == 2
    assert engine.iterations == len(kinds)
    assert 0.0 < engine.prefill_s < engine.step_s
    engine.reset_clock()
    assert engine.prefills == 0 and engine.prefill_s == 0.0 == engine.step_s


def test_max_prefill_tokens_splits_the_admission_and_keeps_the_outputs(llm: xspec.LLM) -> None:
    """``engine.max_prefill_tokens``: the four prompts (5, 40, 3, 6 tokens) at a budget of
    12 are prefilled in three iterations ([5], [40]: a prompt beyond the budget goes
    alone, [3, 6]), one after the other before the first decode step, and every output
    equals the run without a budget."""
    engine: Engine = llm._built.engine
    want = [g.token_ids for g in engine.run([greedy(i) for i in range(4)], concurrency=4)]
    engine.max_prefill_tokens = 12
    try:
        engine.reset_clock()
        engine.concurrency = 4
        for i in range(4):
            engine.add(i, greedy(i))
        admitted = []  # per iteration: the requests it prefilled (0: a decode step)
        for _ in range(4):
            before, running = engine.prefills, engine.num_running
            engine.step()
            admitted.append(engine.num_running - running if engine.prefills > before else 0)
        assert admitted == [1, 1, 2, 0]  # three prefills, then the batch decodes together
        got = {d.rid: d.generation.token_ids for d in engine.drain() if d.finished}
        assert engine.prefills == 3
        assert [got[i] for i in range(4)] == want
    finally:
        engine.max_prefill_tokens = None


def test_abort_returns_the_reservation_at_once() -> None:
    """With a memory plan each running request holds its worst case: an abort releases
    it before the next step, so a waiting request is admitted on that step."""
    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu", overrides=FP32)
    engine: Engine = llm._built.engine
    assert engine.plan is not None
    engine.reset_clock()
    engine.concurrency = 1
    engine.add(0, greedy(0))
    engine.add(1, greedy(1))
    engine.step()
    held = engine.pool.reserved
    assert held == engine.plan.seq_bytes(len(PROMPTS[0]), 10) > 0
    engine.abort(0)
    assert engine.pool.reserved == 0
    deltas = engine.step()  # reports the abort, admits and prefills request 1
    assert [d.rid for d in deltas] == [0, 1] and engine.num_running == 1
    list(engine.drain())
    assert engine.pool.reserved == 0


def test_stream_api_yields_the_generate_tokens(llm: xspec.LLM) -> None:
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3]]
    want = llm.generate(prompts, max_new_tokens=9, ignore_eos=True, concurrency=2)
    got: dict[int, list[int]] = {0: [], 1: [], 2: []}
    finals = {}
    for d in llm.generate(prompts, max_new_tokens=9, ignore_eos=True, concurrency=2, stream=True):
        got[int(d.rid)].extend(d.token_ids)  # type: ignore[call-overload]
        if d.finished:
            finals[d.rid] = d.generation
    assert [got[i] for i in range(3)] == [g.token_ids for g in want]
    assert [finals[i].text for i in range(3)] == [g.text for g in want]


def test_stream_api_left_early_leaves_nothing_in_flight(llm: xspec.LLM) -> None:
    stream = llm.generate([PROMPTS[0], PROMPTS[1]], max_new_tokens=20, stream=True)
    next(stream)
    stream.close()  # the caller stops listening
    engine = llm._built.engine
    assert not engine.busy and engine.pool.reserved == 0
    assert llm.generate([PROMPTS[0]], max_new_tokens=3)[0].error is None


def test_stream_api_checks_arguments_before_the_first_delta(llm: xspec.LLM) -> None:
    with pytest.raises(RequestError, match="max_new_tokens"):
        llm.generate([PROMPTS[0]], max_new_tokens=0, stream=True)
    with pytest.raises(RequestError, match="stream must be"):
        llm.generate([PROMPTS[0]], stream="yes")  # type: ignore[call-overload]


class Collector:
    """Deltas of one request, handed over from the loop thread."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.final: Delta | None = None
        self.done = threading.Event()

    def __call__(self, d: Delta) -> None:
        self.tokens.extend(d.token_ids)
        if d.finished:
            self.final = d
            self.done.set()


def test_engine_loop_serves_requests_from_other_threads(llm: xspec.LLM) -> None:
    engine: Engine = llm._built.engine
    want = [g.token_ids for g in engine.run([greedy(i) for i in range(4)], concurrency=4)]
    loop = EngineLoop(engine, concurrency=2, max_queue=1)
    with pytest.raises(LoopStopped):
        loop.submit(greedy(0), Collector())
    loop.start()
    try:
        cols = [Collector() for _ in range(3)]
        rids = [loop.submit(greedy(i), c) for i, c in enumerate(cols)]
        with pytest.raises(QueueFull, match="max_queue"):  # 2 running + 1 waiting
            loop.submit(greedy(3), Collector())
        with pytest.raises(RequestError, match="max_new_tokens"):
            loop.submit(Request(PROMPTS[0], 0, SamplingParams()), Collector())
        loop.abort(rids[2])
        assert all(c.done.wait(60) for c in cols)
        assert cols[0].tokens == want[0] == cols[0].final.generation.token_ids  # type: ignore[union-attr]
        assert cols[1].tokens == want[1]
        assert cols[2].final.generation.finish_reason == "abort"  # type: ignore[union-attr]
        late = Collector()
        loop.submit(greedy(3), late)  # the loop slept while idle, and wakes
        assert late.done.wait(60) and late.tokens == want[3]
        assert loop.in_flight == 0 and engine.pool.reserved == 0
    finally:
        loop.close()
    assert not loop.running
    with pytest.raises(LoopStopped):
        loop.submit(greedy(0), Collector())


def test_engine_loop_ends_open_requests_when_a_step_fails(llm: xspec.LLM) -> None:
    """A failure inside the loop (a dead peer, a bug) ends every open request with an
    error and marks the loop failed, instead of leaving the clients waiting."""
    engine: Engine = llm._built.engine
    loop = EngineLoop(engine, concurrency=2, max_queue=2)

    def broken() -> list[Delta]:
        raise RuntimeError("device lost")

    engine.step = broken  # type: ignore[method-assign]
    loop.start()
    try:
        col = Collector()
        loop.submit(greedy(0), col)
        assert col.done.wait(30)
        assert col.final is not None and col.final.generation.finish_reason == "error"
        assert "device lost" in (col.final.generation.error or "")
        assert loop.failure is not None and "device lost" in loop.failure
    finally:
        del engine.step  # the class's method again
        loop.close()
        engine.abort_all()
        list(engine.drain())


def test_engine_loop_runs_in_the_calling_thread(llm: xspec.LLM) -> None:
    """``run()`` steps on the caller's thread (the server's main thread) until another
    thread stops it; deltas reach the callbacks from that thread; it runs only once."""
    engine: Engine = llm._built.engine
    want = [g.token_ids for g in engine.run([greedy(i) for i in range(3)], concurrency=3)]
    loop = EngineLoop(engine, concurrency=2, max_queue=4)
    cols = [Collector() for _ in range(3)]
    threads: set[threading.Thread] = set()

    def client() -> None:
        while not loop.running:
            time.sleep(0.01)
        for i, c in enumerate(cols):
            loop.submit(greedy(i), lambda d, c=c: (threads.add(threading.current_thread()), c(d)))
        assert all(c.done.wait(60) for c in cols)
        loop.stop()

    t = threading.Thread(target=client)
    t.start()
    loop.run()
    t.join()
    assert [c.tokens for c in cols] == want
    assert threads == {threading.current_thread()}
    assert not loop.running and loop.failure is None and engine.pool.reserved == 0
    loop.join()  # ended: returns at once
    with pytest.raises(RuntimeError, match="already started"):
        loop.run()
