"""Load: 300 streamed requests at concurrency 64 through the real ``openai`` async client,
20% of them cancelled mid-stream by the client. Every other request completes with its
exact greedy output, the reservation pool returns to empty, and nothing is kept per
request: after each round every request and generation the engine was given is freed,
and from the first round to a second identical one the live instances of xspec's
classes, the tensor storage and the malloc'd bytes stay put.

Not the RSS: in a test worker that ran other tests first it moves by hundreds of MB with
the allocator alone (CI once read +13% between two rounds that kept nothing), while the
counts above do not move, or by some KB. Bounded: 300 requests of at most 12 tokens per
round, loopback only."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import random
import sys
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import xspec
from tests.serve.conftest import LiveServer, start_server

REQUESTS, CONCURRENCY, CANCEL_EVERY, MAX_TOKENS = 300, 64, 5, 12
FP32 = {"model.dtype": "float32"}


_MALLINFO2_FIELDS = ["arena", "ordblks", "smblks", "hblks", "hblkhd"]
_MALLINFO2_FIELDS += ["usmblks", "fsmblks", "uordblks", "fordblks", "keepcost"]


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2: ten size_t
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


def malloc_in_use() -> int | None:
    """Bytes malloc'd and not freed (glibc's ``mallinfo2``: in-use chunks plus mmapped
    ones), which fragmentation and memory held for reuse do not move; None without glibc."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return int(info.uordblks + info.hblkhd)


@dataclass(frozen=True)
class Heap:
    xspec_objects: Counter[str]  # live instances of xspec's classes, per class
    tensor_bytes: int  # distinct tensor storages the process's objects hold
    malloc: int | None

    @staticmethod
    def now() -> Heap:
        gc.collect()
        objects = gc.get_objects()
        xs: Counter[str] = Counter()
        storages = {}
        for o in objects:
            t = type(o)
            if str(t.__module__).startswith("xspec."):
                xs[t.__qualname__] += 1
            elif issubclass(t, torch.Tensor):
                s = o.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
        del objects  # the list would keep the next census's garbage alive
        return Heap(xs, sum(storages.values()), malloc_in_use())


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server("dsv4_tiny", "dspark", {**FP32, "server.concurrency": CONCURRENCY})
    yield server
    server.stop()


def prompts(live: LiveServer) -> list[list[int]]:
    rng = random.Random(0)
    vocab = live.llm._built.target.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))] for _ in range(12)]


async def one_round(live: LiveServer, ps: list[list[int]]) -> tuple[dict, set[int]]:
    """Every request's streamed text (None: cancelled) and the cancelled indices."""
    import openai

    client = openai.AsyncOpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    gate = asyncio.Semaphore(CONCURRENCY)
    texts: dict[int, str] = {}
    cancelled: set[int] = set()

    async def request(i: int) -> None:
        async with gate:
            stream = await client.completions.create(
                model=live.name, prompt=ps[i % len(ps)], max_tokens=MAX_TOKENS,
                temperature=0, stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            pieces: list[str] = []
            try:
                # __anext__ rather than ``async for``: no extra async generator is left
                # suspended (and finalized by the GC) when the client leaves mid-stream
                while True:
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        break
                    pieces.extend(c.text for c in chunk.choices)
                    if i % CANCEL_EVERY == 0 and len(pieces) >= 1:  # leave mid-stream
                        cancelled.add(i)
                        return
            finally:
                await stream.close()  # the HTTP response: the server sees the disconnect
            texts[i] = "".join(pieces)

    await asyncio.gather(*(request(i) for i in range(REQUESTS)))
    await client.close()
    return texts, cancelled


async def settle(live: LiveServer) -> None:
    for _ in range(400):
        if live.ctx.loop.in_flight == 0:
            return
        await asyncio.sleep(0.05)


# A client that leaves mid-stream leaves the openai/httpx client's inner async generators
# (Response.aiter_raw, ...) suspended; the GC finalizes them later, sometimes with "async
# generator already executing" inside the *client* library, reported as unraisable. That
# is not the server under test. The report is dropped here rather than left to pytest:
# pytest keeps each report's traceback until the test ends, and the GC that raised it may
# have run on the server's thread, whose frames (a handler and its request) the traceback
# then holds: requests seemingly leaked. Any other unraisable report goes on to pytest.
CLIENT_LIBRARIES = frozenset({"openai", "httpx", "httpx2", "httpcore"})  # their packages


@contextmanager
def client_finalizer_reports_dropped() -> Iterator[None]:
    """Within: the client library's "async generator already executing" reports are
    dropped; on leaving, a last collection finalizes what the rounds left, under the
    same rule."""
    previous = sys.unraisablehook

    def hook(report: Any) -> None:
        code = getattr(report.object, "ag_code", None)
        client = code is not None and not CLIENT_LIBRARIES.isdisjoint(Path(code.co_filename).parts)
        if (
            client
            and report.exc_type is ValueError
            and "already executing" in str(report.exc_value)
        ):
            return
        previous(report)

    sys.unraisablehook = hook
    try:
        yield
        gc.collect()
    finally:
        sys.unraisablehook = previous


def held(given: list[tuple[weakref.ref, weakref.ref]]) -> list[int]:
    """The indices of ``given`` whose request or generation is still alive."""
    gc.collect()
    return [i for i, (r, g) in enumerate(given) if r() is not None or g() is not None]


def test_load_with_cancellations(live: LiveServer) -> None:
    with client_finalizer_reports_dropped():
        load_rounds(live)


def load_rounds(live: LiveServer) -> None:
    ps = prompts(live)
    # the served engine belongs to its loop thread: the reference is a second engine
    # (spec=none: greedy speculative output equals it)
    ref = xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu", overrides=FP32)
    want = [g.text for g in ref.generate(ps, max_new_tokens=MAX_TOKENS, ignore_eos=True)]
    del ref
    engine = live.llm._built.engine
    given: list[tuple[weakref.ref, weakref.ref]] = []  # every request and generation added
    add = engine.add

    def spy(rid: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        gen = add(rid, req, *args, **kwargs)
        given.append((weakref.ref(req), weakref.ref(gen)))
        return gen

    engine.add = spy  # type: ignore[method-assign]
    try:
        heaps = [one_measured_round(live, ps, want, given) for _ in range(2)]
    finally:
        engine.add = add  # type: ignore[method-assign]
    first, second = heaps
    # the xspec objects the second round left beyond the first's (the server's and the
    # engine's, not the client library's nor what lazy imports add): none
    grown = second.xspec_objects - first.xspec_objects
    assert not grown, f"instances of xspec classes grew by {dict(grown)}"
    assert second.tensor_bytes <= first.tensor_bytes, (
        f"tensor storage grew from {first.tensor_bytes} to {second.tensor_bytes} bytes"
    )
    if first.malloc is not None and second.malloc is not None:
        # 1 MiB: 3.5 KiB kept natively per request, 17 KiB per cancelled one (measured:
        # 13-24 KiB a round, what the client library and lazy imports add)
        grew = second.malloc - first.malloc
        assert grew < 1 << 20, f"malloc'd bytes grew by {grew} from one round to the next"


def one_measured_round(live: LiveServer, ps: list[list[int]], want: list[str], given: list) -> Heap:
    """A round, checked; then the heap once every request the round added is freed."""
    given.clear()
    texts, cancelled = asyncio.run(one_round(live, ps))
    asyncio.run(settle(live))
    engine = live.llm._built.engine
    assert live.ctx.loop.in_flight == 0, f"{live.ctx.loop.in_flight} requests still open"
    assert engine.pool.reserved == 0, f"{engine.pool.reserved} bytes still reserved"
    assert not engine.busy
    assert len(given) == REQUESTS
    assert len(cancelled) == REQUESTS // CANCEL_EVERY, sorted(cancelled)
    assert set(texts) == set(range(REQUESTS)) - cancelled
    bad = [i for i, t in texts.items() if t != want[i % len(ps)]]
    assert not bad, f"{len(bad)} requests differ from their greedy output, e.g. {bad[:5]}"
    # one more request, so that the loop thread's locals (its last inbox and step) hold
    # that one rather than a varying share of the round's last step
    round_given = list(given)
    with live.openai() as client:
        client.completions.create(model=live.name, prompt=[5, 6], max_tokens=1)
    asyncio.run(settle(live))
    kept = held(round_given)
    assert not kept, f"{len(kept)} requests still held after they ended, e.g. {kept[:5]}"
    return Heap.now()
