"""DeepSeek-V4 (Flash) target model (registry key ``deepseek_v4``).

Importing this package is light: only the torch-free config schema is imported here;
torch, safetensors and the model code load when :func:`load_model` runs (or when
``DeepseekV4Model`` is first accessed). :data:`FAMILY` (a :class:`DeepseekV4Family`) is
what the ``models`` registry hands to xspec.

Checkpoints: the official DeepSeek layout (names equal the module's state_dict keys),
its W8A8 (msModelSlim) and FP8-block variants, and QuaRot checkpoints; see
:mod:`xspec.models.deepseek_v4.weights`. ``model.preset: tiny`` is a small random
checkpoint with every Flash feature, generated on first use (:mod:`.tiny`).
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.presets import PRESET_DRAFTS, PRESETS, checkpoint_path
from xspec.models.family import ModelFamily
from xspec.models.presets import dtype_name

if TYPE_CHECKING:
    import torch

    from xspec.models.base import Footprint, StepOptions, TargetModel
    from xspec.models.block_draft import BlockDrafts
    from xspec.models.deepseek_v4.model import DeepseekV4Model
    from xspec.models.deepseek_v4.mtp import MtpBlock

__all__ = [
    "FAMILY",
    "PRESETS",
    "PRESET_DRAFTS",
    "DeepseekV4Args",
    "DeepseekV4Family",
    "DeepseekV4Model",
    "checkpoint_path",
    "load_model",
    "preflight",
]


def __getattr__(name: str) -> Any:  # lazy: keep `import xspec.models.deepseek_v4` torch-free
    if name == "DeepseekV4Model":
        from xspec.models.deepseek_v4 import model

        return model.DeepseekV4Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(
    cfg: Any,
    *,
    device: torch.device,
    max_rollback: int,
    expert_parallel: Any = None,
    steps: StepOptions | None = None,
) -> DeepseekV4Model:
    """Build the model described by the ``model`` config section and load its weights.

    ``cfg``: ``path`` (checkpoint dir; wins over ``preset``), ``preset`` (e.g. "tiny",
    generated on first use), ``dtype`` (an enum whose value is float32 / bfloat16 /
    float16), ``max_context`` (None = the model's default). config.json and every tensor
    header are validated before anything is allocated; weights then stream in one tensor
    at a time. The returned model carries ``checkpoint_dir`` (drafters read it).
    ``expert_parallel`` (an :class:`~xspec.parallel.expert.ExpertParallel`): load only
    this rank's experts; the drafters then load theirs the same way. ``steps``: the
    platform's ops and compiler, built into every module (None: reference ops, eager).
    """
    import torch

    from xspec.models.deepseek_v4.weights import load_checkpoint
    from xspec.models.ops import EAGER_STEPS

    dtype = getattr(torch, dtype_name(cfg.dtype))
    return load_checkpoint(
        checkpoint_path(cfg),
        dtype=dtype,
        device=device,
        max_rollback=max_rollback,
        max_context=cfg.max_context,
        expert_parallel=expert_parallel,
        steps=steps or EAGER_STEPS,
        quant_compute=quant_compute_of(cfg),
    )


def quant_compute_of(cfg: Any) -> str:
    """``model.quant_compute`` as its string value (an enum member or its value; a
    hand-built section without the key, as older callers pass, means ``auto``)."""
    value = getattr(cfg, "quant_compute", "auto")
    return str(value.value if isinstance(value, enum.Enum) else value)


def preflight(cfg: Any) -> list[str]:
    """Problems of the checkpoint ``cfg`` names, from config.json and headers only."""
    from xspec.errors import UserError
    from xspec.models.deepseek_v4.weights import check_checkpoint
    from xspec.models.loading import CONFIG_NAME, Checkpoint

    try:
        ckpt = Checkpoint(checkpoint_path(cfg))
        check_checkpoint(ckpt, DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME))
    except UserError as e:
        return [str(e)]
    return []


def num_routed_experts(cfg: Any) -> int | None:
    """The target's routed experts per MoE layer (config.json; None when unreadable:
    ``preflight`` reports why). ``parallel.ep`` must divide it."""
    from xspec.errors import UserError
    from xspec.models.loading import Checkpoint

    try:
        value = Checkpoint(checkpoint_path(cfg)).config.get("n_routed_experts")
    except UserError:
        return None
    return value if isinstance(value, int) else None


def footprint(cfg: Any, *, max_rollback: int) -> Footprint:
    """The target's tensors (by format, at ``cfg.dtype``) and per-sequence KV, from
    config.json and the headers (see :class:`~xspec.models.base.Footprint`)."""
    from xspec.models.base import Footprint, KvBytes
    from xspec.models.deepseek_v4.state import kv_bytes
    from xspec.models.deepseek_v4.weights import (
        check_checkpoint,
        expected_tensors,
        stored_footprint,
    )
    from xspec.models.loading import CONFIG_NAME, Checkpoint

    ckpt = Checkpoint(checkpoint_path(cfg))
    args = DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME)
    dequant = check_checkpoint(ckpt, args)
    dtype = _torch_dtype(cfg)
    return Footprint(
        tensors=stored_footprint(ckpt, expected_tensors(args), dequant, dtype.itemsize),
        kv=KvBytes(*kv_bytes(args, dtype, max_rollback)),
        num_experts=args.n_routed_experts,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        max_context=cfg.max_context or args.max_position_embeddings,
    )


def _torch_dtype(cfg: Any) -> torch.dtype:
    import torch

    return getattr(torch, dtype_name(cfg.dtype))


def _target_args(model_cfg: Any) -> DeepseekV4Args:
    from xspec.models.loading import CONFIG_NAME, Checkpoint

    ckpt = Checkpoint(checkpoint_path(model_cfg))
    return DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME)


class DeepseekV4Family(ModelFamily):
    """DeepSeek-V4 targets: expert parallel, DSpark stages (:mod:`.dspark`), the MTP
    layer (:mod:`.mtp`)."""

    arch = "deepseek_v4"
    display_name = "DeepSeek-V4"
    block_layouts = frozenset({"dspark"})  # DeepSeek-V4 ships DSpark stages, no DFlash
    offers_mtp = True
    supports_expert_parallel = True

    def load(
        self,
        cfg: Any,
        *,
        device: torch.device,
        max_rollback: int,
        steps: StepOptions,
        expert_parallel: Any = None,
    ) -> DeepseekV4Model:
        return load_model(
            cfg,
            device=device,
            max_rollback=max_rollback,
            expert_parallel=expert_parallel,
            steps=steps,
        )

    def preflight(self, cfg: Any) -> list[str]:
        return preflight(cfg)

    def checkpoint_path(self, cfg: Any) -> Path:
        return checkpoint_path(cfg)

    def num_routed_experts(self, cfg: Any) -> int | None:
        return num_routed_experts(cfg)

    def footprint(self, cfg: Any, *, max_rollback: int) -> Footprint:
        return footprint(cfg, max_rollback=max_rollback)

    def block_drafts(self) -> BlockDrafts:
        from xspec.models.deepseek_v4 import block_drafts

        return block_drafts

    def preflight_mtp(self, spec_cfg: Any, model_cfg: Any) -> list[str]:
        """The MTP layer (the target's, or ``spec.draft_path``) against the target's
        config.json, from headers only."""
        from xspec.errors import UserError
        from xspec.models.deepseek_v4.mtp import plan_mtp
        from xspec.models.loading import CONFIG_NAME, Checkpoint

        try:
            target = Checkpoint(checkpoint_path(model_cfg))
            target_args = DeepseekV4Args.from_config(target.config, target.path / CONFIG_NAME)
        except UserError:
            return []  # the target loader reports its own checkpoint precisely
        draft_dir = spec_cfg.draft_path or target.path
        try:
            plan_mtp(draft_dir, target_args)
        except UserError as e:
            where = f"spec.draft_path={draft_dir}" if spec_cfg.draft_path else f"target {draft_dir}"
            return [f"{where}: {p}" for p in e.problems] or [str(e)]
        return []

    def footprint_mtp(self, spec_cfg: Any, model_cfg: Any, *, gamma: int) -> Footprint:
        """The MTP block's own tensors and its layer cache (SWA ring, ``gamma - 1`` rows
        of rollback), as :meth:`load_mtp` and ``MtpDrafter.kv_bytes`` would hold them."""
        from xspec.models.base import Footprint, KvBytes
        from xspec.models.deepseek_v4.mtp import plan_mtp
        from xspec.models.deepseek_v4.state import layer_kv_bytes
        from xspec.models.deepseek_v4.weights import stored_footprint

        target_dir = checkpoint_path(model_cfg)
        plan = plan_mtp(Path(spec_cfg.draft_path or target_dir), _target_args(model_cfg))
        dtype = _torch_dtype(model_cfg)
        return Footprint(
            tensors=stored_footprint(plan.ckpt, plan.names, plan.dequant, dtype.itemsize),
            kv=KvBytes(*layer_kv_bytes(plan.args, 0, dtype, gamma - 1)),  # ratio 0: SWA only
            num_experts=plan.args.n_routed_experts,
        )

    def load_mtp(self, spec_cfg: Any, *, target: TargetModel, model_cfg: Any) -> MtpBlock:
        from xspec.errors import ConfigError
        from xspec.models.deepseek_v4.model import DeepseekV4Model
        from xspec.models.deepseek_v4.mtp import load_mtp, plan_mtp

        if not isinstance(target, DeepseekV4Model):
            raise ConfigError(
                f"spec=mtp needs a DeepSeek-V4 target (model.arch={self.arch}); got "
                f"{type(target).__name__}, which has no MTP layer"
            )
        # set by load_checkpoint; a target built otherwise (tests) reads model.path / preset
        target_dir = target.checkpoint_dir or checkpoint_path(model_cfg)
        plan = plan_mtp(Path(spec_cfg.draft_path or target_dir), target.args)
        return load_mtp(
            plan,
            embed=target.embed,
            head=target.head,
            dtype=target.dtype,
            device=target.device,  # the platform's device, where the target was loaded
            expert_parallel=target.expert_parallel,  # the target's EP share
            steps=target.steps,  # the platform's ops and compiler, as the target's
            quant_compute=target.quant_compute,
        )


FAMILY = DeepseekV4Family()
