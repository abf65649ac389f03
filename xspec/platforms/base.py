"""The platform contract: what core code may ask about the hardware, before building anything.

A platform plugin answers questions instead of being asked to honour decisions:

- ``capabilities``: a frozen :class:`Capabilities`, computed once when the platform is
  constructed and read by ``build`` before any weights or caches exist;
- ``capture_point(L)``: where the runtime reads the hidden state a checkpoint means by
  "output of layer L" (core code parses layer ids raw; only the platform maps them);
- ``validate(...)``: every limit it cannot serve, as a list of messages naming the key;
- ``sas_mode()``: which sparse-attention window layout the draft uses (native/compat), and
  ``draft_window_attention()``: the operator it runs on (None: the model's reference);
- ``step_options()``: the ops the models delegate (``model_ops()``) and the compiler;
- small device services: ``device()``, ``distributed_backend()``, ``memory_available()``,
  ``synchronize()``, ``manual_seed()``.

Importing a platform module never touches a device and never imports optional device
packages (``torch_npu``): detection happens in :meth:`Platform.unavailable_reason`
(cheap, no imports) and device work in ``__init__`` or later.
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol

import torch

from xspec.capture import CapturePoint, CaptureSite
from xspec.errors import ConfigError, PlatformError

# the only models/ module a platform imports: the ops a model lets it run (and their
# types, re-exported here for platform plugins)
from xspec.models.ops import (
    REFERENCE_OPS,
    DraftAttentionOp,
    ModelOps,
    SasIndicesRejected,
    SasMode,
    StepOptions,
)

__all__ = [
    "Capabilities",
    "DraftAttentionOp",
    "ModelOps",
    "Platform",
    "PlatformSettings",
    "SasIndicesRejected",
    "SasMode",
    "StepOptions",
    "check_layer_id",
]

NATIVE_SAS_VALUES = ("auto", "on", "off")
COMPILE_VALUES = ("auto", "on", "off")
KERNELS_VALUES = ("auto", "reference")


class PlatformSettings(Protocol):
    """The platform config section a platform is built from (duck-typed).

    ``native_sas``, ``compile`` (``auto|on|off``) and ``kernels`` (``auto|reference``)
    are str-valued Enums or their values; a section without the last two means auto.
    """

    @property
    def name(self) -> str: ...

    @property
    def device_index(self) -> int: ...

    @property
    def native_sas(self) -> Any: ...


@dataclass(frozen=True)
class Capabilities:
    """What a platform can serve. Defaults are the conservative answer.

    Core reads these once, at build time, and picks a code path the platform can serve.
    """

    # SAS kernel with explicit ori_sparse_indices (native DSpark window layout).
    native_sparse_attention: bool = False
    dtypes: frozenset[str] = field(
        default_factory=lambda: frozenset({"float32", "bfloat16", "float16"})
    )
    max_speculative_tokens: int = 16
    distributed_backend: str = "gloo"
    # The backend has all_to_all (expert-parallel MoE routes rows only to their expert's
    # rank); without it EP MoE layers all-gather the rows (parallel.moe_exchange).
    all_to_all: bool = True
    # torch.compile backend the step functions compile with (platform.compile); None:
    # this platform cannot compile them (platform.compile=on is refused).
    compile_backend: str | None = None
    # what platform.compile=auto means here
    compile_by_default: bool = False
    # dtypes torch._grouped_mm serves on this device (MoE routed experts as grouped GEMMs),
    # and whether eager steps should always use it (no host sync per MoE layer; where a
    # sync is free, the host, they read the group sizes and pick per layer call)
    grouped_mm_dtypes: frozenset[str] = frozenset()
    grouped_mm_eager: bool = False


def native_sas_setting(cfg: PlatformSettings) -> str:
    """``cfg.native_sas`` as one of ``auto|on|off`` (accepts the Enum or its plain value)."""
    return _choice(cfg, "native_sas", NATIVE_SAS_VALUES, "auto")


def _flag(cfg: Any, key: str) -> bool:
    """``cfg.<key>`` as a bool (absent = False)."""
    value = getattr(cfg, key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"platform.{key}={value!r} must be true or false")
    return value


def _choice(cfg: Any, key: str, values: tuple[str, ...], default: str) -> str:
    """``cfg.<key>`` (an Enum or its plain value; absent = ``default``), one of ``values``."""
    raw = getattr(cfg, key, default)
    value = getattr(raw, "value", raw)
    if value not in values:
        raise ConfigError(
            f"platform.{key}={value!r} is not a valid choice; use one of {', '.join(values)}"
        )
    return str(value)


class Platform(abc.ABC):
    """Base class of every platform plugin (built-in or registered via ``xspec.platforms``).

    A subclass sets ``name`` (its registry key) and ``description``, implements
    ``device``, ``memory_available`` and ``synchronize``, and overrides the policy hooks
    it needs (``unavailable_reason``, ``_build_capabilities``, ``capture_point``,
    ``sas_mode``, ``validate``). Overriding a hook with a different signature is a
    ``TypeError`` at class definition, so a renamed parameter fails loudly.
    """

    name: ClassVar[str]
    description: ClassVar[str] = ""
    # True only where `platform.native_sas=on` can be honoured (a native SAS operator).
    supports_native_sas_option: ClassVar[bool] = False
    # share of memory_available() (+ the loaded weights) the memory planner budgets when
    # engine.memory_budget is null
    default_memory_fraction: ClassVar[float] = 0.9

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_overrides(cls)

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this platform cannot run here (what is missing, how to install it), or None.

        Must be cheap: no imports of optional packages, no device initialisation.
        """
        return None

    @classmethod
    def create(cls, cfg: PlatformSettings) -> Platform:
        """Build the platform for ``cfg``; resolvers (``auto``) return another platform."""
        return cls(cfg)

    def __init__(self, cfg: PlatformSettings) -> None:
        reason = type(self).unavailable_reason()
        if reason is not None:
            raise PlatformError(f"platform={self.name} cannot run here: {reason}")
        if cfg.device_index < 0:
            raise ConfigError(f"platform.device_index={cfg.device_index} must be >= 0")
        self.device_index = cfg.device_index
        self.native_sas = native_sas_setting(cfg)
        self.compile = _choice(cfg, "compile", COMPILE_VALUES, "auto")
        self.kernels = _choice(cfg, "kernels", KERNELS_VALUES, "auto")
        self.batch_invariant = _flag(cfg, "batch_invariant")
        self._capabilities = self._build_capabilities()
        self._step_options: StepOptions | None = None

    def _build_capabilities(self) -> Capabilities:
        """Called once from ``__init__``; the result is frozen for the platform's lifetime."""
        return Capabilities()

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @abc.abstractmethod
    def device(self) -> torch.device:
        """The torch device tensors of this run live on."""

    @abc.abstractmethod
    def memory_available(self) -> int:
        """Bytes the memory planner may budget on ``device()`` right now."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait for all queued work on ``device()`` (for timing)."""

    def capture_point(self, checkpoint_layer_id: int) -> CapturePoint:
        """Where to read the hidden state the checkpoint calls "output of layer L".

        Default: the output of layer L itself (hooks can run after a layer). Id -1 means
        the embedding output (DFlash / DSpark drafts use it), i.e. the input of layer 0.
        """
        check_layer_id(checkpoint_layer_id)
        if checkpoint_layer_id == EMBEDDING_LAYER_ID:
            return CapturePoint(layer=0, site=CaptureSite.INPUT)
        return CapturePoint(layer=checkpoint_layer_id, site=CaptureSite.OUTPUT)

    def sas_mode(self, operator_accepts_ori_sparse_indices: bool | None = None) -> SasMode:
        """The draft window layout: native where the capabilities say the draft attention
        takes explicit window indices, else compatibility."""
        if self.capabilities.native_sparse_attention:
            return SasMode.NATIVE
        return SasMode.COMPAT

    def reference_attention_capabilities(self, **kw: Any) -> Capabilities:
        """Capabilities of a platform whose draft window runs the model's reference
        attention (:meth:`draft_window_attention` None): it serves explicit index sets, so
        the native layout (the checkpoint's trained semantics) under
        ``platform.native_sas=auto``; ``off`` asks for compatibility, and ``on`` (an NPU
        operator setting) is refused by :meth:`validate`."""
        return Capabilities(native_sparse_attention=self.native_sas == "auto", **kw)

    def draft_window_attention(self) -> DraftAttentionOp | None:
        """The operator the DSpark draft window's sparse attention runs on (see
        ``models.ops.DraftAttentionOp``), or None: the model's reference attention (with
        this platform's ``sparse_attention`` op where :meth:`model_ops` has one). An
        operator that cannot take explicit indices raises ``SasIndicesRejected``, and the
        draft falls back to the compatibility layout (see :meth:`sas_mode`)."""
        return None

    def model_ops(self) -> tuple[ModelOps, str]:
        """The ops this platform runs for the models (``models.ops.ModelOps``; None
        fields: the model's reference op) and a line saying what they are; called once,
        at build, under ``platform.kernels=auto``. Default: none; :meth:`step_options`
        adds the capabilities' grouped GEMMs."""
        return REFERENCE_OPS, "reference torch ops"

    def step_options(self) -> StepOptions:
        """How the models run their stateless steps on this platform (built once): the
        ops (``platform.kernels``) and the compiler (``platform.compile``). The model
        receives them at construction."""
        if self._step_options is None:
            caps = self.capabilities
            ops, ops_line = REFERENCE_OPS, "reference torch ops"
            compiling = self._compiles()
            if self.kernels == "auto":
                ops, ops_line = self.model_ops()
            # compiled MoE needs grouped GEMMs; padded rows need per-expert ones (a group's
            # rows are the ones its expert received, which batching changes)
            tile = self._row_tile() if self.batch_invariant else 1
            if (self.kernels == "auto" or compiling) and tile <= 1:
                ops = replace(
                    ops,
                    grouped_mm_dtypes=caps.grouped_mm_dtypes,
                    grouped_mm_eager=caps.grouped_mm_eager,
                )
            compiler = None
            how = "eager"
            if compiling:
                from xspec.platforms.compile import StepCompiler

                compiler = StepCompiler(str(caps.compile_backend))
                how = f"compiled ({caps.compile_backend})"
            if tile > 1:
                how += f", GEMM rows padded to a multiple of {tile} (batch-invariant)"
            self._step_options = StepOptions(
                ops=ops,
                compile=compiler,
                describe=f"steps: {how}, {ops_line}",
                row_tile=tile,
            )
        return self._step_options

    def validate(self, *, dtype: str) -> list[str]:
        """Every limit of this platform the run would exceed, as messages naming the key
        (the draft depth's, ``capabilities.max_speculative_tokens``, is checked with the
        rest of gamma's by :func:`xspec.build.resolve_gamma`)."""
        caps = self.capabilities
        problems: list[str] = []
        if self.compile == "on" and caps.compile_backend is None:
            problems.append(
                f"platform.compile=on: platform={self.name} cannot compile step functions; "
                "set platform.compile=auto or off"
            )
        if dtype not in caps.dtypes:
            problems.append(
                f"model.dtype={dtype!r} is not supported on platform={self.name}; "
                f"use one of {', '.join(sorted(caps.dtypes))}"
            )
        if self.batch_invariant:
            problems += self._batch_invariance(dtype)
        if self.native_sas == "on" and not self.supports_native_sas_option:
            problems.append(
                f"platform.native_sas=on is only supported on NPU platforms with a native sparse "
                f"attention operator, not on platform={self.name}; set platform.native_sas=auto or off"
            )
        return problems

    def _compiles(self) -> bool:
        """The step functions are compiled (``platform.compile``, and a backend for it)."""
        caps = self.capabilities
        return caps.compile_backend is not None and (
            self.compile == "on" or (self.compile == "auto" and caps.compile_by_default)
        )

    def gemm_row_tile(self, dtype: torch.dtype) -> int | None:
        """The row count whose multiples make this platform's ``dtype`` GEMMs
        row-invariant (:mod:`xspec.models.invariant`; 1: they are as they come), or None
        where the platform does not promise it (``platform.batch_invariant`` is then
        refused). Default: None; a platform that can show it overrides this."""
        return None

    def _batch_invariance(self, dtype: str) -> list[str]:
        """``platform.batch_invariant``'s problems for a model in ``dtype``."""
        key = "platform.batch_invariant=true"
        problems = []
        if self._compiles() or self.compile == "on":  # (on without a backend: refused above)
            problems.append(f"{key} runs eager steps: set platform.compile=off")
        # what it is shown for: the reference sparse attention (kernels=reference, or
        # where a kernel declines a dtype) attends each query over its batch's widest
        # key set, whose softmax sums in another order
        if dtype != "float32" or self.kernels != "auto":
            problems.append(
                f"{key} holds for fp32 models with the platform's kernels: set "
                f"model.dtype=float32 and platform.kernels=auto (got model.dtype={dtype}, "
                f"platform.kernels={self.kernels})"
            )
        elif self.gemm_row_tile(torch.float32) is None:
            problems.append(
                f"{key}: platform={self.name} does not make its fp32 GEMMs row-invariant "
                "(no row padding gives each row the same result in calls of different "
                "sizes); set platform.batch_invariant=false"
            )
        elif self.step_options().ops.sparse_attention is None:  # kernels=auto, none loaded
            problems.append(
                f"{key} needs the platform's attention kernel, and {self.name} runs the "
                f"reference ops ({self.step_options().describe}); set "
                "platform.batch_invariant=false"
            )
        return problems

    def _row_tile(self) -> int:
        """The fp32 row tile (``validate`` refused the run if there is none)."""
        return self.gemm_row_tile(torch.float32) or 1

    def distributed_backend(self) -> str:
        """torch.distributed backend for DP/EP collectives (gloo, nccl, hccl...)."""
        return self.capabilities.distributed_backend

    def rank_device_index(self, local_rank: int) -> int:
        """The device of torchrun's local rank ``local_rank`` (one device per process):
        ``platform.device_index`` counts from the node's first process."""
        return self.device_index + local_rank

    def manual_seed(self, seed: int) -> None:
        """Seed torch's global generators (CPU and every registered device backend)."""
        torch.manual_seed(seed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device_index={self.device_index})"


# Checkpoint layer id of the embedding output (HF ``hidden_states[0]``); "output of
# layer -1" is the input of layer 0, so both capture conventions map it the same way.
EMBEDDING_LAYER_ID = -1


def check_layer_id(checkpoint_layer_id: int) -> None:
    """Refuse a negative checkpoint layer id other than -1 (the embedding output), shared
    by every ``capture_point``."""
    if checkpoint_layer_id < EMBEDDING_LAYER_ID:
        raise ConfigError(
            f"target layer id {checkpoint_layer_id} is negative; checkpoint layer ids "
            "(e.g. dspark_target_layer_ids) count decoder layers from 0, and -1 names the "
            "embedding output"
        )


# Hooks a subclass may override; their parameter lists must match the base's.
_HOOKS = (
    "unavailable_reason",
    "create",
    "device",
    "memory_available",
    "synchronize",
    "capture_point",
    "sas_mode",
    "draft_window_attention",
    "validate",
    "distributed_backend",
    "rank_device_index",
    "manual_seed",
    "model_ops",
)


def _check_overrides(cls: type) -> None:
    """Refuse, at class definition, an override whose parameters differ from the base hook."""
    for hook in _HOOKS:
        if hook not in vars(cls):
            continue
        base_params = _params(getattr(Platform, hook))
        sub_params = _params(getattr(cls, hook))
        if sub_params != base_params:
            raise TypeError(
                f"{cls.__qualname__}.{hook} has parameters {sub_params}, but Platform.{hook} "
                f"declares {base_params}; keep the base signature so core code can call it"
            )


def _params(func: Any) -> list[tuple[str, Any]]:
    sig = inspect.signature(func)
    return [(p.name, p.kind) for p in sig.parameters.values() if p.name not in ("self", "cls")]
