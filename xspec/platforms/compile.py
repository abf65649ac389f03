"""Compiled step functions (``platform.compile``): torch.compile, shared and accounted.

A :class:`StepCompiler` is what ``StepOptions.compile`` holds: called with a pure step
function (a model's ``mix_in``, ``project``, ...), it returns the compiled form, one per
function, so every layer and every model of the run shares the same graphs. Shapes: the
row count is compiled dynamic (``dynamic=True``; parameters stay static), so ragged
batches and prefill chunks reuse one graph instead of recompiling per shape; a size of
1 is specialised, so a function compiles at most twice per kind of layer (decode and
the rest). The compiled code is cached on disk by inductor (``TORCHINDUCTOR_CACHE_DIR``,
default ``/tmp/torchinductor_$USER``), so a later run of the same model reuses it.

Compile time is counted (``seconds``, ``graphs``) and happens in the engine's warm-up
request, never inside measured figures.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class StepCompiler:
    """torch.compile with ``backend`` for step functions, memoised per function."""

    # graphs one step function may have: (decode | other row counts) x kinds of layer
    # (hash / learned routing, compressed or not) x models in the process; torch's
    # default of 8 would silently fall back to eager for the rest
    RECOMPILE_LIMIT = 64

    def __init__(self, backend: str) -> None:
        import torch._dynamo

        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, self.RECOMPILE_LIMIT)
        self.backend = backend
        self.seconds = 0.0  # wall time of the calls that compiled a graph
        self.graphs = 0
        self._compiled: dict[Callable[..., Any], Callable[..., Any]] = {}

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if fn not in self._compiled:
            self._compiled[fn] = self._timed(fn)
        return self._compiled[fn]

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch
        from torch._dynamo.utils import counters

        compiled = torch.compile(fn, backend=self.backend, dynamic=True)
        stats = counters["stats"]

        def call(*args: Any) -> Any:
            before = stats["unique_graphs"]
            start = time.perf_counter()
            out = compiled(*args)
            if stats["unique_graphs"] != before:
                self.seconds += time.perf_counter() - start
                self.graphs += stats["unique_graphs"] - before
            return out

        call.__wrapped__ = fn  # type: ignore[attr-defined]
        return call

    def describe(self) -> str:
        return f"compiled ({self.backend}): {self.graphs} graphs, {self.seconds:.1f} s compiling"
