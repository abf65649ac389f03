"""The one place that turns names into objects and checks that they fit together.

Two steps. :func:`check` finds every problem that can be found cheaply (config values,
registry names, the target checkpoint's headers, platform limits at the drafter's
effective gamma, the drafter's checkpoint, and whether the weights counted from the
headers plus one sequence fit the memory budget: :func:`layout_plan`) without reading a
tensor or allocating weights or caches, and returns them as a list; the CLI runs it on
every job of a sweep before the first job starts. :func:`build` raises them together, then loads and wires the objects.

What it asks, it asks through two typed interfaces (plugins implement the same ones):

* the target's :class:`~xspec.models.family.ModelFamily` (``models.get(model.arch)``):
  ``preflight`` (the checkpoint from headers), ``footprint`` (its weights and KV from
  headers, for the memory check), ``num_routed_experts`` and
  ``supports_expert_parallel`` (``parallel.ep``), ``checkpoint_path`` (the directory
  whose config.json and tokenizer :func:`xspec.run.fit.context_fit` reads), and
  ``load(..., steps=...)``;
* the method's :class:`~xspec.spec.drafter.Drafter` subclass
  (``spec_methods.get(spec.method)``): ``draft_depth`` (its default, maximum and trained
  gamma, which :func:`resolve_gamma` resolves the run's gamma from, once), ``preflight``,
  ``footprint``,
  ``supports_adaptive``, ``supports_expert_parallel``, then ``cls(spec_cfg, *, target, model_cfg, platform,
  steps)`` and the instance's ``calibration`` / ``calibration_file``.

The platform's step options are computed once and handed to both constructors.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from xspec.config import RunConfig, SpecConfig, gamma_schedule_problems, validate
from xspec.engine.engine import Engine
from xspec.engine.memory import (
    LayoutPlan,
    MemoryPlan,
    budget_of,
    cache_capacity,
    plan_memory,
    weight_bytes,
)
from xspec.engine.parallel import ParallelEngine
from xspec.engine.prefix_cache import PrefixCache
from xspec.errors import CheckpointError, ConfigError, MemoryBudgetError, UserError
from xspec.grammar import GrammarCompiler
from xspec.models.base import CapturePoint, TargetModel, modules_of
from xspec.models.family import ModelFamily
from xspec.parallel.expert import ExpertParallel, routed_expert_bytes
from xspec.parallel.lockstep import Lockstep
from xspec.parallel.runtime import SINGLE, Parallel, init_parallel
from xspec.parallel.topology import launch
from xspec.platforms import get_platform
from xspec.platforms.base import Platform
from xspec.registry import families_where, models, spec_methods
from xspec.spec.adaptive import AdaptiveDepth
from xspec.spec.adaptive.calibration import RegimeCheck
from xspec.spec.adaptive.online import OnlineStepCost
from xspec.spec.adaptive.profile import (
    Profile,
    profile_key,
    read_profile,
    step_cost_profile,
    workload_context,
)
from xspec.spec.drafter import Drafter
from xspec.spec.policy import DepthPolicy, FixedDepth
from xspec.tokenizer import Tokenizer, load_tokenizer, missing_tokenizer

log = logging.getLogger(__name__)

# Rows a decoding state can roll back at least (more when the run's gamma is larger).
DEFAULT_MAX_ROLLBACK = 8


@dataclass
class Built:
    cfg: RunConfig
    platform: Platform
    target: TargetModel
    drafter: Drafter
    capture: list[CapturePoint]
    tokenizer: Tokenizer
    engine: Engine
    profile: Profile | None = None  # spec.adaptive: the step-cost profile it schedules with
    parallel: Parallel = SINGLE
    expert_bytes: list[int] | None = None  # routed-expert bytes held by each rank
    # structured output: compiles a request's GrammarSpec for this tokenizer (cached)
    grammars: GrammarCompiler | None = None


@dataclass(frozen=True)
class Gamma:
    """A run's gamma (draft tokens per step), as :func:`resolve_gamma` resolved it."""

    value: int  # what the drafter proposes per step (0: it never drafts)
    problems: list[str]  # why the run cannot draft it (empty: fine)
    warning: str | None = None  # not the depth the draft was trained for

    def spec(self, spec_cfg: SpecConfig) -> SpecConfig:
        """``spec_cfg`` with ``num_speculative_tokens`` resolved: what the drafter's hooks
        and constructor read."""
        return replace(spec_cfg, num_speculative_tokens=self.value)


def resolve_gamma(
    cfg: RunConfig, drafter_cls: type[Drafter], platform: Platform | None = None
) -> Gamma:
    """The one place a run's gamma is resolved and checked: ``spec.num_speculative_tokens``,
    else the drafter's default (:meth:`~xspec.spec.drafter.Drafter.draft_depth`), against
    the drafter's maximum, the platform's (``capabilities.max_speculative_tokens``) and
    ``spec.gamma_schedule``'s entries; a warning when it is not the depth the draft was
    trained for. A drafter that never drafts (maximum 0) has gamma 0."""
    spec = cfg.spec
    depth = drafter_cls.draft_depth(spec, cfg.model)
    requested = spec.num_speculative_tokens
    gamma = depth.default if requested is None else requested
    key = f"spec.num_speculative_tokens={requested}"
    problems = []
    if requested is not None and requested < 1:
        problems.append(f"spec.num_speculative_tokens must be >= 1 (got {requested})")
    elif requested is not None and depth.maximum == 0:
        problems.append(
            f"{key} has no effect with spec={spec.method}; pick a drafter (spec=mtp) or drop "
            "the override"
        )
    elif depth.maximum is not None and gamma > depth.maximum:
        trained = f" ({depth.trained} = the trained setting)" if depth.trained else ""
        problems.append(
            f"{key}: spec={spec.method} drafts between 1 and {depth.maximum} tokens per step"
            f"{trained}; pick a value in that range"
        )
    if depth.maximum == 0:
        return Gamma(0, problems)
    if platform is not None and gamma > (limit := platform.capabilities.max_speculative_tokens):
        problems.append(
            f"spec.num_speculative_tokens={gamma} exceeds platform={platform.name}'s limit of "
            f"{limit}; lower it"
        )
    schedule = spec.gamma_schedule
    if schedule and not gamma_schedule_problems(schedule) and any(e[1] > gamma for e in schedule):
        problems.append(
            f"spec.gamma_schedule: an entry's gamma exceeds spec.num_speculative_tokens="
            f"{gamma} (got {schedule}); lower it or raise spec.num_speculative_tokens"
        )
    warning = None
    if requested is not None and depth.trained is not None and requested != depth.trained:
        warning = (
            f"{key}: this spec={spec.method} draft was trained to draft {depth.trained} per "
            "step; other values work but usually accept fewer tokens"
        )
    return Gamma(gamma, problems, warning)


def check(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg`` that shows without loading weights (empty: it can be built)."""
    return [message for _, message in _checks(cfg)]


def _checks(cfg: RunConfig) -> list[tuple[type[UserError], str]]:
    """:func:`check`'s problems, each with the error class that names its kind."""
    try:
        validate(cfg)
    except ConfigError as e:  # unknown names or bad values: nothing more to check
        return [(ConfigError, p) for p in e.problems or [str(e)]]
    try:
        family = models.get(cfg.model.arch)
    except UserError as e:  # a broken model plugin
        return [(type(e), str(e))]
    # target checkpoint headers
    problems: list[tuple[type[UserError], str]] = [
        (CheckpointError, p) for p in family.preflight(cfg.model)
    ]
    if not problems:  # its config.json reads: model.max_context against what it says
        problems += [(ConfigError, p) for p in max_context_problems(cfg, family)]
    try:
        platform = get_platform(cfg.platform)
        drafter_cls = spec_methods.get(cfg.spec.method)
    except UserError as e:  # a platform that cannot run here, a broken plugin
        return [*problems, (type(e), str(e))]
    gamma = resolve_gamma(cfg, drafter_cls, platform)
    problems += [(ConfigError, p) for p in platform.validate(dtype=cfg.model.dtype.value)]
    problems += [(ConfigError, p) for p in gamma.problems]
    # drafter checkpoint checks, before the target is loaded
    problems += [(ConfigError, p) for p in drafter_cls.preflight(gamma.spec(cfg.spec), cfg.model)]
    problems += [(ConfigError, p) for p in _depth_problems(cfg, drafter_cls, platform, gamma)]
    if cfg.parallel.ep > 1:
        problems += [(ConfigError, p) for p in expert_parallel_problems(cfg, family, drafter_cls)]
    if problems:
        return problems
    # the weights (from the headers) and one sequence must fit, before any tensor is read
    try:
        plan = layout_plan(
            cfg,
            free_before=_free_memory(cfg, platform),
            default_fraction=platform.default_memory_fraction,
        )
    except UserError as e:
        return [(type(e), str(e))]
    if plan is not None and (problem := plan.problem(cfg.model.dtype.value)):
        problems.append((MemoryBudgetError, problem))
    return problems


def _free_memory(cfg: RunConfig, platform: Platform) -> int:
    """The memory free on this rank's device now, when the budget depends on it (asked of
    the device the rank will use, as :func:`build` picks it); 0 when it does not."""
    budget, device = cfg.engine.memory_budget, cfg.engine.device_memory_gib
    if device is not None or (budget is not None and budget > 1):
        return 0
    if launch().world > 1:  # one device per process: not the first device of the node
        index = platform.rank_device_index(launch().local_rank)
        platform = get_platform(replace(cfg.platform, device_index=index))
    return platform.memory_available()


def layout_plan(
    cfg: RunConfig, *, free_before: int, default_fraction: float, world: int | None = None
) -> LayoutPlan | None:
    """The memory plan of every EP rank of ``cfg``'s layout, from config.json and the
    safetensors headers only (the family's and the drafter's ``footprint``); None when the
    family cannot say before loading. ``free_before``: the device memory free now (a
    fractional budget's base unless ``engine.device_memory_gib`` is set);
    ``default_fraction``: the platform's; ``world``: the ranks planned for (None: this
    launch's). Call it on a config whose checks passed."""
    family = models.get(cfg.model.arch)
    drafter_cls = spec_methods.get(cfg.spec.method)
    resolved = resolve_gamma(cfg, drafter_cls)
    gamma = resolved.value
    target = family.footprint(cfg.model, max_rollback=max(gamma, DEFAULT_MAX_ROLLBACK))
    if target is None:
        return None
    draft = drafter_cls.footprint(resolved.spec(cfg.spec), cfg.model, gamma)
    budget, source = budget_of(cfg.engine, free_before, default_fraction)
    return LayoutPlan(
        target,
        draft,
        gamma=gamma,
        budget=budget,
        budget_source=source,
        dp=cfg.parallel.dp,
        ep=cfg.parallel.ep,
        world=world if world is not None else launch().world,
    )


def checkpoint_config(family: ModelFamily, model_cfg: Any) -> tuple[Path | None, dict[str, Any]]:
    """The target checkpoint's directory and config.json, when the family names its
    directory (``checkpoint_path``) and the file reads as a JSON object; else (None, {})."""
    try:
        path = family.checkpoint_path(model_cfg)
        if path is None:
            return None, {}
        path = Path(path)
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UserError, OSError, ValueError, RecursionError):  # preflight reports the file
        return None, {}
    return (path, config) if isinstance(config, dict) else (None, {})


def trained_context(config: dict[str, Any]) -> int | None:
    """The context a checkpoint was trained for: config.json's ``max_position_embeddings``
    (which a YaRN-extended release such as DeepSeek-V4 sets to the extended length), or
    None when it does not say."""
    limit = config.get("max_position_embeddings")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def max_context_problems(cfg: RunConfig, family: ModelFamily) -> list[str]:
    """``model.max_context`` above the checkpoint's trained context is refused: positions
    past it were never trained, and the output degrades without any error. A checkpoint
    whose YaRN ``rope_scaling`` reaches further says so in config.json (the opt-in)."""
    wanted = cfg.model.max_context
    if wanted is None:
        return []
    _, config = checkpoint_config(family, cfg.model)
    limit = trained_context(config)
    if limit is None or wanted <= limit:
        return []
    hint = ""
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "yarn":
        factor, original = scaling.get("factor"), scaling.get("original_max_position_embeddings")
        if isinstance(factor, int | float) and isinstance(original, int | float):
            reach = int(factor * original)
            if reach > limit:
                hint = (
                    f". Its rope_scaling (YaRN, factor {factor:g} over {original:g} tokens) "
                    f"reaches {reach} tokens: to use them, set max_position_embeddings to "
                    f"{reach} in its config.json"
                )
    return [
        f"model.max_context={wanted} is above the checkpoint's trained context of {limit} "
        f"tokens (config.json max_position_embeddings): positions past it were never "
        f"trained and the output degrades without an error; set model.max_context <= "
        f"{limit} or leave it null{hint}"
    ]


def expert_parallel_problems(
    cfg: RunConfig, family: ModelFamily, drafter_cls: type[Drafter]
) -> list[str]:
    """``parallel.ep > 1``: the target loader and the drafter must support it, and ``ep``
    must divide the expert count (checked from config.json, before anything is loaded)."""
    ep = cfg.parallel.ep
    problems = []
    if not family.supports_expert_parallel:
        supported = ", ".join(f.arch for f in families_where(lambda f: f.supports_expert_parallel))
        problems.append(
            f"parallel.ep={ep}: model.arch={cfg.model.arch} has no expert-parallel loader "
            f"(supported: {supported}); use parallel.ep=1 (parallel.dp still applies)"
        )
    elif (experts := family.num_routed_experts(cfg.model)) is not None and experts % ep:
        problems.append(
            f"parallel.ep={ep} does not divide the model's {experts} routed experts per layer "
            f"(config.json n_routed_experts); use a divisor of {experts}"
        )
    if not drafter_cls.supports_expert_parallel:
        problems.append(
            f"parallel.ep={ep}: spec={cfg.spec.method} does not support expert parallelism "
            "(it does not declare its MoE forwards); use spec=none, mtp or dspark, or parallel.ep=1"
        )
    return problems


def _depth_problems(
    cfg: RunConfig, drafter_cls: type[Drafter], platform: Platform, gamma: Gamma
) -> list[str]:
    """``spec.adaptive`` (:func:`_adaptive_problems`) and ``spec.gamma_schedule``: both
    need every request's own depth, which lockstep under torchrun does not allow yet."""
    problems = []
    parallel = cfg.parallel.dp > 1 or cfg.parallel.ep > 1
    if cfg.spec.adaptive.enabled:
        problems += _adaptive_problems(cfg, drafter_cls, platform, gamma.value)
        if parallel:
            problems.append(
                "spec.adaptive=true is not supported with parallel.dp/ep > 1 yet (the "
                "step-cost profile and the ragged verify widths are per process); run it "
                "without torchrun, or set spec.adaptive=false"
            )
    if cfg.spec.gamma_schedule is not None and parallel:
        problems.append(
            "spec.gamma_schedule is not supported with parallel.dp/ep > 1 yet (every "
            "rank must draft the same block); run it without torchrun, or set "
            "spec.gamma_schedule=null"
        )
    return problems


def _adaptive_problems(
    cfg: RunConfig, drafter_cls: type[Drafter], platform: Platform, gamma: int
) -> list[str]:
    """``spec.adaptive`` with a method that cannot score its drafts; a profile file that
    was measured for another setup (the drafter's preflight checks its confidence head
    and calibration file)."""
    if not drafter_cls.supports_adaptive:
        return [
            f"spec.adaptive.enabled=true needs a drafter with a confidence head (spec=dspark "
            f"with a checkpoint that stores one); spec={cfg.spec.method} has none; set "
            f"spec.adaptive.enabled=false or pick spec=dspark"
        ]
    if cfg.spec.adaptive.profile is None:
        return []
    try:
        read_profile(Path(cfg.spec.adaptive.profile), profile_key(cfg, platform, gamma, None))
    except ConfigError as e:
        return [str(e)]
    return []


def build(cfg: RunConfig, *, depth_policy: DepthPolicy | None = None) -> Built:
    """Check ``cfg`` (every problem at once), then load and wire its objects.
    ``depth_policy``: how deep each request drafts, instead of the one the config
    selects (fixed gamma, or ``spec.adaptive`` / ``spec.gamma_schedule``'s)."""
    if problems := _checks(cfg):
        kinds = {kind for kind, _ in problems}
        kind = kinds.pop() if len(kinds) == 1 else ConfigError  # the one kind, else config
        raise kind("this run cannot be built:", problems=[p for _, p in problems])
    if problem := _tokenizer_problem(cfg.model):  # before loading any weights
        raise CheckpointError(problem)
    platform = get_platform(cfg.platform)
    parallel = init_parallel(cfg.parallel, platform)
    if parallel.distributed:  # one device per process
        index = platform.rank_device_index(launch().local_rank)
        platform = get_platform(replace(cfg.platform, device_index=index))
    drafter_cls = spec_methods.get(cfg.spec.method)
    gamma = resolve_gamma(cfg, drafter_cls, platform)
    if gamma.warning is not None:
        log.warning(gamma.warning)
    max_rollback = max(gamma.value, DEFAULT_MAX_ROLLBACK)
    shard: dict[str, Any] = {}  # this rank's experts only (the drafters follow the target)
    if parallel.topology.ep > 1:
        shard["expert_parallel"] = ExpertParallel(parallel)
    steps = platform.step_options()  # once: the target and the drafter share it
    with torch.no_grad():  # not a global switch: training code may share the process
        target = models.get(cfg.model.arch).load(
            cfg.model, device=platform.device(), max_rollback=max_rollback, steps=steps, **shard
        )
        drafter = drafter_cls(
            gamma.spec(cfg.spec), target=target, model_cfg=cfg.model, platform=platform, steps=steps
        )
    _freeze(target, drafter)
    if drafter.gamma != gamma.value:  # a plugin that ignored the resolved spec section
        raise ConfigError(
            f"spec={cfg.spec.method}: the drafter drafts {drafter.gamma} tokens per step, not "
            f"the run's gamma {gamma.value} (spec.num_speculative_tokens, else its "
            "draft_depth()); a drafter takes its gamma from spec_cfg.num_speculative_tokens"
        )
    capture = [platform.capture_point(layer_id) for layer_id in drafter.capture_layer_ids]
    tokenizer = _tokenizer(target, cfg.model)
    stop_ids = stop_ids_of(
        tokenizer.stop_ids,
        tokenizer.eos_id,
        target.args.eos_token_id,
    )
    plan = _plan(cfg, platform, target, drafter)
    profile = _profile(cfg, platform, target, drafter, capture, plan, tokenizer)
    kw: dict[str, Any] = dict(
        stop_ids=stop_ids,
        synchronize=platform.synchronize,
        plan=plan,
        max_prefill_tokens=cfg.engine.max_prefill_tokens,
        decode=tokenizer.decode,
        check_sampling=_regime_check(drafter),
        # fixed gamma under torchrun: _checks refuses spec.adaptive / gamma_schedule there
        policy=depth_policy or _depth_policy(cfg, drafter, profile, platform),
    )
    if not parallel.distributed:  # (lockstep: every rank prefills the same forwards)
        kw["prefix_cache"] = prefix_cache_of(cfg.engine, plan, target.prefix_granularity)
    experts = routed_expert_bytes(target, drafter)
    if parallel.distributed:
        lockstep = Lockstep(parallel, target, drafter)  # type: ignore[arg-type]
        engine: Engine = ParallelEngine(
            target, drafter, capture, parallel=parallel, lockstep=lockstep, **kw
        )
        per_rank = [row[0] for row in parallel.all_gather_ints([experts])]
    else:
        engine = Engine(target, drafter, capture, **kw)
        per_rank = [experts]
    return Built(
        cfg,
        platform,
        target,
        drafter,
        capture,
        tokenizer,
        engine,
        profile=profile,
        parallel=parallel,
        expert_bytes=per_rank,
        grammars=GrammarCompiler(tokenizer, target.vocab_size, cfg.spec.forced_tokens),
    )


def _regime_check(drafter: Drafter) -> RegimeCheck | None:
    """Warns when requests sample otherwise than the drafter's calibration was fitted."""
    if drafter.calibration is None:
        return None
    return RegimeCheck(drafter.calibration, drafter.calibration_file)


def _depth_policy(
    cfg: RunConfig, drafter: Drafter, profile: Profile | None, platform: Platform
) -> DepthPolicy:
    """How deep each request drafts (docs/adaptive.md): ``spec.adaptive`` decides each
    request's depth from the online step-cost model (and trims after drafting from the
    draft's confidences); ``spec.gamma_schedule`` caps the depth by batch size; neither:
    fixed gamma."""
    schedule = cfg.spec.gamma_schedule
    if profile is None and schedule is None:
        return FixedDepth()
    return AdaptiveDepth(
        drafter.gamma,
        cost=OnlineStepCost(profile.cost) if profile is not None else None,
        gamma_schedule=schedule,
        trim=profile is not None and cfg.spec.adaptive.trim,
        synchronize=platform.synchronize,
    )


def _profile(
    cfg: RunConfig,
    platform: Platform,
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    plan: MemoryPlan,
    tokenizer: Tokenizer,
) -> Profile | None:
    """``spec.adaptive``: the step-cost profile at the workload's context and sampling,
    for at most as many requests per step as the plan holds at that context and
    ``spec.adaptive.max_requests``."""
    a = cfg.spec.adaptive
    if not a.enabled:
        return None
    limit = target.max_context - drafter.gamma - 1
    context = a.profile_context or workload_context(cfg.workload, tokenizer.encode, limit)
    fits = plan.max_seqs(context, drafter.gamma + 1)
    max_requests = max(1, min(a.max_requests, fits))
    return step_cost_profile(cfg, platform, target, drafter, capture, max_requests, context)


def _plan(cfg: RunConfig, platform: Platform, target: TargetModel, drafter: Drafter) -> MemoryPlan:
    """The memory plan under ``engine.memory_budget``; MemoryBudgetError when not even one
    short sequence fits beside the weights."""
    weights = weight_bytes(target, drafter)
    free_before = platform.memory_available() + weights
    budget, _ = budget_of(cfg.engine, free_before, platform.default_memory_fraction)
    plan = plan_memory(target, drafter, budget, weights)
    plan.check_one_sequence()
    return plan


def prefix_cache_of(engine: Any, plan: MemoryPlan, granularity: int) -> PrefixCache | None:
    """The ``engine`` section's prefix cache (None: ``engine.prefix_cache=false``): at most
    ``prefix_cache_gib``, else a quarter of the plan's memory for caches. ConfigError for a
    block the model cannot snapshot at, or a cache that cannot hold one block."""
    if not engine.prefix_cache:
        return None
    block = engine.prefix_block
    if block % granularity:
        raise ConfigError(
            f"engine.prefix_block={block}: the model snapshots its state every "
            f"{granularity} tokens (its compression ratios); use a multiple of {granularity}"
        )
    capacity = cache_capacity(engine, plan)
    one_block = plan.block_bytes(block)
    if capacity < one_block:
        raise ConfigError(
            f"the prefix cache ({capacity} bytes: "
            + (
                f"engine.prefix_cache_gib={engine.prefix_cache_gib:g}"
                if engine.prefix_cache_gib is not None
                else f"a quarter of the plan's {max(0, plan.available)} bytes for caches"
            )
            + f") cannot hold one block of {block} tokens ({one_block} bytes); raise "
            "engine.prefix_cache_gib or engine.memory_budget, lower engine.prefix_block, "
            "or turn it off with engine.prefix_cache=false"
        )
    return PrefixCache(block, capacity)


def stop_ids_of(*sources: object) -> frozenset[int]:
    """Every token id that ends a generation, from whatever the tokenizer and the model
    config expose: None, one id, or a list/set of ids (``eos_token_id`` of Qwen3
    instruct checkpoints lists several)."""
    ids: set[int] = set()
    for source in sources:
        if source is None:
            continue
        if isinstance(source, int) and not isinstance(source, bool):
            ids.add(source)
        elif isinstance(source, Iterable) and not isinstance(source, str | bytes):
            ids.update(stop_ids_of(*source))
        else:
            raise ConfigError(
                f"a stop / eos token id must be an int or a list of ints, got {source!r}"
            )
    return frozenset(ids)


def _freeze(*parts: Any) -> None:
    """No parameter of an inference run records autograd history."""
    for module in modules_of(parts):
        module.requires_grad_(False)


def _tokenizer_problem(model_cfg: Any) -> str | None:
    """A user checkpoint (``model.path``) without tokenizer.json, unless model.tokenizer=byte."""
    path = Path(model_cfg.path) if model_cfg.path else None
    if path is None or not path.is_dir() or model_cfg.tokenizer.value != "auto":
        return None
    return missing_tokenizer(path)


def _tokenizer(target: TargetModel, model_cfg: Any) -> Tokenizer:
    return load_tokenizer(
        target.checkpoint_dir,
        target.vocab_size,
        target.args.bos_token_id,
        target.args.eos_token_id,
        kind=model_cfg.tokenizer.value,
        required=model_cfg.path is not None,  # a user checkpoint; presets have no tokenizer
    )
