"""Requests in, generations out: admission, continuous batching, stop conditions, timing.

The engine owns no model math. It checks each request (a malformed one raises for the
whole call), rejects alone a request that can never fit (its length beyond the model
context or the memory plan: ``Generation.error``), and admits the others in order while
``concurrency`` and the memory pool allow: each admission reserves the request's worst
case (:mod:`xspec.engine.memory`), each completion frees it, and waiting requests are
admitted between two decode steps as others finish. It runs
:func:`xspec.spec.step.prefill` / ``decode_step`` and ends a request at a stop id, at
a stop string, or at ``max_new_tokens``, whichever comes first; nothing after it is kept.
Every request arrives at the start of the run; its TTFT and latency count from its
admission, the wait before it is its queue time (:class:`Generation`).

Under expert parallelism (``lockstep``) each iteration first agrees its shape with the
other ranks and tops up with idle forwards; a rank without work keeps iterating until no
rank has any (:mod:`xspec.parallel.lockstep`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xspec.engine.memory import MemoryPlan, ReservationPool, allocated_bytes, context_problem
from xspec.errors import RequestError
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import CapturePoint, TargetModel
from xspec.sampling import SamplingParams, make_generator
from xspec.spec.adaptive import Speculation
from xspec.spec.drafter import Drafter
from xspec.spec.step import RunningSeq, decode_step, prefill, prefill_forwards, step_gamma

if TYPE_CHECKING:
    from xspec.parallel.lockstep import Lockstep

# tokens decoded beyond the longest stop string when checking for one (covers tokens that
# decode to nothing and a tokenizer's special handling of the first token of a slice)
STOP_WINDOW_SLACK = 8


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    ignore_eos: bool = False
    # the output ends at the first of these strings (the string itself not kept in
    # ``text``; the token that completed it is the last of ``token_ids``)
    stop: list[str] = field(default_factory=list)


@dataclass
class Generation:
    """One request's result. The ``*_at`` times are seconds from the start of
    ``Engine.run``, when every request arrives. Latencies count from admission, as
    ``vllm bench serve --max-concurrency`` does; the wait before it is ``queue_s``
    (docs/metrics.md)."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    first_token_at: float  # its first token committed (after its prefill)
    finished_at: float  # its last token committed, or the step that failed it
    num_steps: int  # decode steps this request took part in
    text: str = ""
    error: str | None = None  # why the request stopped early (e.g. NaN logits); None = fine
    # taken into the running batch: a concurrency slot and its memory reservation
    admitted_at: float = 0.0

    @property
    def queue_s(self) -> float:
        """Time waiting for admission (from arrival, the start of the run)."""
        return self.admitted_at

    @property
    def ttft_s(self) -> float:
        """Time to first token, from admission (the queue wait excluded)."""
        return self.first_token_at - self.admitted_at

    @property
    def latency_s(self) -> float:
        """End-to-end latency: admission to the last token."""
        return self.finished_at - self.admitted_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token generation (it
        has no such token: serving benchmarks leave it out of TPOT rather than count 0)."""
        n = len(self.token_ids) - 1
        return (self.finished_at - self.first_token_at) / n if n > 0 else None


class Engine:
    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        capture: list[CapturePoint],
        *,
        stop_ids: frozenset[int],
        synchronize: Callable[[], None] = lambda: None,
        prefill_chunk: int = 2048,
        plan: MemoryPlan | None = None,  # None: no memory limit (only model.max_context)
        decode: Callable[[list[int]], str] | None = None,  # the tokenizer's, for stop strings
        measure_memory: bool = False,  # record the peak of allocated state bytes (tests)
        # spec.adaptive: drafts each request verifies, from the proposal's confidences
        schedule: Callable[[Any, list[int]], list[int]] | None = None,
        lockstep: Lockstep | None = None,  # expert parallelism: iterations agreed across ranks
        # a calibration file's sampling regime against each request's (warns on a mismatch)
        check_sampling: Callable[[list[SamplingParams]], None] | None = None,
        # spec.adaptive / spec.gamma_schedule: drafts per request, decided before drafting
        speculation: Speculation | None = None,
    ) -> None:
        self.schedule = schedule
        self.speculation = speculation
        self.check_sampling = check_sampling
        self.target, self.drafter, self.capture = target, drafter, capture
        self.stop_ids = frozenset(stop_ids)  # a request ends at any of these (unless ignore_eos)
        self.synchronize = synchronize
        self.prefill_chunk = prefill_chunk
        self.plan = plan
        self.decode = decode
        self.measure_memory = measure_memory
        self.lockstep = lockstep
        self.metrics = SpecDecodeMetrics()
        self.pool = self._new_pool()
        self.peak_allocated = 0  # bytes, with measure_memory: max over steps of the states' sum
        self.step_s = 0.0  # last run: seconds inside prefill / decode_step
        self.run_s = 0.0  # last run: seconds of the whole run
        self.iterations = 0  # last run: prefill + decode_step calls

    def check(self, req: Request, where: str) -> None:
        """A clear error for a malformed request (raised: the caller's input is wrong)."""
        n, vocab = len(req.prompt_ids), self.target.vocab_size
        if n == 0:
            raise RequestError(f"{where}: empty prompt; give at least one token")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{where}: token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if req.max_new_tokens < 1:
            raise RequestError(f"{where}: max_new_tokens must be >= 1 (got {req.max_new_tokens})")
        if not isinstance(req.stop, list) or not all(isinstance(x, str) and x for x in req.stop):
            raise RequestError(
                f"{where}: stop must be a list of non-empty strings (got {req.stop!r})"
            )
        if req.stop and self.decode is None:
            raise RequestError(f"{where}: stop strings need a tokenizer; this engine has none")
        if problems := req.params.problems():
            raise RequestError(f"{where}: " + "; ".join(problems))

    def capacity_problem(self, req: Request) -> str | None:
        """Why a well-formed request can never run here (None: it fits an empty pool)."""
        n, gamma = len(req.prompt_ids), self.drafter.gamma
        if self.plan is not None:
            return self.plan.problem(n, req.max_new_tokens)
        return context_problem(n, req.max_new_tokens, gamma, self.target.max_context)

    def run(self, requests: Sequence[Request], concurrency: int) -> list[Generation]:
        for i, r in enumerate(requests):
            self.check(r, f"request {i}")
        self.pool, self.peak_allocated, self.step_s = self._new_pool(), 0, 0.0
        self.iterations = 0
        out: dict[int, Generation] = {}
        waiting: deque[int] = deque()
        for i, r in enumerate(requests):
            if (problem := self.capacity_problem(r)) is not None:  # rejected alone
                out[i] = Generation(r.prompt_ids, [], 0.0, 0.0, 0, error=f"request {i}: {problem}")
            else:
                waiting.append(i)  # admitted in this order
        running: dict[int, RunningSeq] = {}
        steps = dict.fromkeys(range(len(requests)), 0)
        t0 = time.perf_counter()

        def elapsed() -> float:
            self.synchronize()
            return time.perf_counter() - t0

        lock = self.lockstep
        while waiting or running or lock is not None:
            admitted = self._admit(requests, waiting, concurrency - len(running), bool(running))
            admitted_at = time.perf_counter() - t0  # the last iteration synchronized
            if lock is not None:  # every rank: the same MoE forwards this iteration
                if self._agree(lock, requests, admitted, running, bool(waiting)):
                    break
                if not admitted and not running:  # it only served the others' MoE rows
                    continue
            t_step = time.perf_counter()
            if admitted:  # prefill the newcomers; the others wait one iteration
                seqs = [self._start(requests[i]) for i in admitted]
                result = prefill(
                    self.target, self.drafter, seqs, self.capture, self.prefill_chunk, lock
                )
                if lock is not None:
                    lock.idle_decode()
                now = elapsed()
                for i, s in zip(admitted, seqs):
                    out[i] = Generation(
                        requests[i].prompt_ids, [], now, now, 0, admitted_at=admitted_at
                    )
                    running[i] = s
                stepped = admitted
            else:
                stepped = list(running)
                result = decode_step(
                    self.target,
                    self.drafter,
                    [running[i] for i in stepped],
                    self.capture,
                    self.metrics,
                    lockstep=lock,
                    schedule=self.schedule,
                    speculation=self.speculation,
                )
                now = elapsed()
                for i in stepped:
                    steps[i] += 1
            self.step_s += t0 + now - t_step  # the step itself, up to its synchronize
            self.iterations += 1
            if self.measure_memory:
                self.peak_allocated = max(self.peak_allocated, self._allocated(running))
            for j, i in enumerate(stepped):  # only these committed tokens in this iteration
                if (error := running[i].error) is not None:  # fails alone, the rest go on
                    out[i].error, out[i].finished_at = f"request {i}: {error}", now
                    self._final_text(requests[i], out[i])
                    self._finish(i, running)
                elif self._take(requests[i], result.new_tokens[j], out[i], now):
                    self._finish(i, running)
        self.run_s = time.perf_counter() - t0
        for i, g in out.items():
            g.num_steps = steps[i]
        return [out[i] for i in range(len(requests))]

    def _agree(
        self,
        lock: Lockstep,
        requests: Sequence[Request],
        admitted: list[int],
        running: dict[int, RunningSeq],
        waiting: bool,
    ) -> bool:
        """Agree this iteration's shape with the other ranks (True: no rank has work left)
        and run the idle phases this rank has no work of its own for."""
        plan = lock.sync(
            prefill_forwards=prefill_forwards(
                [len(requests[i].prompt_ids) for i in admitted], self.prefill_chunk
            ),
            draft_tokens=step_gamma(self.drafter, list(running.values()))
            if running and not admitted
            else -1,
            busy=bool(admitted or running or waiting),
        )
        if plan.done:
            return True
        if not admitted:
            lock.idle_prefill()
            if not running:
                lock.idle_decode()
        return False

    def _admit(
        self, requests: Sequence[Request], waiting: deque[int], slots: int, busy: bool
    ) -> list[int]:
        """Pop waiting requests in order while a slot and their reservation are free."""
        admitted: list[int] = []
        while (
            waiting
            and len(admitted) < slots
            and self.pool.try_reserve(waiting[0], self._reservation(requests[waiting[0]]))
        ):
            admitted.append(waiting.popleft())
        if waiting and not admitted and not busy:  # an empty pool holds any checked request
            raise RuntimeError(
                f"request {waiting[0]} does not fit an empty memory pool "
                f"({self.pool.reserved} of {self.pool.capacity} bytes still reserved)"
            )
        return admitted

    def _new_pool(self) -> ReservationPool:
        return ReservationPool(self.plan.available if self.plan is not None else math.inf)

    def _reservation(self, req: Request) -> int:
        """Bytes reserved for ``req`` while it runs (0 without a plan)."""
        if self.plan is None:
            return 0
        return self.plan.seq_bytes(len(req.prompt_ids), req.max_new_tokens)

    def _finish(self, i: int, running: dict[int, RunningSeq]) -> None:
        del running[i]  # its states go with it
        self.pool.release(i)

    @staticmethod
    def _allocated(running: dict[int, RunningSeq]) -> int:
        return sum(
            allocated_bytes(s.target_state) + allocated_bytes(s.draft_state)
            for s in running.values()
        )

    def _start(self, req: Request) -> RunningSeq:
        if self.check_sampling is not None:
            self.check_sampling([req.params])
        # the states may grow up to the reserved length, no further
        tokens = len(req.prompt_ids) + req.max_new_tokens + self.drafter.gamma
        return RunningSeq(
            token_ids=list(req.prompt_ids),
            target_state=self.target.new_state(tokens),
            draft_state=self.drafter.new_state(tokens),
            params=req.params,
            generator=make_generator(req.params),
            max_len=len(req.prompt_ids) + req.max_new_tokens,
        )

    def _take(self, req: Request, new_tokens: list[int], gen: Generation, now: float) -> bool:
        """Append one step's committed tokens, one at a time; True when the request is
        finished (a stop string, max_new_tokens or a stop id): the tokens after the one
        that finished it are dropped, also those of the same verify step. With stop
        strings the engine sets ``gen.text`` (cut before a matched stop string)."""
        for t in new_tokens:
            gen.token_ids.append(t)
            gen.finished_at = now
            if req.stop and self._reached_stop(req.stop, gen):
                return True
            if len(gen.token_ids) >= req.max_new_tokens or (
                t in self.stop_ids and not req.ignore_eos
            ):
                self._final_text(req, gen)
                return True
        return False

    def _final_text(self, req: Request, gen: Generation) -> None:
        """The text of an output with stop strings that ended another way."""
        if req.stop and self.decode is not None:
            gen.text = self.decode(gen.token_ids)

    def _reached_stop(self, stop: list[str], gen: Generation) -> bool:
        """Whether the newest token completes a stop string; on a match ``gen.text`` is
        the output before it.

        Incremental: only the last ``longest stop + STOP_WINDOW_SLACK`` tokens are
        decoded per token (a stop string that the newest token completes lies inside
        them, since a token decodes to at least one character); the whole output is
        decoded once, on a match, to cut the text. Earlier tokens were already checked."""
        assert self.decode is not None  # check() refuses stop strings without a decoder
        window = max(len(x) for x in stop) + STOP_WINDOW_SLACK
        if not any(x in self.decode(gen.token_ids[-window:]) for x in stop):
            return False
        text = self.decode(gen.token_ids)
        found = [k for k in (text.find(x) for x in stop) if k >= 0]
        if found:
            gen.text = text[: min(found)]
        return bool(found)


def seeded(params: SamplingParams, index: int) -> SamplingParams:
    """Per-request seed: ``seed + index`` (reproducible, distinct streams)."""
    if params.seed is None:
        return params
    return SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed + index,
    )
