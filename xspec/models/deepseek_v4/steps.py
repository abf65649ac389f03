"""The stateless step functions of a DeepSeek-V4 block, run eagerly or compiled.

A block's forward alternates stateless tensor math with cache reads and writes
(:meth:`Block.forward`): ``Block.mix_in`` (mHC collapse + norm), ``Attention.project``
(every per-row projection of the attention input), the attention core over the caches
(eager: its index sets change every step), then ``Block.mix_out`` (output projection,
mHC expand, the FFN site's collapse, norm, MoE, expand). :class:`Steps` holds the first,
second and fourth as callables taking the module as their first argument (the
platform's ops reach the modules at construction: ``models.ops.ModelOps``).
:func:`steps_for` makes them the plain methods, or wraps those with a platform's
compiler where ``platform.compile`` says so:
as functions of (module, tensors), one compiled graph serves every layer of the same
kind (guards see the module's static attributes, not its identity).

Under expert parallelism ``mix_out`` stays eager: the MoE exchanges rows with the other
ranks in the middle of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xspec.models.ops import StepOptions


@dataclass(frozen=True, eq=False)
class Steps:
    """Where a block's stateless steps run (see the module docstring)."""

    mix_in: Callable[..., Any]
    project: Callable[..., Any]
    mix_out: Callable[..., Any]


@functools.lru_cache(maxsize=32)
def steps_for(
    options: StepOptions,
    mix_in: Callable[..., Any],
    project: Callable[..., Any],
    mix_out: Callable[..., Any],
    *,
    moe: bool,
) -> Steps:
    """The one :class:`Steps` of ``options`` for the plain step methods ``mix_in``,
    ``project``, ``mix_out`` (all blocks share it, so a compiler's guards see the same
    object in every layer); ``moe=False`` keeps ``mix_out`` eager (expert parallelism)."""
    compile_fn = options.compile
    if compile_fn is not None:
        mix_in, project = compile_fn(mix_in), compile_fn(project)
        mix_out = compile_fn(mix_out) if moe else mix_out
    return Steps(mix_in, project, mix_out)
