"""Typed configuration schemas, registered in Hydra's ConfigStore.

One ``kw_only`` dataclass per config group; choices are str Enums (OmegaConf 2.3
rejects ``Literal``); required values are ``MISSING``. The YAML files under the
top-level ``conf/`` (:func:`config_dir`) hold values only and select plugins by *name*
(registry keys), never by import path.

``to_typed`` is the single conversion point from a composed ``DictConfig`` to these
dataclasses. It refuses keys that the schema would silently drop, and ``validate``
collects *every* problem of a run config into one :class:`ConfigError` before anything
heavy (weights, caches, devices) is touched.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass, field, fields, is_dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from xspec.errors import ConfigError

GIB = 1 << 30


class DType(str, enum.Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class NativeSas(str, enum.Enum):
    """DSv4 draft-window sparse attention mode (NPU only; see docs/npu.md)."""

    auto = "auto"
    on = "on"
    off = "off"


class StepCompile(str, enum.Enum):
    """``platform.compile``: compile the models' stateless step functions (torch.compile
    with the platform's backend). auto = the platform's default (on where it pays: CUDA;
    off on the host CPU, where per-region overhead eats the gain, see docs/performance.md)."""

    auto = "auto"
    on = "on"
    off = "off"


class StepKernels(str, enum.Enum):
    """``platform.kernels``: auto = the platform's fused kernels where they are available
    (the CPU platform's native mHC, RMSNorm, RoPE, indexer top-k, sparse attention, MoE
    and compressor pooling kernels, built on first use); reference = the torch reference
    ops everywhere (for comparison and debugging)."""

    auto = "auto"
    reference = "reference"


class QuantCompute(str, enum.Enum):
    """``model.quant_compute``: how weights a checkpoint stores quantized (FP8, MXFP4,
    W8A8; kept resident as stored) compute (docs/checkpoints.md)."""

    auto = "auto"  # the platform's native quantized op where it has one, else dequant
    dequant = "dequant"  # dequantize one weight per call, float op: exact vs the float model
    native = "native"  # quantize activations as the format prescribes (FP8 / int8 per token)


class TokenizerKind(str, enum.Enum):
    """``model.tokenizer``: where text <-> ids comes from (see xspec/tokenizer.py)."""

    auto = "auto"  # the checkpoint's tokenizer.json (required for model.path); presets: bytes
    byte = "byte"  # raw UTF-8 bytes as ids, explicitly (toy checkpoints without a tokenizer)


@dataclass(kw_only=True)
class ModelConfig:
    """``model=<preset>``: which architecture, which checkpoint."""

    arch: str = MISSING  # models registry key: qwen3 | deepseek_v4 | <plugin>
    path: str | None = None  # checkpoint directory; null = the built-in ``preset``
    preset: str | None = None  # built-in tiny checkpoint generated on first use
    dtype: DType = DType.float32
    max_context: int | None = None  # null = the model's limit (capped to keep caches small)
    tokenizer: TokenizerKind = TokenizerKind.auto
    quant_compute: QuantCompute = QuantCompute.auto  # quantized checkpoints only


class Calibration(str, enum.Enum):
    """``spec.adaptive.calibration`` keywords (any other value is a file path)."""

    auto = "auto"  # confidence_calibration.json next to the draft weights, when present
    off = "off"  # raw confidences (reported as uncalibrated)


@dataclass(kw_only=True)
class AdaptiveConfig:
    """``spec.adaptive``: confidence-scheduled verification (docs/adaptive.md).

    ``spec.adaptive=true`` on the command line is shorthand for ``spec.adaptive.enabled=true``
    (:func:`xspec.compose.normalise_override`)."""

    enabled: bool = False
    # step-cost profile JSON to reuse; null = the cached one for this model, platform and
    # dtype under $XSPEC_CACHE_DIR/step_cost, else measured at engine start (and cached)
    profile: str | None = None
    calibration: str = Calibration.auto.value  # auto | off | path to a calibration JSON
    max_requests: int = 64  # the profile covers 1..this many requests per step (and the plan's)
    profile_reps: int = 5  # timed forwards per profile point (their median is kept)
    # after drafting, Algorithm 1 trims each verified prefix from the draft's confidences;
    # false: the depth decided before drafting is verified whole
    trim: bool = True
    # committed tokens of the profile's dummy sequences; null = the workload's mean prompt
    # length + half its max_new_tokens (the context its decode steps run at)
    profile_context: int | None = None


@dataclass(kw_only=True)
class SpecConfig:
    """``spec=<method>``: the speculative method and its options."""

    method: str = MISSING  # spec_methods registry key: none | mtp | oracle | wrong | <plugin>
    # gamma; null = the method's / checkpoint's trained default (MTP: 1)
    num_speculative_tokens: int | None = None
    draft_path: str | None = None  # null = the target directory (drafter stored with the target)
    adaptive: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    # a static rule, batch size -> gamma (vLLM's num_speculative_tokens_per_batch_size):
    # [[min_batch, gamma], ...], ascending min_batch, the first at 1; a step of B requests
    # drafts the gamma of the last entry with min_batch <= B (0 = no draft); null = off
    gamma_schedule: list[list[int]] | None = None
    # structured output: tokens the grammar forces are proposed without the drafter (one-hot
    # drafts, accepted for certain; at most gamma a step); false = only the drafter's drafts
    forced_tokens: bool = True
    # structured output: the drafter masks its own proposals with the grammar, position by
    # position (each draft conditions on an allowed one); false = drafts proposed unmasked
    # (the verify rows stay masked: outputs are the same, a forbidden draft is rejected)
    mask_drafts: bool = True


@dataclass(kw_only=True)
class PlatformConfig:
    """``platform=<name>``: where it runs."""

    name: str = MISSING  # platforms registry key: auto | cpu | cuda | npu | <plugin>
    device_index: int = 0
    native_sas: NativeSas = NativeSas.auto
    compile: StepCompile = StepCompile.auto
    kernels: StepKernels = StepKernels.auto
    # every row of the target's forward computed as it would be alone (GEMM rows padded to
    # the platform's invariant tile): logprobs under speculation and batching equal
    # spec=none's bit for bit, at a cost per step (docs/sampling.md); eager steps only
    batch_invariant: bool = False


@dataclass(kw_only=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = 0  # per-request seeds are seed + request index; null = nondeterministic
    # logits processors, exact under speculation (docs/usage.md "Sampling parameters")
    presence_penalty: float = 0.0  # [-2, 2]; 0 = off
    frequency_penalty: float = 0.0  # [-2, 2]; 0 = off
    repetition_penalty: float = 1.0  # (0, 10]; 1 = off
    # [token id, bias] pairs, bias in [-100, 100]: sampling.logit_bias=[[5,2.0],[7,-100]]
    logit_bias: list[Any] = field(default_factory=list)
    min_tokens: int = 0  # EOS masked until this many tokens are generated

    def to_params(self) -> Any:
        """These settings as the :class:`xspec.sampling.SamplingParams` of one request."""
        from xspec.sampling import SamplingParams, as_logit_bias

        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=as_logit_bias(dict(_pairs(self.logit_bias))),
            min_tokens=self.min_tokens,
        )


def _pairs(entries: Any) -> list[tuple[Any, Any]]:
    """``sampling.logit_bias``'s ``[id, bias]`` entries; a malformed one is kept as
    ``(entry, None)`` so that the range check names it."""
    return [
        (e[0], e[1]) if isinstance(e, list | tuple) and len(e) == 2 else (repr(e), None)
        for e in entries
    ]


class WorkloadKind(str, enum.Enum):
    """``workload.kind``: where the requests come from (see xspec/run/workloads.py)."""

    prompts = "prompts"  # workload.prompts, or the JSONL workload.prompts_file
    synthetic = "synthetic"  # random token ids: input_len in, output_len out


@dataclass(kw_only=True)
class WorkloadConfig:
    """What the CLI's main job generates."""

    kind: WorkloadKind = WorkloadKind.prompts
    prompts: list[str] = field(default_factory=list)  # text prompts, cycled over requests
    # JSONL, one {"prompt": str} or {"prompt_token_ids": [int]} per line (optional
    # "max_new_tokens"); replaces workload.prompts, cycled over requests like them
    prompts_file: str | None = None
    input_len: int = 128  # synthetic: prompt tokens per request
    output_len: int = 128  # synthetic: generated tokens per request (EOS ignored)
    seed: int = 0  # synthetic: the random prompts' seed
    num_requests: int = 4
    concurrency: int = 4  # requests decoded together (continuous batching)
    max_new_tokens: int = 32
    ignore_eos: bool = False
    print_outputs: bool = True
    warmup_requests: int = 1  # a short unmeasured generation first (0 = none); metrics reset after
    repeats: int = 1  # measured runs of the workload; figures are medians with their spread
    stop: list[str] = field(default_factory=list)  # an output ends at the first of these strings


@dataclass(kw_only=True)
class EngineConfig:
    """``engine``: how the engine plans memory (xspec/engine/memory.py)."""

    # bytes for weights + KV caches + step workspace when > 1; a fraction of the device
    # memory free before loading when in (0, 1]; null = the platform's default fraction
    # (CPU: 0.5 of available RAM)
    memory_budget: float | None = None
    # the memory of one device (GiB) that a fractional memory_budget is taken of; null =
    # what the platform reports free before loading. Set it to plan for another machine
    # (python -m xspec.plan) or to pin the budget of a shared host
    device_memory_gib: float | None = None
    # prompt tokens one prefill iteration takes in (its first request always, however
    # long); null = every waiting request a slot and the memory plan allow (why 2048:
    # docs/architecture.md, the engine)
    max_prefill_tokens: int | None = 2048
    # the prefix cache (docs/prefix_cache.md): a new request restores the model and
    # drafter state of the longest prompt prefix cached at a block boundary and prefills
    # only the rest; false = every prompt prefilled whole, in max_prefill_tokens chunks
    prefix_cache: bool = True
    # the most memory it holds (GiB); null = a quarter of the plan's memory for caches and
    # workspace. It gives way to the requests' reservations whatever its size
    prefix_cache_gib: float | None = None
    # prompt tokens per cached block (a multiple of the model's compression ratios); a
    # cache-enabled prefill runs one block per forward
    prefix_block: int = 256


@dataclass(kw_only=True)
class MetricsConfig:
    """``metrics.port``: serve Prometheus text at http://host:port/metrics during the run."""

    port: int | None = None  # null = no exporter; 0 = any free port (printed)
    host: str = "127.0.0.1"  # loopback: reachable from this machine only


@dataclass(kw_only=True)
class ServerConfig:
    """``server``: ``python -m xspec.serve``, the OpenAI-compatible HTTP server
    (docs/serving.md)."""

    host: str = "127.0.0.1"  # loopback; 0.0.0.0 exposes it to the network
    port: int = 8000  # 0 = any free port (printed)
    concurrency: int = 32  # requests decoded together (continuous batching)
    max_queue: int = 256  # requests waiting beyond those; more get 503 + Retry-After
    request_timeout_s: float = 600.0  # a request running longer is aborted (504)
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    default_max_tokens: int = 256  # max_tokens when a request leaves it out
    # on SIGINT / SIGTERM, requests in flight get this long to finish, then are aborted
    shutdown_grace_s: float = 5.0
    # the name clients pass as "model" (null: the model option, e.g. dsv4_tiny)
    served_model_name: str | None = None
    # a request's head and body must arrive within this long of the connection opening
    # (or of its previous response); else 408 and the connection is closed
    read_timeout_s: float = 30.0
    max_connections: int = 1024  # more open connections get 503 and are closed at once
    # the checkpoint's Jinja chat template renders in a process of its own: a render
    # running longer is stopped (400), and the process may use this much memory
    template_timeout_s: float = 2.0
    template_memory_mib: int = 512  # 0 = unlimited


class MoeExchange(str, enum.Enum):
    """``parallel.moe_exchange``: how expert-parallel MoE layers move token rows."""

    auto = "auto"  # all_to_all where the platform's backend has it, else all_gather
    all_to_all = "all_to_all"  # rows go only to the rank owning their expert
    all_gather = "all_gather"  # every rank gathers every rank's rows (exact, EP x traffic)


@dataclass(kw_only=True)
class ParallelConfig:
    """``parallel``: data x expert parallelism under torchrun (docs/parallel.md).

    Without torchrun (one process) both sizes must be 1. ``dp`` replicas split the
    requests round-robin; ``ep`` ranks split every MoE layer's experts. Both divide the
    world size; a replica spans ``world / dp`` ranks, an EP group ``ep`` consecutive ranks.
    """

    dp: int = 1  # data-parallel replicas (request streams)
    ep: int = 1  # expert-parallel group size (ranks sharing one copy of the experts)
    timeout_s: float = 300.0  # a collective waiting longer than this fails the run
    backend: str = "auto"  # torch.distributed backend; auto = the platform's (gloo/nccl/hccl)
    moe_exchange: MoeExchange = MoeExchange.auto


@dataclass(kw_only=True)
class RunConfig:
    model: ModelConfig = MISSING
    spec: SpecConfig = MISSING
    platform: PlatformConfig = MISSING
    workload: WorkloadConfig = MISSING
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


_GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "spec": SpecConfig,
    "platform": PlatformConfig,
    "workload": WorkloadConfig,
    "sampling": SamplingConfig,
    "metrics": MetricsConfig,
    "engine": EngineConfig,
    "parallel": ParallelConfig,
    "server": ServerConfig,
}


def server_problems(v: ServerConfig) -> list[str]:
    out = []
    if not 0 <= v.port <= 65535:
        out.append(f"server.port must be in 0..65535 (got {v.port}; 0 = any free port)")
    for key, value, low in (
        ("server.concurrency", v.concurrency, 1),
        ("server.max_queue", v.max_queue, 0),
        ("server.max_body_bytes", v.max_body_bytes, 1024),
        ("server.default_max_tokens", v.default_max_tokens, 1),
        ("server.max_connections", v.max_connections, 1),
    ):
        if value < low:
            out.append(f"{key} must be >= {low} (got {value})")
    if not v.request_timeout_s > 0:
        out.append(f"server.request_timeout_s must be > 0 seconds (got {v.request_timeout_s})")
    if not 0 <= v.shutdown_grace_s <= 3600:
        out.append(f"server.shutdown_grace_s must be in 0..3600 seconds (got {v.shutdown_grace_s})")
    for key, seconds, most in (
        ("server.read_timeout_s", v.read_timeout_s, 3600),
        ("server.template_timeout_s", v.template_timeout_s, 600),
    ):
        if not 0 < seconds <= most:
            out.append(f"{key} must be in (0, {most}] seconds (got {seconds})")
    if v.template_memory_mib != 0 and v.template_memory_mib < 64:
        out.append(
            f"server.template_memory_mib must be >= 64 (its process needs ~30) or 0 = "
            f"unlimited (got {v.template_memory_mib})"
        )
    if v.served_model_name is not None and not v.served_model_name.strip():
        out.append("server.served_model_name is empty; give a name or null (the model option)")
    return out


def config_dir() -> Path:
    """The Hydra YAML: ``conf/`` of the source checkout when xspec runs from one (``python
    -m xspec`` in the repository, an editable install), else the copy a wheel installs as
    the package ``xspec.conf`` (pyproject maps that package to ``conf/``)."""
    root = Path(__file__).resolve().parents[1]
    if (root / "pyproject.toml").is_file() and (root / "conf" / "config.yaml").is_file():
        return root / "conf"
    return Path(str(resources.files("xspec.conf")))


def register_configs() -> None:
    """Register the schemas; YAML options extend them with ``defaults: [/schema/<group>@_here_]``.

    Out-of-tree platforms, models and spec methods (entry points) have no YAML file in
    xspec; each registry name without one gets a generated group option, so
    ``platform=<plugin name>`` or ``model=<plugin name>`` selects it like a built-in. A
    generated model option is ``ModelConfig(arch=name)``: it has no preset, so
    ``model.path`` is required. Listing registry names reads package metadata only
    (nothing is imported).
    """
    from xspec.registry import models, platforms, spec_methods

    cs = ConfigStore.instance()
    cs.store(name="run_schema", node=RunConfig)
    for group, schema in _GROUPS.items():
        cs.store(group="schema", name=group, node=schema)
    conf = config_dir()
    for group, reg, make in (
        ("platform", platforms, lambda n: PlatformConfig(name=n)),
        ("spec", spec_methods, lambda n: SpecConfig(method=n)),
        ("model", models, lambda n: ModelConfig(arch=n)),
    ):
        for name in reg.names():
            if not (conf / group / f"{name}.yaml").is_file():
                cs.store(group=group, name=name, node=make(name))


def _dropped_keys(raw: Any, typed: Any, prefix: str) -> list[str]:
    """Keys present in the composed config that the dataclass has no field for."""
    if not (isinstance(raw, dict) and is_dataclass(typed)):
        return []
    names = {f.name for f in fields(typed)}
    out = [f"{prefix}{k}" for k in raw if k not in names]
    for k in names & raw.keys():
        out += _dropped_keys(raw[k], getattr(typed, k), f"{prefix}{k}.")
    return out


def to_typed(cfg: DictConfig) -> RunConfig:
    """The one conversion from a composed config to the typed :class:`RunConfig`."""
    raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    merged = OmegaConf.merge(OmegaConf.structured(RunConfig), raw)
    typed = OmegaConf.to_object(merged)
    assert isinstance(typed, RunConfig)
    dropped = _dropped_keys(raw, typed, "")
    if dropped:
        raise ConfigError("unknown config keys (they would be ignored):", problems=dropped)
    return typed


# The most memory one device (or host) may be said to have: 1 PiB, thousands of times the
# largest accelerator's and far above any host's RAM; a budget beyond it is a typo, and
# 1e300 GiB in bytes is not even a finite float.
MAX_MEMORY_GIB = 1 << 20
# A workload's requests are planned (prompts, seeds, lengths) before the first step, so
# their count is bounded like any other size: a million requests is hours of serving.
MAX_WORKLOAD_REQUESTS = 1_000_000
MAX_WORKLOAD_REPEATS = 1000


def engine_problems(e: EngineConfig) -> list[str]:
    """The ``engine`` section's ranges: memory in (0, 1 PiB], prefill tokens >= 1."""
    out = []
    budget, device = e.memory_budget, e.device_memory_gib
    if budget is not None and budget <= 0:
        out.append(
            f"engine.memory_budget must be > 0: bytes, or a fraction of free memory in (0, 1] "
            f"(got {budget})"
        )
    elif budget is not None and budget > MAX_MEMORY_GIB * GIB:
        out.append(
            f"engine.memory_budget must be at most {MAX_MEMORY_GIB * GIB} bytes (1 PiB, far "
            f"beyond any device; got {budget:g}); give one device's budget in bytes (e.g. "
            "6.4e10) or a fraction of its memory in (0, 1]"
        )
    if device is not None and not 0 < device <= MAX_MEMORY_GIB:
        out.append(
            f"engine.device_memory_gib must be > 0 and at most {MAX_MEMORY_GIB} GiB (1 PiB), "
            f"or null (got {device:g}); give one device's memory in GiB, e.g. 80"
        )
    gib = e.prefix_cache_gib
    if gib is not None and not 0 < gib <= MAX_MEMORY_GIB:
        out.append(
            f"engine.prefix_cache_gib must be > 0 and at most {MAX_MEMORY_GIB} GiB, or null "
            f"for a quarter of the memory plan (got {gib:g}); turn the cache off with "
            "engine.prefix_cache=false"
        )
    if e.prefix_block < 1:
        out.append(f"engine.prefix_block must be >= 1 tokens (got {e.prefix_block})")
    tokens = e.max_prefill_tokens
    if tokens is not None and tokens < 1:
        out.append(
            f"engine.max_prefill_tokens must be >= 1 prompt tokens per prefill iteration, or "
            f"null for no limit (got {tokens})"
        )
    return out


def parallel_problems(p: ParallelConfig, world: int | None = None) -> list[str]:
    """The ``parallel`` section against itself and the world size (None: the launch's,
    torchrun's; ``python -m xspec.plan`` names the world it plans for)."""
    from xspec.parallel.topology import launch

    problems = [
        f"parallel.{key} must be >= 1 (got {value})"
        for key, value in (("dp", p.dp), ("ep", p.ep))
        if value < 1
    ]
    if p.timeout_s <= 0:
        problems.append(f"parallel.timeout_s must be > 0 seconds (got {p.timeout_s})")
    if not p.backend:
        problems.append("parallel.backend must be auto or a torch.distributed backend name")
    if problems:
        return problems
    planned = world is not None
    world = launch().world if world is None else world
    for key, value in (("dp", p.dp), ("ep", p.ep)):
        if world == 1 and value > 1 and not planned:
            problems.append(
                f"parallel.{key}={value} needs {value}+ processes, but this is a single "
                f"process: launch with torchrun --nproc-per-node N -m xspec parallel.{key}={value} "
                "(N a multiple of it)"
            )
        elif world % value:
            source = "the planned world" if planned else "torchrun --nnodes x --nproc-per-node"
            problems.append(
                f"parallel.{key}={value} does not divide the world size {world} ({source}); "
                f"use a divisor of {world}"
            )
    return problems


def nonfinite_problems(node: Any, prefix: str = "") -> list[str]:
    """Every float of the config tree that is NaN or infinite (``engine.memory_budget=inf``,
    ``parallel.timeout_s=nan``): no range check means anything for them, and results.json
    (strict JSON) cannot hold them."""
    if is_dataclass(node):
        return [
            p
            for f in fields(node)
            for p in nonfinite_problems(getattr(node, f.name), f"{prefix}.{f.name}".lstrip("."))
        ]
    if isinstance(node, list | tuple):
        return [p for i, v in enumerate(node) for p in nonfinite_problems(v, f"{prefix}[{i}]")]
    if isinstance(node, float) and not math.isfinite(node):
        return [
            f"{prefix} must be a finite number (got {node}): NaN and infinity are not allowed; "
            "give a finite value or leave the key at its default"
        ]
    return []


def skips_drafting(spec: Any) -> bool:
    """Whether a run of this ``spec`` config takes decode steps in which a request that
    could draft does not: ``spec.adaptive`` (it decides depth 0) or a ``spec.gamma_schedule``
    entry of 0. (Any run's request drafts nothing in its last step.)"""
    schedule = spec.gamma_schedule or []
    return bool(spec.adaptive.enabled) or any(int(entry[1]) == 0 for entry in schedule)


def gamma_schedule_problems(schedule: Any) -> list[str]:
    """What is wrong with the shape of ``spec.gamma_schedule`` (empty: fine, or null); its
    entries against the run's gamma: :func:`xspec.build.resolve_gamma`."""
    if schedule is None:
        return []
    key = "spec.gamma_schedule"
    example = "e.g. spec.gamma_schedule='[[1,5],[8,3],[16,0]]'"
    shape = (
        f"{key} must be a list of [min_batch, gamma] pairs of integers, min_batch >= 1 "
        f"ascending from 1 and gamma >= 0 ({example}); got {schedule!r}"
    )
    ok = (
        isinstance(schedule, list)
        and len(schedule) > 0
        and all(
            isinstance(e, list)
            and len(e) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
            for e in schedule
        )
    )
    if not ok:
        return [shape]
    batches = [e[0] for e in schedule]
    problems = []
    if batches[0] != 1 or any(b <= a for a, b in itertools.pairwise(batches)):
        problems.append(
            f"{key}: the batch sizes must start at 1 and increase strictly (got "
            f"{batches}); {example}"
        )
    if any(e[1] < 0 for e in schedule):
        problems.append(f"{key}: gamma must be >= 0 in every entry (got {schedule}); {example}")
    return problems


def validate(cfg: RunConfig, *, world: int | None = None) -> None:
    """Every config-level problem at once (registry names, ranges); ``world``: the world
    size ``parallel`` must fit (None: the launch's)."""
    from xspec.registry import models, platforms, spec_methods

    problems: list[str] = []
    for key, reg, name in (
        ("model.arch", models, cfg.model.arch),
        ("spec.method", spec_methods, cfg.spec.method),
        ("platform.name", platforms, cfg.platform.name),
    ):
        if name not in reg:
            problems.append(f"{key}: unknown {reg.kind} {name!r}; known: {', '.join(reg.names())}")
    a = cfg.spec.adaptive
    for key, value in (
        ("spec.adaptive.max_requests", a.max_requests),
        ("spec.adaptive.profile_reps", a.profile_reps),
    ):
        if value < 1:
            problems.append(f"{key} must be >= 1 (got {value})")
    if a.profile_context is not None and a.profile_context < 1:
        problems.append(
            f"spec.adaptive.profile_context must be >= 1 or null (got {a.profile_context})"
        )
    if not a.calibration:
        problems.append("spec.adaptive.calibration must be auto, off or a file path (got '')")
    problems += gamma_schedule_problems(cfg.spec.gamma_schedule)
    w = cfg.workload
    for key, value in (
        ("workload.num_requests", w.num_requests),
        ("workload.concurrency", w.concurrency),
        ("workload.max_new_tokens", w.max_new_tokens),
        ("workload.repeats", w.repeats),
        ("workload.input_len", w.input_len),
        ("workload.output_len", w.output_len),
    ):
        if value < 1:
            problems.append(f"{key} must be >= 1 (got {value})")
    for key, value, most in (
        ("workload.num_requests", w.num_requests, MAX_WORKLOAD_REQUESTS),
        ("workload.warmup_requests", w.warmup_requests, MAX_WORKLOAD_REQUESTS),
        ("workload.concurrency", w.concurrency, MAX_WORKLOAD_REQUESTS),
        ("workload.repeats", w.repeats, MAX_WORKLOAD_REPEATS),
    ):
        if value > most:  # each request is planned up front: a typo must not exhaust memory
            problems.append(f"{key} must be <= {most:,} (got {value:,}); split the run")
    for i, prompt in enumerate(w.prompts):
        if not prompt:
            problems.append(
                f"workload.prompts[{i}] is an empty string; give some text or remove it"
            )
    for i, stop in enumerate(w.stop):
        if not stop:
            problems.append(f"workload.stop[{i}] is an empty string; remove it")
    problems += engine_problems(cfg.engine)
    if w.warmup_requests < 0:
        problems.append(f"workload.warmup_requests must be >= 0 (got {w.warmup_requests})")
    port = cfg.metrics.port
    if port is not None and not 0 <= port <= 65535:
        problems.append(f"metrics.port must be in 0..65535 (got {port}; 0 = any free port)")
    problems += server_problems(cfg.server)
    if cfg.model.path is None and cfg.model.preset is None:
        problems.append(
            "model.path is required (this model has no built-in preset): set model.path=/dir/of/checkpoint"
        )
    if cfg.model.max_context is not None and cfg.model.max_context < 2:
        problems.append(f"model.max_context must be >= 2 (got {cfg.model.max_context})")
    problems += parallel_problems(cfg.parallel, world)
    problems += cfg.sampling.to_params().problems()
    if nonfinite := nonfinite_problems(cfg):  # one message per key: drop its range message
        keys = {p.split(" ", 1)[0] for p in nonfinite}
        problems = nonfinite + [p for p in problems if p.split(" ", 1)[0] not in keys]
    if problems:
        raise ConfigError("invalid configuration:", problems=problems)
