"""``python -m xspec.plan model=... spec=... parallel.dp=4 parallel.ep=16 [options]``

The memory plan of a run on a DP x EP layout, without loading anything: it needs only
``config.json``, the safetensors index and the tensor headers of the target and the
draft (never tensor data), so it can plan a machine that is not this one. The overrides
are composed exactly as ``python -m xspec`` composes them (xspec/compose.py); the
checkpoint and the drafter are checked from their headers as a run checks them; the
platform need not be present here.

It prints, for every EP rank, the weights by storage format (``w8a8``, ``fp8``,
``mxfp4`` with their scales, ``bf16``, ``fp32``, ``int``), the KV bytes per sequence
(per token and fixed, target + draft), what is left for caches and the largest
concurrency at ``--context`` tokens per sequence (see
:class:`xspec.engine.memory.LayoutPlan`). Options:

* ``--world N``: ranks in the layout, 1 to :data:`MAX_WORLD` (default: the least
  multiple of ``parallel.dp`` and ``parallel.ep``);
* ``--context L``: tokens per sequence, prompt + generated, 1 to the model's context
  (``model.max_context``, else the checkpoint's ``max_position_embeddings``; default:
  ``workload.input_len + workload.output_len``, at most the model's context); each is
  charged ``L + gamma``;
* ``--json FILE``: also write the plan as JSON (``-``: to stdout instead of the text).

The per-rank budget is ``engine.memory_budget`` in bytes, or its fraction (null: the
platform's default) of ``engine.device_memory_gib``, which a plan for another machine
must then set, e.g. ``engine.device_memory_gib=64``. Exit codes: 0 the layout fits,
2 a user error or a layout whose weights plus one sequence do not fit (the plan is
printed, then the reason), 1 an output file that could not be written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from xspec.errors import ConfigError, MemoryBudgetError, OutputError, UserError

if TYPE_CHECKING:
    from xspec.config import ParallelConfig, RunConfig

# The most ranks a plan describes: 2**20, ten times the largest accelerator clusters
# built so far (~10^5); the plan lists the world ranks of every EP rank, so an
# unbounded --world would allocate without end.
MAX_WORLD = 1 << 20
# The longest --context when the model's family does not report its context: 2**30
# tokens, a hundred times the longest context of any model so far.
MAX_CONTEXT = 1 << 30


def _arguments(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m xspec.plan",
        description="Memory plan of a DP x EP layout from config.json and safetensors "
        "headers (nothing is loaded). Other arguments are config overrides (key=value).",
    )
    parser.add_argument("--world", type=int, help="ranks in the layout")
    parser.add_argument("--context", type=int, help="tokens per sequence")
    parser.add_argument("--json", dest="json_path", help="write the plan as JSON ('-': stdout)")
    args, overrides = parser.parse_known_args(argv)
    if bad := [o for o in overrides if o.startswith("-") or "=" not in o]:
        raise ConfigError(
            f"unknown argument {bad[0]!r}; give --world N, --context L, --json FILE and "
            "key=value overrides (python -m xspec.plan --help)"
        )
    if args.world is not None and not 1 <= args.world <= MAX_WORLD:
        raise ConfigError(
            f"--world must be between 1 and {MAX_WORLD} ranks (got {args.world}); give the "
            "number of ranks of the layout, or leave it out for the least multiple of "
            "parallel.dp and parallel.ep"
        )
    if args.context is not None and args.context < 1:
        raise ConfigError(
            f"--context must be >= 1 token (got {args.context}); give the tokens per "
            "sequence, or leave it out for workload.input_len + workload.output_len"
        )
    return args, overrides


def plan_text(argv: list[str]) -> tuple[str, dict, str | None, str | None]:
    """(printed plan, JSON plan, the problem when it does not fit, ``--json`` target)."""
    from xspec.build import expert_parallel_problems, layout_plan, max_context_problems
    from xspec.compose import compose_run
    from xspec.config import validate
    from xspec.registry import models, platforms, spec_methods

    args, overrides = _arguments(argv)
    cfg = compose_run(overrides)
    world = args.world if args.world is not None else _default_world(cfg.parallel)
    validate(cfg, world=world)
    family = models.get(cfg.model.arch)
    drafter_cls = spec_methods.get(cfg.spec.method)
    problems = family.preflight(cfg.model) or max_context_problems(cfg, family)
    problems += drafter_cls.preflight(cfg.spec, cfg.model)
    if cfg.parallel.ep > 1:
        problems += expert_parallel_problems(cfg, family, drafter_cls)
    budget = cfg.engine.memory_budget
    if cfg.engine.device_memory_gib is None and (budget is None or budget <= 1):
        problems.append(
            "the plan needs the memory of one device: set engine.device_memory_gib (e.g. "
            "engine.device_memory_gib=64) or engine.memory_budget in bytes"
        )
    if problems:
        raise ConfigError("this layout cannot be planned:", problems=problems)
    fraction = platforms.get(cfg.platform.name).default_memory_fraction
    plan = layout_plan(cfg, free_before=0, default_fraction=fraction, world=world)
    if plan is None:
        raise ConfigError(
            f"model.arch={cfg.model.arch}: its family cannot count its weights from the "
            "checkpoint headers (ModelFamily.footprint), so there is nothing to plan"
        )
    context = _context(args.context, cfg, plan.target.max_context)
    return (
        plan.describe(context),
        plan.to_json(context),
        plan.problem(cfg.model.dtype.value),
        (args.json_path),
    )


def _default_world(p: ParallelConfig) -> int:
    """The least multiple of ``parallel.dp`` and ``parallel.ep`` (1 when either is below 1:
    ``validate`` names that), refused beyond :data:`MAX_WORLD`."""
    world = math.lcm(p.dp, p.ep) if p.dp >= 1 and p.ep >= 1 else 1
    if world > MAX_WORLD:
        raise ConfigError(
            f"parallel.dp={p.dp} and parallel.ep={p.ep} need a world of {world} ranks (their "
            f"least common multiple), more than the {MAX_WORLD} a plan describes; lower them "
            "or give --world N"
        )
    return world


def _context(given: int | None, cfg: RunConfig, model_context: int) -> int:
    """``--context`` (checked against the model's context, ``model_context``; 0: unknown,
    then :data:`MAX_CONTEXT`), else the workload's input + output lengths, capped to it."""
    limit = model_context if model_context > 0 else MAX_CONTEXT
    if given is None:
        return min(cfg.workload.input_len + cfg.workload.output_len, limit)
    if given > limit:
        if model_context <= 0:
            source = "the most a plan describes: this model's family does not say its own"
        elif cfg.model.max_context is not None:
            source = f"model.max_context={cfg.model.max_context}"
        else:
            source = "the checkpoint's max_position_embeddings"
        raise ConfigError(
            f"--context {given} is longer than the model's context of {limit} tokens "
            f"({source}), so no sequence can have it; give --context <= {limit}"
        )
    return given


def main(argv: list[str] | None = None) -> int:
    from xspec import atomic

    try:
        text, data, problem, json_path = plan_text(sys.argv[1:] if argv is None else argv)
        if json_path == "-":
            print(json.dumps(data, indent=2))
        else:
            print(text)
            if json_path is not None:
                atomic.write_json(Path(json_path), data)
                print(f"xspec: plan in {json_path}")
        if problem is not None:
            raise MemoryBudgetError(problem)
    except (UserError, OutputError) as e:
        print(f"xspec: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
