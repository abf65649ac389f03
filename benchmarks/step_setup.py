"""What the single-step timers share (``bench_draft_step.py``, ``bench_verify_step.py``,
``bench_profile_step.py``): sequences prefilled to a context through the real speculative
step, callables that run one kind of step and roll it back, and interleaved timing.

Everything goes through the public API (``xspec.LLM`` and its ``built`` accessor: target,
drafter, capture points). Not a benchmark itself: nothing runs on import.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import xspec
from xspec.models.base import ForwardBatch
from xspec.sampling import SamplingParams, make_generator
from xspec.spec.drafter import CommittedRows, DraftRequest
from xspec.spec.step import RunningSeq, prefill


def interleaved(
    fns: dict[str, Callable[[], None]], reps: int, sync: Callable[[], None]
) -> dict[str, float]:
    """Median seconds per call of each fn, calling them round-robin ``reps`` times (a slow
    spell of the machine falls on every fn alike)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def setup(
    spec: str,
    gamma: int | None,
    context: int,
    batch: int,
    kernels: str = "auto",
    temperature: float = 0.0,
) -> tuple[xspec.LLM, list[RunningSeq]]:
    """dsv4_tiny with ``spec`` (``gamma``: its draft depth, None: the default) and
    ``batch`` sequences of ``context`` random tokens, prefilled through the speculative
    step, so every cache is in its decode-time state; greedy at ``temperature`` 0."""
    overrides: dict[str, Any] = {"platform.kernels": kernels}
    if gamma:
        overrides["spec.num_speculative_tokens"] = gamma
    llm = xspec.LLM(model="dsv4_tiny", spec=spec, platform="cpu", overrides=overrides)
    b = llm.built
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(batch)]
    seqs = [
        RunningSeq(
            token_ids=torch.randint(2, 511, (context,), generator=gen).tolist(),
            target_state=b.target.new_state(),
            draft_state=b.drafter.new_state(),
            params=p,
            generator=make_generator(p),
            max_len=context + 1_000_000,
        )
        for p in params
    ]
    prefill(b.target, b.drafter, seqs, b.capture, 2048)
    return llm, seqs


def scorer(target: Any, states: list[Any], rows: int, gen: torch.Generator) -> Callable[[], None]:
    """One target forward of ``rows`` random rows per sequence at the states' position,
    then rollback (a verify forward; 1 row: a plain decode step)."""
    ids = torch.randint(2, target.vocab_size, (rows * len(states),), generator=gen)
    n0 = [s.num_tokens for s in states]

    def fn() -> None:
        target.forward(ForwardBatch(ids, [rows] * len(states), states))
        for s, n in zip(states, n0):
            target.truncate(s, n)

    return fn


def timers(llm: xspec.LLM, seqs: list[RunningSeq], name: str) -> dict[str, Callable[[], None]]:
    """``target``: one target decode step (rolled back); ``<name> propose``: the draft of
    gamma tokens; ``<name> observe``: one committed position into the draft's context (not
    undone: the context grows by a row per call, which is noise)."""
    b = llm.built
    target, drafter = b.target, b.drafter
    gamma = drafter.gamma
    requests = [DraftRequest(s.anchor, s.params, s.generator, gamma) for s in seqs]
    anchors = torch.tensor([s.anchor for s in seqs])
    n0 = [s.target_state.num_tokens for s in seqs]
    out = target.forward(
        ForwardBatch(anchors, [1] * len(seqs), [s.target_state for s in seqs], b.capture)
    )
    for s, n in zip(seqs, n0):
        target.truncate(s.target_state, n)
    rows = CommittedRows(anchors, anchors, out.hidden, out.aux_hidden, [1] * len(seqs), n0)
    states = [s.draft_state for s in seqs]

    def target_step() -> None:
        target.forward(ForwardBatch(anchors, [1] * len(seqs), [s.target_state for s in seqs]))
        for s, n in zip(seqs, n0):
            target.truncate(s.target_state, n)

    def propose() -> None:
        drafter.propose(states, requests, gamma)

    def observe() -> None:
        drafter.observe(states, rows)

    return {"target": target_step, f"{name} propose": propose, f"{name} observe": observe}
