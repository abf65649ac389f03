"""The engine's step loop in a thread of its own, for requests that arrive at any time.

:class:`EngineLoop` owns an :class:`~xspec.engine.engine.Engine`: other threads (the HTTP
server's) :meth:`~EngineLoop.submit` requests with a callback and :meth:`~EngineLoop.abort`
them; the loop thread applies both between two steps, runs :meth:`Engine.step` while
there is work, hands each :class:`~xspec.engine.engine.Delta` to its request's callback
(from the loop thread: the callback must only hand it over, e.g.
``loop.call_soon_threadsafe``), and sleeps when idle. Memory is returned at once on finish
or abort (the engine's reservation pool), so a stream of requests can run forever.

**Which thread.** :meth:`EngineLoop.run` runs the loop in the calling thread and is what
``python -m xspec.serve`` uses: the engine steps on the main thread, which did the
process's torch work so far, and the HTTP server lives in a thread of its own. On the CPU
this matters: torch's OpenMP runtime keeps a worker pool per thread that ran a parallel
region, and while the main thread's pool is alive, a *second* thread's parallel regions
ran 2.2x slower here (dsv4_tiny, dspark, concurrency 32: 174 vs 380 tok/s). :meth:`start`
(a daemon thread) is for callers that cannot give up their thread, such as tests.

Backpressure: at most ``concurrency`` requests run; at most ``max_queue`` more wait;
beyond that :meth:`submit` raises :class:`QueueFull` (the server answers 503).

**Faults.** A step that raises fails its own requests and the loop goes on
(:meth:`Engine.step <xspec.engine.engine.Engine.step>`). When the engine itself is
unusable (a fresh four-token generation fails too:
:class:`~xspec.engine.engine.EngineUnusable`), or anything else in the loop raises, the
loop stops: every open request ends with an error and :attr:`EngineLoop.failure` says why
(the server's ``/health`` answers 503, and ``python -m xspec.serve`` exits 1).

**Data x expert parallel** (torchrun): every rank runs the same loop; rank 0 (the one with
the HTTP server) collects each iteration's new and aborted requests and broadcasts them
(:class:`Inbox`) to all ranks, which apply them in the same order, so the EP groups stay in
lockstep exactly as in a batch run. Request ``rid`` runs on DP replica ``rid % dp``; each
replica's first rank sends its deltas to rank 0 after every step. An idle rank 0 still
broadcasts an empty inbox every ``idle_tick_s`` (well below ``parallel.timeout_s``), so an
idle server never trips the collectives' timeout, and a dead rank surfaces within that
timeout as :class:`~xspec.parallel.runtime.PeerFailure`: the loop stops, every open request
ends with an error, and :attr:`EngineLoop.failure` says why (the server answers 503 and
exits non-zero).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Literal

from xspec.engine.engine import Delta, Engine, FinishReason, Generation, Request
from xspec.errors import RequestError
from xspec.parallel.runtime import SINGLE, Parallel

log = logging.getLogger(__name__)

OnDelta = Callable[[Delta], object]  # its result is ignored


class QueueFull(Exception):
    """The waiting queue is full: try again later (HTTP 503 with Retry-After)."""


class LoopStopped(Exception):
    """The loop is not running (not started, closed, or failed: see ``failure``)."""


@dataclass
class Inbox:
    """What rank 0 hands every rank before one iteration."""

    adds: list[tuple[int, Request, Hashable | None]] = field(default_factory=list)
    aborts: list[int] = field(default_factory=list)
    stop: bool = False


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        *,
        concurrency: int,
        max_queue: int,
        parallel: Parallel = SINGLE,
        idle_tick_s: float = 1.0,
    ) -> None:
        if concurrency < 1 or max_queue < 0:
            raise ValueError(
                f"concurrency >= 1 and max_queue >= 0 (got {concurrency}, {max_queue})"
            )
        self.engine = engine
        self.parallel = parallel
        self.concurrency, self.max_queue = concurrency, max_queue
        self.idle_tick_s = idle_tick_s
        topo = parallel.topology
        engine.concurrency = topo.concurrency_of_replica(concurrency)
        self.failure: str | None = None  # why the loop stopped by itself
        self._ids = itertools.count()
        self._groups = itertools.count()
        self._cond = threading.Condition()
        self._inbox = Inbox()
        self._callbacks: dict[int, OnDelta] = {}  # rank 0: requests not yet ended
        self._state: Literal["new", "running", "stopped"] = "new"
        self._done = threading.Event()  # set when the loop has ended
        self._loop_thread: threading.Thread | None = None  # the thread that runs it

    # ---- rank 0: the server's side --------------------------------------------------------

    def start(self) -> None:
        """Run the loop in a daemon thread (rank 0; the other ranks call :meth:`follow`).
        Prefer :meth:`run` on the main thread where the caller can give it up (see the
        module's "Which thread")."""
        self._begin()
        thread = threading.Thread(target=self._run, name="xspec-engine", daemon=True)
        self._loop_thread = thread
        thread.start()

    def run(self) -> None:
        """Run the loop in the calling thread until :meth:`stop` / :meth:`close` or a
        failure (then :attr:`failure` says why). Rank 0's; the other ranks call
        :meth:`follow`."""
        self._begin()
        self._loop_thread = threading.current_thread()
        self._run()

    def _begin(self) -> None:
        if not self.parallel.topology.is_main:
            raise RuntimeError("EngineLoop.start/run is rank 0's; the other ranks call follow()")
        with self._cond:
            if self._state != "new":
                raise RuntimeError(f"this engine loop was already started ({self._state})")
            self._state = "running"  # requests submitted from now on wait in the inbox
        self.engine.reset_clock()

    @property
    def running(self) -> bool:
        return self._state == "running"

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet ended (running, waiting, or not yet taken in)."""
        with self._cond:
            return len(self._callbacks)

    def submit(self, req: Request, on_delta: OnDelta, group: Hashable | None = None) -> int:
        """Queue ``req``; its deltas go to ``on_delta`` (from the loop thread). Returns
        its id. ``group``: the choices of one prompt share a key (``Engine.add``: one
        prefill; a key the loop's callers never reuse, e.g. from :meth:`new_group`). Raises :class:`~xspec.errors.RequestError` for a malformed request or one
        that can never fit, :class:`QueueFull` when the queue is full and
        :class:`LoopStopped` when the loop does not run."""
        self.engine.check(req, "request")
        if (problem := self.engine.capacity_problem(req)) is not None:
            raise RequestError(f"request: {problem}")
        with self._cond:
            if not self.running:
                raise LoopStopped(self.failure or "the engine loop is not running")
            if len(self._callbacks) >= self.concurrency + self.max_queue:
                raise QueueFull(
                    f"{self.concurrency} requests running and {self.max_queue} waiting "
                    "(server.max_queue); retry later"
                )
            rid = next(self._ids)
            self._callbacks[rid] = on_delta
            self._inbox.adds.append((rid, req, group))
            self._cond.notify()
        return rid

    def new_group(self) -> int:
        """A fresh ``group`` key for :meth:`submit` (the choices of one prompt)."""
        return next(self._groups)

    def abort(self, rid: int) -> None:
        """End ``rid`` at the next iteration (no-op when it already ended)."""
        with self._cond:
            if rid in self._callbacks:
                self._inbox.aborts.append(rid)
                self._cond.notify()

    def join(self, timeout: float | None = None) -> None:
        """Wait until the loop has ended (stopped or failed); at once if never started."""
        if self._state != "new":
            self._done.wait(timeout)

    def stop(self, *, end_open: bool = False) -> None:
        """Ask the loop to stop at its next iteration (every rank leaves at the same
        one; open requests end as aborted). Does not wait: safe from a signal handler
        on the loop's own thread. ``end_open``: end the open requests now, without
        waiting for a step in progress (their callbacks run on the calling thread, so
        not from such a signal handler); that step's results are then dropped."""
        with self._cond:
            self._inbox.stop = True
            self._cond.notify()
        if end_open and self.parallel.topology.is_main:
            self._end_open("abort", "the server is shutting down")

    def close(self, timeout: float = 30.0) -> None:
        """:meth:`stop`, then wait (up to ``timeout``) until the loop has ended."""
        self.stop()
        if threading.current_thread() is not self._loop_thread:
            self.join(timeout)

    # ---- every rank -------------------------------------------------------------------

    def follow(self) -> None:
        """The loop of a rank other than 0 under torchrun: until rank 0 stops it."""
        self._loop()

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as e:  # a dead peer, a bug: nobody must wait forever
            self.failure = f"{type(e).__name__}: {e}"
            log.error("the engine loop stopped: %s", self.failure)
            self._end_open("error", self.failure)
            self.engine.discard()  # nothing steps it any more: it holds no request
        except BaseException:  # KeyboardInterrupt / SystemExit in run(): end, re-raise
            self._end_open("abort", "the server is shutting down")
            raise
        finally:
            with self._cond:
                self._state = "stopped"
            self._done.set()

    def _loop(self) -> None:
        engine, topo = self.engine, self.parallel.topology
        while True:
            inbox = self._next_inbox() if topo.is_main else None
            if self.parallel.distributed:
                inbox = self.parallel.broadcast(inbox)
            assert inbox is not None
            for rid, req, group in inbox.adds:
                if rid % topo.dp == topo.replica:
                    engine.add(rid, req, group=group)
            for rid in inbox.aborts:
                if rid % topo.dp == topo.replica:
                    engine.abort(rid)
            if inbox.stop:  # every rank at the same iteration
                engine.abort_all()
                if topo.is_main:
                    self._end_open("abort", "the server is shutting down")
                return
            deltas = engine.step() if self._has_work() else []
            if topo.dp > 1:
                ship = topo.replica_leader and not topo.is_main
                gathered = self.parallel.gather(deltas if ship else None)
                if gathered is not None:
                    deltas = deltas + [d for part in gathered if part for d in part]
            if topo.is_main:
                self._dispatch(deltas)

    def _has_work(self) -> bool:
        """Whether to step this iteration: always under lockstep (every rank must take
        part in the agreement), else when the engine has work."""
        return self.engine.lockstep is not None or self.engine.busy

    def _next_inbox(self) -> Inbox:
        """Rank 0: this iteration's adds and aborts; blocks while there is nothing to do
        (at most ``idle_tick_s`` when other ranks wait on the broadcast)."""
        with self._cond:
            while not self._inbox.adds and not self._inbox.aborts and not self._inbox.stop:
                if self._callbacks:  # requests in flight: step them
                    break
                self._cond.wait(self.idle_tick_s if self.parallel.distributed else None)
                if self.parallel.distributed:
                    break  # an empty inbox keeps the other ranks' collectives alive
            inbox, self._inbox = self._inbox, Inbox()
            return inbox

    def _dispatch(self, deltas: list[Delta]) -> None:
        for d in deltas:
            rid = int(d.rid)  # type: ignore[call-overload]
            with self._cond:
                callback = self._callbacks.get(rid)
                if d.finished:
                    self._callbacks.pop(rid, None)
            if callback is not None:
                try:
                    callback(d)
                except Exception:  # a consumer's bug must not stop the engine
                    log.exception("request %s: its delta callback raised", rid)

    def _end_open(self, reason: FinishReason, why: str) -> None:
        """End every open request (the loop is gone): ``abort`` or ``error``."""
        with self._cond:
            open_ = list(self._callbacks.items())
            self._callbacks.clear()
        for rid, callback in open_:
            gen = Generation([], [], 0.0, 0.0, 0, finish_reason=reason)
            if reason == "error":
                gen.error = f"request {rid}: {why}"
            try:
                callback(Delta(rid, [], gen))
            except Exception:
                log.exception("request %s: its delta callback raised", rid)
