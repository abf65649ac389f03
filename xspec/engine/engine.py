"""Requests in, generations out: admission, continuous batching, timing.

The engine owns no model math. It checks each request, admits up to ``concurrency``
sequences at a time (a finished sequence frees its slot for a waiting one between two
decode steps), and runs :func:`xspec.workers.step.prefill` / ``decode_step``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from xspec.errors import RequestError
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import CapturePoint, TargetModel
from xspec.sampling import SamplingParams, make_generator
from xspec.workers.drafter import Drafter
from xspec.workers.step import RunningSeq, decode_step, prefill


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    ignore_eos: bool = False


@dataclass
class Generation:
    """One request's result. Times are seconds from the start of ``Engine.run``."""

    prompt_ids: list[int]
    token_ids: list[int]  # generated ids only
    ttft_s: float  # time to first token
    latency_s: float  # time to the last token
    num_steps: int  # decode steps this request took part in
    text: str = ""
    error: str | None = None  # why the request stopped early (e.g. NaN logits); None = fine

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None for a one-token generation (it
        has no such token: serving benchmarks leave it out of TPOT rather than count 0)."""
        n = len(self.token_ids) - 1
        return (self.latency_s - self.ttft_s) / n if n > 0 else None


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
    ) -> None:
        self.target, self.drafter, self.capture = target, drafter, capture
        self.stop_ids = frozenset(stop_ids)  # a request ends at any of these (unless ignore_eos)
        self.synchronize = synchronize
        self.prefill_chunk = prefill_chunk
        self.metrics = SpecDecodeMetrics()

    def check(self, req: Request, where: str) -> None:
        """A clear error for a request that can never run."""
        n, vocab = len(req.prompt_ids), self.target.vocab_size
        if n == 0:
            raise RequestError(f"{where}: empty prompt; give at least one token")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{where}: token ids outside the vocabulary [0, {vocab}): {bad[:8]}")
        if req.max_new_tokens < 1:
            raise RequestError(f"{where}: max_new_tokens must be >= 1 (got {req.max_new_tokens})")
        need = n + req.max_new_tokens + self.drafter.gamma
        if need > self.target.max_context:
            raise RequestError(
                f"{where}: prompt of {n} tokens + max_new_tokens {req.max_new_tokens} (+ {self.drafter.gamma} "
                f"draft rows) exceeds the model context of {self.target.max_context} tokens; shorten the "
                f"prompt, lower max_new_tokens, or raise model.max_context"
            )
        if problems := req.params.problems():
            raise RequestError(f"{where}: " + "; ".join(problems))

    def run(self, requests: Sequence[Request], concurrency: int) -> list[Generation]:
        for i, r in enumerate(requests):
            self.check(r, f"request {i}")
        waiting = deque(range(len(requests)))
        running: dict[int, RunningSeq] = {}
        out: dict[int, Generation] = {}
        steps = dict.fromkeys(range(len(requests)), 0)
        t0 = time.perf_counter()

        def elapsed() -> float:
            self.synchronize()
            return time.perf_counter() - t0

        while waiting or running:
            admitted = [
                waiting.popleft() for _ in range(min(len(waiting), concurrency - len(running)))
            ]
            if admitted:  # prefill the newcomers; the others wait one iteration
                seqs = [self._start(requests[i]) for i in admitted]
                result = prefill(self.target, self.drafter, seqs, self.capture, self.prefill_chunk)
                now = elapsed()
                for i, s in zip(admitted, seqs):
                    out[i] = Generation(requests[i].prompt_ids, [], now, now, 0)
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
                )
                now = elapsed()
                for i in stepped:
                    steps[i] += 1
            for j, i in enumerate(stepped):  # only these committed tokens in this iteration
                if (error := running[i].error) is not None:  # fails alone, the rest go on
                    out[i].error, out[i].latency_s = f"request {i}: {error}", now
                    del running[i]
                elif self._take(requests[i], result.new_tokens[j], out[i], now):
                    del running[i]
        for i, g in out.items():
            g.num_steps = steps[i]
        return [out[i] for i in range(len(requests))]

    def _start(self, req: Request) -> RunningSeq:
        return RunningSeq(
            token_ids=list(req.prompt_ids),
            target_state=self.target.new_state(),
            draft_state=self.drafter.new_state(),
            params=req.params,
            generator=make_generator(req.params),
            max_len=len(req.prompt_ids) + req.max_new_tokens,
        )

    def _take(self, req: Request, new_tokens: list[int], gen: Generation, now: float) -> bool:
        """Append one step's committed tokens; True when the request is finished.

        The step never commits past ``max_new_tokens``; stopping here as well keeps the
        limit even for a step that committed more (and drops what follows a stop id)."""
        for t in new_tokens:
            gen.token_ids.append(t)
            gen.latency_s = now
            if len(gen.token_ids) >= req.max_new_tokens or (
                t in self.stop_ids and not req.ignore_eos
            ):
                return True
        return False


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
