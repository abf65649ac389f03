"""Requests in, tokens out: admission, continuous batching, stop conditions, timing.

The engine owns no model math. It is a **streaming core**: :meth:`Engine.add` queues a
request at any time, :meth:`Engine.abort` ends one at any time (its memory is returned at
once), and each :meth:`Engine.step` runs one iteration and returns what it committed, a
:class:`Delta` per request that moved (several tokens per step with speculation). The
batch run (:meth:`Engine.run`, used by the CLI and ``xspec.LLM.generate``), the streaming
Python API and the HTTP server (:mod:`xspec.serve`, stepping it from its own thread) all
drive this one core.

A malformed request raises (the caller's input is wrong); a request that can never fit
(its length beyond the model context or the memory plan) ends alone with
``Generation.error``, and so do the requests of a step that raises (:meth:`Engine.step`).
The others are admitted in arrival order while ``concurrency`` and
the memory pool allow: each admission reserves the request's worst case
(:mod:`xspec.engine.memory`), each completion or abort frees it, and waiting requests are
admitted between two decode steps as others finish. It runs
:func:`xspec.spec.step.prefill` / ``decode_step`` and ends a request at a stop id, at
a stop string (:mod:`xspec.engine.stop`), or at ``max_new_tokens``, whichever comes first;
nothing after it is kept.
Times are seconds on the engine's clock (:meth:`Engine.reset_clock`; a batch run starts
it, and every request of a batch arrives at 0); TTFT and latency count from admission,
the wait before it is the queue time (:class:`Generation`).

The ``n`` choices of one prompt (:meth:`Engine.add`'s ``group``) are admitted together
and the prompt is prefilled once; the others take copies of its states
(:func:`xspec.spec.step.fork`).

With a prefix cache (:mod:`xspec.engine.prefix_cache`) admission looks each prompt up
and a newcomer's states are restored from its longest cached prefix; every prefill then
runs in cache blocks (:mod:`xspec.spec.block_prefill`), snapshotting each boundary. The
cache gives way to reservations: a request that fits the plan without it fits with it.

Under expert parallelism (``lockstep``) each iteration first agrees its shape with the
other ranks and tops up with idle forwards; a rank without work keeps iterating until no
rank has any (:mod:`xspec.parallel.lockstep`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from xspec.acceptance import SpecCounts
from xspec.engine.memory import MemoryPlan, ReservationPool, allocated_bytes, context_problem
from xspec.engine.prefix_cache import Entry, Hit, PrefixCache
from xspec.engine.stop import StopMatcher, stop_problem
from xspec.errors import RequestError, UserError
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import CapturePoint, TargetModel
from xspec.sampling import SamplingParams, TokenLogprob, make_generator
from xspec.spec.block_prefill import HeldRow, prefill_blocks
from xspec.spec.drafter import Drafter
from xspec.spec.policy import DepthPolicy
from xspec.spec.processors import Processors
from xspec.spec.step import (
    FIXED_DEPTH,
    RunningSeq,
    StepResult,
    decode_step,
    prefill,
    prefill_forwards,
    step_gamma,
)

if TYPE_CHECKING:
    from xspec.grammar import Grammar
    from xspec.parallel.lockstep import Lockstep

log = logging.getLogger(__name__)

# the canary after a failed step (Engine._canary): the server's warm-up prompt
CANARY_PROMPT = (1, 2, 3, 4)


class EngineUnusable(RuntimeError):
    """A step raised and a fresh four-token generation raised too: the fault is the
    engine's (its device, its weights), not one request's."""


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    ignore_eos: bool = False
    # the output ends at the first of these strings (the string itself not kept in
    # ``text``; the token that completed it is the last of ``token_ids``)
    stop: list[str] = field(default_factory=list)
    # structured output: every token is sampled under this grammar's mask (None: free)
    grammar: Grammar | None = None
    # more ids that end the output, besides the model's stop ids (also under ignore_eos);
    # the stop id's text is not kept in ``text``
    stop_token_ids: frozenset[int] = frozenset()
    # ``text`` keeps the stop string (or stop_token_ids' token) that ended the output
    include_stop_str: bool = False


# why a generation ended: a stop id or stop string ("stop"), max_new_tokens ("length"),
# the caller's abort ("abort"), or a failure alone ("error": see Generation.error)
FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass
class Generation:
    """One request's result, filled in as it runs. The ``*_at`` times are seconds on the
    engine's clock (a batch run starts it; every request of a batch arrives at 0).
    Latencies count from admission, as ``vllm bench serve --max-concurrency`` does; the
    wait before it is ``queue_s`` (docs/metrics.md)."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    first_token_at: float  # its first token committed (after its prefill)
    finished_at: float  # its last token committed, or the step that failed it
    num_steps: int  # decode steps this request took part in
    text: str = ""
    error: str | None = None  # why the request stopped early (e.g. NaN logits); None = fine
    # taken into the running batch: a concurrency slot and its memory reservation
    admitted_at: float = 0.0
    arrived_at: float = 0.0  # given to the engine (a batch: all at 0)
    finish_reason: FinishReason | None = None  # None while it runs
    # its speculative counters over its steps (xspec.acceptance: as /metrics counts them)
    spec: SpecCounts = field(default_factory=SpecCounts)
    # SamplingParams.logprobs: one per generated token (None: not asked for)
    logprobs: list[TokenLogprob] | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, the first None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (not prefilled)

    @property
    def queue_s(self) -> float:
        """Time waiting for admission (from arrival)."""
        return self.admitted_at - self.arrived_at

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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Delta:
    """What one engine iteration did for one request: the tokens it committed (empty
    for a prefill that commits none, an abort or a failure) and, once it ended, its
    final :class:`Generation` (``finished``)."""

    rid: Hashable
    token_ids: list[int]
    generation: Generation  # the live record: it keeps changing until it ends
    finished: bool = False  # this delta is the request's last

    def __post_init__(self) -> None:
        self.finished = self.generation.finished

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        """The logprobs of this delta's tokens (None unless the request asked)."""
        lps = self.generation.logprobs
        return None if lps is None else lps[len(lps) - len(self.token_ids) :]


class Engine:
    """The streaming core (see the module docstring). One thread drives it: ``add``,
    ``abort`` and ``step`` are not thread-safe (:mod:`xspec.serve` queues calls from
    other threads and makes them between steps)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        capture: list[CapturePoint],
        *,
        stop_ids: frozenset[int],
        synchronize: Callable[[], None] = lambda: None,
        prefill_chunk: int = 2048,
        # prompt tokens one prefill iteration takes in (its first request always); None: no limit
        max_prefill_tokens: int | None = None,
        plan: MemoryPlan | None = None,  # None: no memory limit (only model.max_context)
        decode: Callable[[list[int]], str] | None = None,  # the tokenizer's, for stop strings
        measure_memory: bool = False,  # record the peak of allocated state bytes (tests)
        lockstep: Lockstep | None = None,  # expert parallelism: iterations agreed across ranks
        # a calibration file's sampling regime against each request's (warns on a mismatch)
        check_sampling: Callable[[list[SamplingParams]], None] | None = None,
        # how many drafts each request drafts and verifies (xspec.spec.policy)
        policy: DepthPolicy = FIXED_DEPTH,
        # prompt prefixes' states (xspec.engine.prefix_cache); None: every prompt prefilled whole
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if lockstep is not None and prefix_cache is not None:
            raise ValueError("the prefix cache does not run under expert parallelism (lockstep)")
        if lockstep is not None and not policy.lockstep_safe:
            raise ValueError(
                f"{type(policy).__name__} cannot run under expert parallelism: every rank "
                "must draft the iteration's agreed width (a lockstep-safe depth policy)"
            )
        self.policy = policy
        self.prefix_cache = prefix_cache
        self._hits: dict[Hashable, Hit] = {}  # admitted, not yet prefilled: their pinned entries
        self.check_sampling = check_sampling
        self.target, self.drafter, self.capture = target, drafter, capture
        self.stop_ids = frozenset(stop_ids)  # a request ends at any of these (unless ignore_eos)
        self.synchronize = synchronize
        self.prefill_chunk = prefill_chunk
        self.max_prefill_tokens = max_prefill_tokens
        self.plan = plan
        self.decode = decode
        self.measure_memory = measure_memory
        self.lockstep = lockstep
        self.metrics = SpecDecodeMetrics()
        self.concurrency = 1  # requests running at once at most (run() sets it per call)
        self.pool = self._new_pool()
        self.peak_allocated = 0  # bytes, with measure_memory: max over steps of the states' sum
        self.step_s = 0.0  # seconds inside prefill / decode_step since reset_clock
        self.prefill_s = 0.0  # ... of them inside prefill (step_s - prefill_s: decode_step)
        self.run_s = 0.0  # last run: seconds of the whole run
        self.iterations = 0  # prefill + decode_step calls since reset_clock
        self.prefills = 0  # ... of them prefill
        # prompt tokens the prefills ran through the target (those the prefix cache
        # restored and the other choices of a prompt prefilled once not counted)
        self.prompt_tokens_computed = 0
        self.done = False  # under lockstep: no rank had work in the last iteration
        self._requests: dict[Hashable, Request] = {}
        self._gens: dict[Hashable, Generation] = {}
        self._waiting: deque[Hashable] = deque()
        self._running: dict[Hashable, RunningSeq] = {}
        self._stops: dict[Hashable, StopMatcher] = {}  # the requests with stop strings
        # the choices of one prompt (add's ``group``) until admitted: rid -> its group key
        self._group_of: dict[Hashable, Hashable] = {}
        # admitted, not yet prefilled: a choice -> the one of its group whose prefill it shares
        self._leader_of: dict[Hashable, Hashable] = {}
        self._ended: list[Delta] = []  # ended outside a step (rejected, aborted): next step's
        self._t0 = time.perf_counter()

    # ---- the streaming core -----------------------------------------------------------

    def reset_clock(self) -> None:
        """Start the clock the ``*_at`` times count on, and the step counters (idle only)."""
        if self.busy:
            raise RuntimeError("reset_clock while requests are in flight")
        self.pool, self.peak_allocated, self.step_s, self.iterations = self._new_pool(), 0, 0.0, 0
        self.prefill_s, self.prefills, self.prompt_tokens_computed = 0.0, 0, 0
        self.done = False
        self._t0 = time.perf_counter()

    def reset_metrics(self, fresh: SpecDecodeMetrics | None = None) -> SpecDecodeMetrics:
        """Start the spec-decode counters afresh (after a warm-up, between the settings a
        benchmark compares), into ``fresh`` when given (e.g. one that also drives a
        progress bar); returns the ones accumulated so far."""
        previous, self.metrics = self.metrics, fresh if fresh is not None else SpecDecodeMetrics()
        return previous

    def now(self) -> float:
        """Seconds on the engine's clock (after the device finished its queued work)."""
        self.synchronize()
        return time.perf_counter() - self._t0

    @property
    def busy(self) -> bool:
        """Requests waiting or running, or ended ones not yet reported by a step."""
        return bool(self._waiting or self._running or self._ended)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(
        self,
        rid: Hashable,
        req: Request,
        where: str | None = None,
        arrived_at: float | None = None,  # None: now, on the engine's clock
        group: Hashable | None = None,
    ) -> Generation:
        """Queue ``req`` under the id ``rid`` (unique among requests in flight) and return
        its live :class:`Generation`. A malformed request raises
        :class:`~xspec.errors.RequestError`; one that can never fit ends at once with
        ``error`` set (reported by the next :meth:`step`).

        ``group``: the choices of one prompt (``n > 1``) share a key. They are admitted
        together (all of them or, while they do not all fit, none; a group larger than
        ``concurrency`` or the memory pool in pieces as large as fit) and the prompt is
        prefilled once: the others take copies of its states before the drafter observes
        the last rows, and each samples its first token from the shared last row with its
        own generator (:func:`~xspec.spec.step.fork`). Every choice reserves its own
        memory and ends (or is aborted) on its own."""
        where = where or f"request {rid}"
        if rid in self._gens:
            raise RequestError(f"{where}: the id {rid!r} is already in flight")
        self.check(req, where)
        if group is not None:
            self._check_group(group, req, where)
        now = time.perf_counter() - self._t0 if arrived_at is None else arrived_at
        gen = Generation(req.prompt_ids, [], now, now, 0, admitted_at=now, arrived_at=now)
        self._gens[rid] = gen
        if (problem := self.capacity_problem(req)) is not None:  # rejected alone
            gen.error, gen.finish_reason = f"{where}: {problem}", "error"
            self._ended.append(Delta(rid, [], gen))
            return gen
        self._requests[rid] = req
        if req.stop:
            assert self.decode is not None  # check() refuses stop strings without a decoder
            self._stops[rid] = StopMatcher(req.stop, self.decode, req.include_stop_str)
        if group is not None:
            self._group_of[rid] = group
        self._waiting.append(rid)  # admitted in this order
        return gen

    def _check_group(self, group: Hashable, req: Request, where: str) -> None:
        """The choices of a group share one prompt (and what its prefill computes)."""
        other = next((r for r, g in self._group_of.items() if g == group), None)
        if other is None:
            return
        first = self._requests[other]
        if req.prompt_ids != first.prompt_ids:
            raise RequestError(
                f"{where}: group {group!r} holds the choices of another prompt; a group's "
                "requests share one prompt"
            )
        if req.params.prompt_logprobs != first.params.prompt_logprobs:
            raise RequestError(
                f"{where}: the choices of group {group!r} must ask the same prompt_logprobs"
            )

    def abort(self, rid: Hashable) -> bool:
        """End ``rid`` now (``finish_reason="abort"``; its memory is freed at once, its
        tokens so far are kept). False when it is not in flight (finished, unknown)."""
        gen = self._gens.get(rid)
        if gen is None or gen.finished:
            return False
        if rid in self._running:
            self._finish(rid)
        else:
            if rid in self._waiting:
                self._waiting.remove(rid)
                self._group_of.pop(rid, None)
            else:  # admitted, but an exception (KeyboardInterrupt) cut its prefill short
                self.pool.release(rid)
                self._unpin([rid])
                self._leader_of.pop(rid, None)
            self._requests.pop(rid)
        gen.finish_reason = "abort"
        gen.finished_at = time.perf_counter() - self._t0
        self._ended.append(Delta(rid, [], gen))
        return True

    def abort_all(self) -> None:
        """:meth:`abort` every request in flight."""
        for rid in [r for r, g in self._gens.items() if not g.finished]:
            self.abort(rid)

    def discard(self) -> None:
        """:meth:`abort_all`, and drop the deltas that would report it: the engine is
        idle at once (after a caller's exception, e.g. a KeyboardInterrupt mid-run,
        when nobody reads those requests any more)."""
        self.abort_all()
        for d in self._ended:
            self._forget(d.rid)
        self._ended = []

    def step(self) -> list[Delta]:
        """One iteration: admit what fits, then prefill the newcomers or run one decode
        step of the running requests; the requests that moved or ended. Under lockstep
        every rank calls it in turn (also without work: it serves the others' MoE rows)
        until ``done``.

        A step that raises fails the requests in it (their states may be half-updated:
        they are dropped), each with ``error`` set; the requests not in it are untouched
        and later steps go on. A fresh four-token generation then tells whether the
        fault was those requests' or the engine's: if it fails too, :class:`EngineUnusable`
        is raised. Under lockstep the exception is raised as it is (the other ranks are
        inside this iteration's collectives)."""
        deltas, self._ended = self._ended, []
        for d in deltas:
            self._forget(d.rid)
        admitted = self._admit()
        admitted_at = time.perf_counter() - self._t0  # the last iteration synchronized
        lock = self.lockstep
        if lock is not None and self._agree(lock, admitted):  # every rank: the same MoE forwards
            self.done = True
            return deltas
        if not admitted and not self._running:  # (under lockstep: it served the others' rows)
            return deltas
        stepped = admitted or list(self._running)
        t_step = time.perf_counter()
        try:
            result, now = self._forward(admitted, admitted_at, stepped)
        except Exception as e:
            if lock is not None:
                raise
            return deltas + self._failed(stepped, e)
        took = self._t0 + now - t_step  # the step itself, up to its synchronize
        self.step_s += took
        self.iterations += 1
        if admitted:
            self.prefill_s += took
            self.prefills += 1
        if self.measure_memory:
            self.peak_allocated = max(self.peak_allocated, self._allocated())
        for j, i in enumerate(stepped):  # only these committed tokens in this iteration
            lps = None if result.logprobs is None else result.logprobs[j]
            deltas.append(self._commit(i, result.new_tokens[j], lps, now))
        for d in deltas:
            if d.finished:
                self._forget(d.rid)
        return deltas

    def _forward(
        self, admitted: list[Hashable], admitted_at: float, stepped: list[Hashable]
    ) -> tuple[StepResult, float]:
        """Prefill the newcomers (the running requests wait one iteration) or run one
        decode step of ``stepped``: its result and the engine time it ended. The
        requests' records change only once it has run."""
        lock, running = self.lockstep, self._running
        if admitted:
            try:
                at = {rid: k for k, rid in enumerate(admitted)}
                shares = [at.get(self._leader_of.get(i)) for i in admitted]
                seqs = [
                    self._start(self._requests[i], None if j is not None else self._hits.get(i))
                    for i, j in zip(admitted, shares)
                ]
                for i, s, j in zip(admitted, seqs, shares):
                    self._gens[i].cached_tokens = s.target_state.num_tokens
                    if j is None:
                        self.prompt_tokens_computed += len(s.token_ids) - s.target_state.num_tokens
                result = self._prefill(admitted, seqs, shares)
            finally:
                self._unpin(admitted)
                for i in admitted:
                    self._leader_of.pop(i, None)
            if lock is not None:
                lock.idle_decode()
            now = self.now()
            for j, (i, s) in enumerate(zip(admitted, seqs)):
                gen = self._gens[i]
                gen.admitted_at, gen.first_token_at, gen.finished_at = admitted_at, now, now
                if result.prompt_logprobs is not None:
                    gen.prompt_logprobs = result.prompt_logprobs[j]
                running[i] = s
            return result, now
        result = decode_step(
            self.target,
            self.drafter,
            [running[i] for i in stepped],
            self.capture,
            self.metrics,
            lockstep=lock,
            policy=self.policy,
        )
        now = self.now()
        for j, i in enumerate(stepped):
            gen = self._gens[i]
            gen.num_steps += 1
            gen.spec.add_row(result.num_drafts[j], result.num_accepted[j])
        return result, now

    def _commit(
        self,
        rid: Hashable,
        new_tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        now: float,
    ) -> Delta:
        """Take one request's tokens (and their logprobs) of a step that ran; the delta
        it makes."""
        gen = self._gens[rid]
        before = len(gen.token_ids)
        if (error := self._running[rid].error) is not None:  # fails alone, the rest go on
            self._end_with_error(rid, error, now)
        elif self._take(rid, new_tokens, logprobs, gen, now):
            self._finish(rid)
        return Delta(rid, gen.token_ids[before:], gen)

    def _failed(self, rids: list[Hashable], e: Exception) -> list[Delta]:
        """End the requests of a step that raised ``e`` with ``error`` set, their states
        dropped; then the canary (:meth:`_canary`). Their final deltas."""
        n = len(rids)
        log.error("an engine step of %d request(s) raised; they end with an error", n, exc_info=e)
        now = time.perf_counter() - self._t0  # not now(): a device that failed may fail again
        out = []
        for rid in rids:
            self._end_with_error(rid, f"the engine step it was in raised {e!r}", now)
            out.append(Delta(rid, [], self._gens[rid]))
            self._forget(rid)
        self._canary(e)
        return out

    def _canary(self, cause: Exception) -> None:
        """Raise :class:`EngineUnusable` unless a fresh generation of
        :data:`CANARY_PROMPT` (its prefill and one decode step, outside the batch and the
        metrics) runs. A user error the canary meets too (a platform or configuration
        that cannot run any step, e.g. ``platform.native_sas=on`` with an operator that
        refuses it) is raised as it is: its message says what to change."""
        req = Request(list(CANARY_PROMPT), self.drafter.gamma + 2, SamplingParams(), True)
        try:
            seq = self._new_seq(req)
            prefill(self.target, self.drafter, [seq], self.capture, self.prefill_chunk)
            decode_step(self.target, self.drafter, [seq], self.capture, SpecDecodeMetrics())
            self.synchronize()
        except UserError:
            raise
        except Exception as e:
            raise EngineUnusable(
                f"the engine is unusable: a step raised {cause!r}, and a fresh "
                f"{len(CANARY_PROMPT)}-token generation raised {e!r}"
            ) from e

    def drain(self) -> Iterator[Delta]:
        """Step until every request added so far has ended (under lockstep: until no
        rank has work), yielding each iteration's deltas."""
        while self.busy or (self.lockstep is not None and not self.done):
            yield from self.step()

    # ---- the batch run --------------------------------------------------------------------

    def run(
        self,
        requests: Sequence[Request],
        concurrency: int,
        groups: Sequence[Hashable | None] | None = None,
    ) -> list[Generation]:
        """Every request arrives at once (the clock starts); their generations in order.
        ``groups[i]``: request ``i``'s group (:meth:`add`: the choices of one prompt)."""
        groups = groups or [None] * len(requests)
        for i, r in enumerate(requests):
            self.check(r, f"request {i}")
        self.reset_clock()
        self.concurrency = concurrency
        try:
            gens = [
                self.add(i, r, arrived_at=0.0, group=g)
                for i, (r, g) in enumerate(zip(requests, groups, strict=True))
            ]
            for _ in self.drain():
                pass
        except BaseException:  # a KeyboardInterrupt mid-step, an unusable engine: idle again
            self.discard()
            raise
        self.run_s = time.perf_counter() - self._t0
        return gens

    # ---- checks ---------------------------------------------------------------------------

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
        if (problem := stop_problem(req.stop)) is not None:
            raise RequestError(f"{where}: {problem}")
        if bad := sorted(t for t in req.stop_token_ids if not 0 <= t < vocab):
            raise RequestError(
                f"{where}: stop_token_ids outside the vocabulary [0, {vocab}): {bad[:8]}"
            )
        if req.stop and self.decode is None:
            raise RequestError(f"{where}: stop strings need a tokenizer; this engine has none")
        if problems := req.params.problems():
            raise RequestError(f"{where}: " + "; ".join(problems))
        if req.grammar is not None and req.ignore_eos:
            raise RequestError(
                f"{where}: ignore_eos cannot go with structured output (the grammar ends "
                "in a stop token); drop one of them"
            )
        if req.grammar is not None and req.params.min_tokens:
            raise RequestError(
                f"{where}: min_tokens cannot go with structured output (a complete grammar "
                "admits only a stop token, which min_tokens masks); drop min_tokens"
            )
        if req.grammar is not None and req.grammar.vocab_size != vocab:
            raise RequestError(f"{where}: the grammar was compiled for another vocabulary")
        if bad := [t for t, _ in req.params.logit_bias if not t < vocab]:
            raise RequestError(
                f"{where}: logit_bias names token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
            )
        if req.params.min_tokens > req.max_new_tokens:
            raise RequestError(
                f"{where}: min_tokens ({req.params.min_tokens}) must be <= max_new_tokens "
                f"({req.max_new_tokens})"
            )

    def capacity_problem(self, req: Request) -> str | None:
        """Why a well-formed request can never run here (None: it fits an empty pool)."""
        n, gamma = len(req.prompt_ids), self.drafter.gamma
        if self.plan is not None:
            return self.plan.problem(n, req.max_new_tokens)
        return context_problem(n, req.max_new_tokens, gamma, self.target.max_context)

    # ---- internals ------------------------------------------------------------------------

    def _agree(self, lock: Lockstep, admitted: list[Hashable]) -> bool:
        """Agree this iteration's shape with the other ranks (True: no rank has work left)
        and run the idle phases this rank has no work of its own for."""
        running = self._running
        plan = lock.sync(
            prefill_forwards=prefill_forwards(
                [len(self._requests[i].prompt_ids) for i in admitted], self.prefill_chunk
            ),
            draft_tokens=step_gamma(self.drafter, list(running.values()))
            if running and not admitted
            else -1,
            busy=bool(admitted or running or self._waiting),
        )
        if plan.done:
            return True
        if not admitted:
            lock.idle_prefill()
            if not running:
                lock.idle_decode()
        return False

    def _admit(self) -> list[Hashable]:
        """Pop waiting requests in order while a slot and their reservation are free, and
        (``max_prefill_tokens``) while their prompts fit this iteration's token budget,
        which never holds back an iteration's first request. The rest wait for the next
        iteration, which admits again before any decode step while slots are free, so a
        batch that arrives together starts decoding together, as without a budget (what
        the split costs and saves: docs/architecture.md)."""
        waiting, slots = self._waiting, self.concurrency - len(self._running)
        admitted: list[Hashable] = []
        budget, tokens = self.max_prefill_tokens, 0
        while waiting and len(admitted) < slots:
            req = self._requests[waiting[0]]
            if budget is not None and admitted and tokens + len(req.prompt_ids) > budget:
                break
            group = self._group_of.get(waiting[0])
            if group is not None:  # the choices of one prompt: one prefill
                members = self._admit_group(group, slots - len(admitted))
                if not members:
                    break
                admitted += members
            elif self._reserve(waiting[0], req):
                admitted.append(waiting.popleft())
            else:
                break
            tokens += len(req.prompt_ids)
        if waiting and not admitted and not self._running:  # an empty pool holds any checked one
            raise RuntimeError(
                f"{self._where(waiting[0])} does not fit an empty memory pool "
                f"({self.pool.reserved} of {self.pool.capacity} bytes still reserved)"
            )
        return admitted

    def _admit_group(self, group: Hashable, slots: int) -> list[Hashable]:
        """Admit the waiting choices of ``group`` (the first of them at the head of the
        queue), reserved, pulled out of the queue: all of them, or none while they do not
        all fit. A group that could never fit whole (more choices than ``concurrency``,
        or than an empty pool holds) is admitted in pieces as large as fit now."""
        members = [r for r in self._waiting if self._group_of.get(r) == group]
        reservations = sum(self._reservation(self._requests[r]) for r in members)
        whole = len(members) <= self.concurrency and reservations <= self.pool.capacity
        taken: list[Hashable] = []
        for rid in members[:slots]:
            if not self._reserve(rid, self._requests[rid], lookup=not taken):
                break
            taken.append(rid)
        if whole and len(taken) < len(members):  # the rest waits with it
            for rid in taken:
                self.pool.release(rid)
            self._unpin(taken)
            return []
        for rid in taken:
            self._waiting.remove(rid)
            del self._group_of[rid]
            if rid != taken[0]:
                self._leader_of[rid] = taken[0]
        return taken

    # ---- the prefix cache -------------------------------------------------------------

    def _reserve(self, rid: Hashable, req: Request, lookup: bool = True) -> bool:
        """Reserve ``req``'s worst case, the prefix cache giving way (its least recently
        used entries evicted, its hit for this prompt too if need be), and pin its hit
        (``lookup``; the other choices of a prompt take its first one's states)."""
        nbytes, cache = self._reservation(req), self.prefix_cache
        if cache is None:
            return self.pool.try_reserve(rid, nbytes)
        # prompt logprobs score every prompt row: such a request prefills all of it
        scored = req.params.prompt_logprobs is not None or not lookup
        hit = Hit() if scored else cache.match(req.prompt_ids)
        if not self._room_for(nbytes):
            cache.release(hit.entries)  # its own prefix gives way too
            if not self._room_for(nbytes):
                return False
            hit = Hit() if scored else cache.match(req.prompt_ids)  # what is left of it
        reserved = self.pool.try_reserve(rid, nbytes)
        assert reserved, "the pool refused what _room_for made room for"
        self._hits[rid] = hit
        return True

    def _room_for(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit beside the reservations and the cache, after
        evicting the unpinned entries they need."""
        cache = self.prefix_cache
        assert cache is not None
        over = self.pool.reserved + nbytes + cache.nbytes - self.pool.capacity
        if over > 0:
            cache.evict(over)
        return self.pool.reserved + nbytes + cache.nbytes <= self.pool.capacity

    def _prefill(
        self, rids: list[Hashable], seqs: list[RunningSeq], shares: list[int | None]
    ) -> StepResult:
        """Prefill the newcomers: whole (no cache) or in cache blocks, caching each
        boundary a sequence reaches while every entry before it is its own lineage.
        ``shares[k] = j``: ``seqs[k]`` takes ``seqs[j]``'s prefill (a choice of its prompt)."""
        cache = self.prefix_cache
        if cache is None:
            return prefill(
                self.target,
                self.drafter,
                seqs,
                self.capture,
                self.prefill_chunk,
                self.lockstep,
                shares=shares,
            )
        pinned = [self._hits[i].entries for i in rids]  # each lineage: its last is the parent
        active = [True] * len(seqs)

        def on_boundary(j: int, held: HeldRow) -> None:
            if not active[j]:
                return
            seq, parent = seqs[j], pinned[j][-1] if pinned[j] else None
            end, start = seq.target_state.num_tokens, parent.end if parent else 0
            if cache.cached(parent, seq.token_ids, end):  # another prefill's lineage
                active[j] = False
                return
            entry = cache.insert(
                parent,
                seq.token_ids,
                end,
                self.target.snapshot(seq.target_state, start),
                # the drafter holds one row less than the target (the held-back row)
                self.drafter.snapshot(seq.draft_state, max(0, start - 1)),
                held,
                room=self.pool.capacity - self.pool.reserved - cache.nbytes,
            )
            if entry is None:
                active[j] = False
            else:
                pinned[j].append(entry)

        held = [p[-1].held if p else None for p in pinned]  # the restored ones'
        return prefill_blocks(
            self.target, self.drafter, seqs, self.capture, cache.block, held, on_boundary, shares
        )

    def _unpin(self, rids: list[Hashable]) -> None:
        """The prefix-cache entries these admitted requests pinned may be evicted again."""
        for rid in rids:
            hit = self._hits.pop(rid, None)
            if hit is not None and self.prefix_cache is not None:
                self.prefix_cache.release(hit.entries)

    def _new_pool(self) -> ReservationPool:
        return ReservationPool(self.plan.available if self.plan is not None else math.inf)

    def _reservation(self, req: Request) -> int:
        """Bytes reserved for ``req`` while it runs (0 without a plan)."""
        if self.plan is None:
            return 0
        return self.plan.seq_bytes(len(req.prompt_ids), req.max_new_tokens)

    def _finish(self, rid: Hashable) -> None:
        del self._running[rid]  # its states go with it
        self.pool.release(rid)

    def _end_with_error(self, rid: Hashable, error: str, now: float) -> None:
        """End ``rid`` (running, or admitted by a step that failed) with ``error``."""
        gen = self._gens[rid]
        gen.error, gen.finished_at, gen.finish_reason = f"{self._where(rid)}: {error}", now, "error"
        self._final_text(self._requests[rid], gen, cut=False)
        if rid in self._running:
            self._finish(rid)
        else:
            self.pool.release(rid)

    def _forget(self, rid: Hashable) -> None:
        """An ended request leaves the engine (its id may be used again)."""
        self._group_of.pop(rid, None)
        self._gens.pop(rid, None)
        self._requests.pop(rid, None)
        self._stops.pop(rid, None)

    @staticmethod
    def _where(rid: Hashable) -> str:
        return f"request {rid}"

    def _allocated(self) -> int:
        return sum(
            allocated_bytes(s.target_state) + allocated_bytes(s.draft_state)
            for s in self._running.values()
        )

    def _start(self, req: Request, hit: Hit | None = None) -> RunningSeq:
        """``req``'s running sequence, restored from its prefix-cache ``hit`` if any."""
        if self.check_sampling is not None:
            self.check_sampling([req.params])
        if hit is None or self.prefix_cache is None:
            return self._new_seq(req)
        self.prefix_cache.count(len(req.prompt_ids), hit.tokens)
        self.metrics.observe_prefix(len(req.prompt_ids), hit.tokens)
        return self._new_seq(req, hit.entries)

    def _new_seq(self, req: Request, cached: Sequence[Entry] = ()) -> RunningSeq:
        """A request's running sequence, its states restored from ``cached`` (the prefix
        cache's entries of its prompt, from the first block) or empty."""
        # the states may grow up to the reserved length, no further
        tokens = len(req.prompt_ids) + req.max_new_tokens + self.drafter.gamma
        target_state = self.target.new_state(tokens)
        draft_state = self.drafter.new_state(tokens)
        if cached:
            self.target.restore(target_state, [e.target for e in cached])
            draft_state = self.drafter.restore(draft_state, [e.draft for e in cached])
        return RunningSeq(
            token_ids=list(req.prompt_ids),
            target_state=target_state,
            draft_state=draft_state,
            params=req.params,
            generator=make_generator(req.params),
            max_len=len(req.prompt_ids) + req.max_new_tokens,
            constraint=None if req.grammar is None else req.grammar.constraint(),
            processors=self._processors(req),
        )

    def _processors(self, req: Request) -> Processors | None:
        """The request's logits processors (None without any): ``min_tokens`` masks the
        engine's stop ids (unless ``ignore_eos``) and the request's ``stop_token_ids``."""
        if not req.params.has_processors:
            return None
        stop = (frozenset() if req.ignore_eos else self.stop_ids) | req.stop_token_ids
        target = self.target
        return Processors(req.params, req.prompt_ids, stop, target.vocab_size, target.device)

    def _take(
        self,
        rid: Hashable,
        new_tokens: list[int],
        logprobs: list[TokenLogprob] | None,
        gen: Generation,
        now: float,
    ) -> bool:
        """Append one step's committed tokens, one at a time; True when the request is
        finished (a stop string, max_new_tokens, a stop id or one of the request's
        ``stop_token_ids``; ``gen.finish_reason`` set): the tokens after the one that
        finished it are dropped, also those of the same verify step. With stop strings or
        ``stop_token_ids`` the engine sets ``gen.text`` (cut before what stopped it)."""
        req, stops = self._requests[rid], self._stops.get(rid)
        if logprobs is not None and gen.logprobs is None:
            gen.logprobs = []
        for k, t in enumerate(new_tokens):
            gen.token_ids.append(t)
            if logprobs is not None:
                gen.logprobs.append(logprobs[k])  # type: ignore[union-attr]
            gen.finished_at = now
            if stops is not None and (text := stops.push(t)) is not None:
                gen.text, gen.finish_reason = text, "stop"
                return True
            asked = t in req.stop_token_ids
            stop_id = asked or (t in self.stop_ids and not req.ignore_eos)
            if len(gen.token_ids) >= req.max_new_tokens or stop_id:
                gen.finish_reason = "stop" if stop_id else "length"
                self._final_text(req, gen, cut=asked and not req.include_stop_str)
                return True
        return False

    def _final_text(self, req: Request, gen: Generation, *, cut: bool) -> None:
        """The text of an output with stop strings or stop_token_ids that ended another
        way than a stop string (``cut``: without its last token, a stop_token_ids one)."""
        if (req.stop or req.stop_token_ids) and self.decode is not None:
            gen.text = self.decode(gen.token_ids[:-1] if cut else gen.token_ids)


def seeded(params: SamplingParams, index: int) -> SamplingParams:
    """Per-request seed: ``seed + index`` (reproducible, distinct streams)."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=params.seed + index)
