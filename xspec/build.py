"""The one place that turns names into objects and checks that they fit together.

Two steps. :func:`check` finds every problem that can be found cheaply (config values,
registry names, the target checkpoint's headers, platform limits at the drafter's
effective gamma, the drafter's checkpoint) without allocating weights or caches, and
returns them as a list; the CLI runs it on every job of a sweep before the first job
starts. :func:`build` raises them together, then loads and wires the objects.

Optional hooks, found by attribute (plugins may provide them too):

* a model loader's ``preflight(model_cfg) -> list[str]``: the checkpoint from headers;
* a model loader's ``checkpoint_path(model_cfg) -> Path``: the directory whose
  config.json (``max_position_embeddings``) and tokenizer
  :func:`xspec.run.fit.context_fit` reads;
* a drafter class's ``preflight(spec_cfg, model_cfg) -> list[str]`` and
  ``default_gamma(spec_cfg, model_cfg) -> int`` (the gamma it will draft when
  ``spec.num_speculative_tokens`` is null; without the hook: the configured value or 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from xspec.config import RunConfig, validate
from xspec.engine.engine import Engine
from xspec.engine.memory import MemoryPlan, plan_memory, resolve_budget, weight_bytes
from xspec.engine.parallel import ParallelEngine
from xspec.errors import CheckpointError, ConfigError, UserError
from xspec.models.base import CapturePoint, TargetModel, configure_steps, modules_of
from xspec.parallel.expert import ExpertParallel, routed_expert_bytes
from xspec.parallel.lockstep import Lockstep
from xspec.parallel.runtime import SINGLE, Parallel, init_parallel
from xspec.parallel.topology import launch
from xspec.platforms import get_platform
from xspec.platforms.base import Platform
from xspec.registry import models, spec_methods
from xspec.spec.calibration import RegimeCheck
from xspec.spec.drafter import Drafter
from xspec.spec.schedule import AdaptiveVerify
from xspec.tokenizer import Tokenizer, load_tokenizer, missing_tokenizer

if TYPE_CHECKING:
    from xspec.engine.step_cost import Profile

# Rows a decoding state can roll back when the method's gamma is not set explicitly.
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


def effective_gamma(make_drafter: Any, spec_cfg: Any, model_cfg: Any) -> int:
    """The gamma the drafter will really use (its default when the config leaves it null)."""
    default_gamma = getattr(make_drafter, "default_gamma", None)
    if default_gamma is not None:
        return int(default_gamma(spec_cfg, model_cfg))
    return spec_cfg.num_speculative_tokens or 1


def check(cfg: RunConfig) -> list[str]:
    """Every problem of ``cfg`` that shows without loading weights (empty: it can be built)."""
    return [message for _, message in _checks(cfg)]


def _checks(cfg: RunConfig) -> list[tuple[type[UserError], str]]:
    """:func:`check`'s problems, each with the error class that names its kind."""
    try:
        validate(cfg)
    except ConfigError as e:  # unknown names or bad values: nothing more to check
        return [(ConfigError, p) for p in e.problems or [str(e)]]
    problems: list[tuple[type[UserError], str]] = []
    preflight_model = getattr(models.get(cfg.model.arch), "preflight", None)
    if preflight_model is not None:  # target checkpoint headers
        problems += [(CheckpointError, p) for p in preflight_model(cfg.model)]
    try:
        platform = get_platform(cfg.platform)
        make_drafter: Any = spec_methods.get(cfg.spec.method)
    except UserError as e:  # a platform that cannot run here, a broken plugin
        return [*problems, (type(e), str(e))]
    gamma = effective_gamma(make_drafter, cfg.spec, cfg.model)
    limits = platform.validate(dtype=cfg.model.dtype.value, num_speculative_tokens=gamma)
    problems += [(ConfigError, p) for p in limits]
    preflight = getattr(make_drafter, "preflight", None)
    if preflight is not None:  # drafter checkpoint checks, before the target is loaded
        problems += [(ConfigError, p) for p in preflight(cfg.spec, cfg.model)]
    if cfg.spec.adaptive.enabled:
        problems += [
            (ConfigError, p) for p in _adaptive_problems(cfg, make_drafter, platform, gamma)
        ]
    if cfg.spec.adaptive.enabled and (cfg.parallel.dp > 1 or cfg.parallel.ep > 1):
        problems.append(
            (
                ConfigError,
                "spec.adaptive=true is not supported with parallel.dp/ep > 1 yet (the "
                "step-cost profile and the ragged verify widths are per process); run it "
                "without torchrun, or set spec.adaptive=false",
            )
        )
    if cfg.parallel.ep > 1:
        problems += [(ConfigError, p) for p in _expert_parallel_problems(cfg, make_drafter)]
    return problems


def _expert_parallel_problems(cfg: RunConfig, make_drafter: Any) -> list[str]:
    """``parallel.ep > 1``: the target loader and the drafter must support it, and ``ep``
    must divide the expert count (checked from config.json, before anything is loaded)."""
    ep = cfg.parallel.ep
    count = getattr(models.get(cfg.model.arch), "num_routed_experts", None)
    problems = []
    if count is None:
        problems.append(
            f"parallel.ep={ep}: model.arch={cfg.model.arch} has no expert-parallel loader "
            "(supported: deepseek_v4); use parallel.ep=1 (parallel.dp still applies)"
        )
    elif (experts := count(cfg.model)) is not None and experts % ep:
        problems.append(
            f"parallel.ep={ep} does not divide the model's {experts} routed experts per layer "
            f"(config.json n_routed_experts); use a divisor of {experts}"
        )
    if not hasattr(make_drafter, "propose_forwards"):
        problems.append(
            f"parallel.ep={ep}: spec={cfg.spec.method} does not support expert parallelism "
            "(it does not declare its MoE forwards); use spec=none, mtp or dspark, or parallel.ep=1"
        )
    return problems


def _adaptive_problems(
    cfg: RunConfig, make_drafter: Any, platform: Platform, gamma: int
) -> list[str]:
    """``spec.adaptive`` with a method that cannot score its drafts; a profile file that
    was measured for another setup (the drafter's preflight checks its confidence head
    and calibration file)."""
    if not getattr(make_drafter, "supports_adaptive", False):
        return [
            f"spec.adaptive.enabled=true needs a drafter with a confidence head (spec=dspark "
            f"with a checkpoint that stores one); spec={cfg.spec.method} has none; set "
            f"spec.adaptive.enabled=false or pick spec=dspark"
        ]
    if cfg.spec.adaptive.profile is None:
        return []
    from xspec.engine.step_cost import profile_key, read_profile

    try:
        read_profile(Path(cfg.spec.adaptive.profile), profile_key(cfg, platform, gamma))
    except ConfigError as e:
        return [str(e)]
    return []


def build(cfg: RunConfig) -> Built:
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
    make_drafter: Any = spec_methods.get(cfg.spec.method)
    gamma = effective_gamma(make_drafter, cfg.spec, cfg.model)

    max_rollback = max(gamma, DEFAULT_MAX_ROLLBACK)
    shard: dict[str, Any] = {}  # this rank's experts only (the drafters follow the target)
    if parallel.topology.ep > 1:
        shard["expert_parallel"] = ExpertParallel(parallel)
    with torch.no_grad():  # not a global switch: training code may share the process
        target: TargetModel = models.get(cfg.model.arch)(
            cfg.model, device=platform.device(), max_rollback=max_rollback, **shard
        )
        drafter: Drafter = make_drafter(
            cfg.spec, target=target, model_cfg=cfg.model, platform=platform
        )
    _freeze(target, drafter)
    configure_steps([target, drafter], platform.step_options())
    if drafter.gamma > max_rollback:
        raise ConfigError(
            f"spec.num_speculative_tokens: the drafter proposes {drafter.gamma} tokens but the caches "
            f"were sized for {max_rollback}; set spec.num_speculative_tokens={drafter.gamma} explicitly"
        )
    capture = [platform.capture_point(layer_id) for layer_id in drafter.capture_layer_ids]
    tokenizer = _tokenizer(target, cfg.model)
    stop_ids = stop_ids_of(
        getattr(tokenizer, "stop_ids", None),
        getattr(tokenizer, "eos_id", None),
        getattr(getattr(target, "args", None), "eos_token_id", None),
    )
    plan = _plan(cfg, platform, target, drafter)
    profile = _profile(cfg, platform, target, drafter, capture, plan)
    kw: dict[str, Any] = dict(
        stop_ids=stop_ids,
        synchronize=platform.synchronize,
        plan=plan,
        decode=tokenizer.decode,
        check_sampling=_regime_check(drafter),
    )
    experts = routed_expert_bytes(target, drafter)
    if parallel.distributed:  # (spec.adaptive is refused there by _checks)
        lockstep = Lockstep(parallel, target, drafter)  # type: ignore[arg-type]
        engine: Engine = ParallelEngine(
            target, drafter, capture, parallel=parallel, lockstep=lockstep, **kw
        )
        per_rank = [row[0] for row in parallel.all_gather_ints([experts])]
    else:
        schedule = AdaptiveVerify(profile.cost) if profile is not None else None
        engine = Engine(target, drafter, capture, schedule=schedule, **kw)
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
    )


def _regime_check(drafter: Drafter) -> RegimeCheck | None:
    """Warns when requests sample otherwise than the drafter's calibration was fitted."""
    cal = getattr(drafter, "calibration", None)
    if cal is None:
        return None
    return RegimeCheck(cal, getattr(drafter, "calibration_file", None))


def _profile(
    cfg: RunConfig,
    platform: Platform,
    target: TargetModel,
    drafter: Drafter,
    capture: list[CapturePoint],
    plan: MemoryPlan,
) -> Profile | None:
    """``spec.adaptive``: the step-cost profile, for at most as many requests per step as
    the plan holds (short sequences) and ``spec.adaptive.max_requests``."""
    if not cfg.spec.adaptive.enabled:
        return None
    from xspec.engine.step_cost import CONTEXT, step_cost_profile

    fits = plan.max_seqs(CONTEXT, drafter.gamma + 1)
    max_requests = max(1, min(cfg.spec.adaptive.max_requests, fits))
    return step_cost_profile(cfg, platform, target, drafter, capture, max_requests)


def _plan(cfg: RunConfig, platform: Platform, target: TargetModel, drafter: Drafter) -> MemoryPlan:
    """The memory plan under ``engine.memory_budget``; MemoryBudgetError when not even one
    short sequence fits beside the weights."""
    weights = weight_bytes(target, drafter)
    budget = resolve_budget(
        cfg.engine.memory_budget,
        platform.memory_available(),
        weights,
        platform.default_memory_fraction,
    )
    plan = plan_memory(target, drafter, budget, weights)
    plan.check_one_sequence()
    return plan


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
    args = getattr(target, "args", None)
    ckpt = getattr(target, "checkpoint_dir", None)
    return load_tokenizer(
        Path(ckpt) if ckpt else None,
        target.vocab_size,
        getattr(args, "bos_token_id", None),
        getattr(args, "eos_token_id", None),
        kind=model_cfg.tokenizer.value,
        required=model_cfg.path is not None,  # a user checkpoint; presets have no tokenizer
    )
