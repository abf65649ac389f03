"""The hand-over of deltas from the engine's thread to the event loop: one wake-up per
burst, every delta to its own queue, in order; a closed loop raises (the engine loop
logs it) without leaving the mailbox stuck."""

from __future__ import annotations

import asyncio
import threading

import pytest

from xspec.engine.engine import Delta, Generation
from xspec.serve.app import _mailbox


def delta(rid: int, token: int) -> Delta:
    return Delta(rid, [token], Generation([], [], 0.0, 0.0, 0))


def test_a_burst_of_deltas_is_one_wake_up_in_order() -> None:
    async def main() -> None:
        aio = asyncio.get_running_loop()
        box = _mailbox(aio)
        assert _mailbox(aio) is box  # one per event loop
        queues: list[asyncio.Queue[Delta]] = [asyncio.Queue(), asyncio.Queue()]
        wakeups = []
        deliver = box._deliver
        box._deliver = lambda: (wakeups.append(1), deliver())  # type: ignore[method-assign]

        def engine_step() -> None:  # the engine thread hands over one step's deltas
            for t in range(5):
                for rid, q in enumerate(queues):
                    box.post(q, delta(rid, t))

        worker = threading.Thread(target=engine_step)
        worker.start()
        worker.join()
        got = [[(await q.get()).token_ids[0] for _ in range(5)] for q in queues]
        assert got == [[0, 1, 2, 3, 4]] * 2
        assert len(wakeups) == 1

    asyncio.run(main())


def test_a_closed_event_loop_raises_and_does_not_stick() -> None:
    aio = asyncio.new_event_loop()
    box = _mailbox(aio)
    aio.close()
    q: asyncio.Queue[Delta] = asyncio.Queue()
    for _ in range(2):  # the second post tries again (it would be lost if the box stuck)
        with pytest.raises(RuntimeError, match="closed"):
            box.post(q, delta(0, 1))
