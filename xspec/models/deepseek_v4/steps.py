"""The stateless step functions of a DeepSeek-V4 block, run eagerly or compiled.

A block's forward alternates stateless tensor math with cache reads and writes
(:meth:`Block.forward`): ``mix_in`` (mHC collapse + norm), ``project`` (every per-row
projection of the attention input), the attention core over the caches (eager: its
index sets change every step), then ``mix_out`` (output projection, mHC expand, the FFN
site's collapse, norm, MoE, expand). :class:`Steps` holds the first, second and fourth
as callables taking the module as their first argument, and the platform's fused
kernels for the eager code. ``EAGER`` calls the methods; :func:`steps_for` wraps the
same functions with a platform's compiler where ``platform.compile`` says so, and
because they are plain functions of (module, tensors), one compiled graph serves every
layer of the same kind (guards see the module's static attributes, not its identity).

Under expert parallelism ``mix_out`` stays eager: the MoE exchanges rows with the other
ranks in the middle of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from xspec.models.base import StepOptions

if TYPE_CHECKING:
    from xspec.models.deepseek_v4.attention import Attention, Projected
    from xspec.models.deepseek_v4.model import Block


def mix_in(block: Block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block.mix_in(x)


def project(
    attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, phase: Any
) -> Projected:
    return attn.project(x, cos, sin, phase)


def mix_out(
    block: Block,
    out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    x: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    input_ids: torch.Tensor,
) -> torch.Tensor:
    return block.mix_out(out, cos, sin, x, post, comb, input_ids)


class Steps:
    """Where a block's stateless steps run (see the module docstring)."""

    def __init__(
        self,
        mix_in: Callable[..., Any] = mix_in,
        project: Callable[..., Any] = project,
        mix_out: Callable[..., Any] = mix_out,
        *,
        kernels: dict[str, Any] | None = None,
        compiled: bool = False,
    ) -> None:
        self.mix_in = mix_in
        self.project = project
        self.mix_out = mix_out
        self.kernels = kernels or {}  # the platform's fused kernels (eager code only)
        self.is_compiled = compiled


@functools.lru_cache(maxsize=32)
def steps_for(options: StepOptions, *, moe: bool) -> Steps:
    """The one :class:`Steps` of ``options`` (all blocks share it, so a compiler's
    guards see the same object in every layer); ``moe=False`` keeps ``mix_out`` eager
    (expert parallelism)."""
    if options.compile is None:
        return Steps(kernels=options.kernels)
    compile_fn = options.compile
    return Steps(
        compile_fn(mix_in),
        compile_fn(project),
        compile_fn(mix_out) if moe else mix_out,
        kernels=options.kernels,
        compiled=True,
    )


EAGER = Steps()
