"""DeepSeek-V4's block drafts for ``spec=dspark`` (:class:`~xspec.models.block_draft.BlockDrafts`,
what :meth:`DeepseekV4Family.block_drafts` returns): where the draft is (``spec.draft_path``,
the preset's companion, else the target's own directory), its problems and footprint from
headers, its trained block size, and loading it. The model itself is :mod:`.dspark`,
which imports nothing of the presets (the random presets' generator, :mod:`.tiny`, builds
its stages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from xspec.config import skips_drafting
from xspec.errors import CheckpointError, UserError
from xspec.models.base import Footprint
from xspec.models.block_draft import BlockLayout, LoadedDraft
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.dspark import DraftWindow, context_bytes, load_dspark, plan_dspark
from xspec.models.deepseek_v4.presets import PRESET_DRAFTS, checkpoint_path
from xspec.models.deepseek_v4.weights import stored_footprint
from xspec.models.loading import CONFIG_NAME, Checkpoint
from xspec.models.presets import dtype_name


def draft_dir(spec_cfg: Any, model_cfg: Any) -> Path:
    """``spec.draft_path``, the preset's companion, else the target's own directory."""
    from xspec.models.presets import draft_checkpoint_dir

    return draft_checkpoint_dir(
        spec_cfg,
        model_cfg,
        preset_drafts=PRESET_DRAFTS,
        target_dir=lambda: checkpoint_path(model_cfg),
        example="/dir/of/DeepSeek-V4-Flash-0731",
    )


def preflight_block_draft(layout: Any, spec_cfg: Any, model_cfg: Any) -> list[str]:
    """Every problem of ``spec=dspark`` on this DeepSeek-V4 target, from headers only."""

    problems: list[str] = []
    try:
        target = Checkpoint(checkpoint_path(model_cfg))
        target_args = DeepseekV4Args.from_config(target.config, target.path / CONFIG_NAME)
    except UserError:
        target_args = None  # the target loader reports its own checkpoint precisely
    try:
        plan_dspark(draft_dir(spec_cfg, model_cfg), target_args)
    except UserError as e:
        where = f"spec.draft_path={spec_cfg.draft_path}: " if spec_cfg.draft_path else ""
        problems += [f"{where}{p}" for p in e.problems] or [f"{where}{e}"]
    return problems


def footprint(layout: Any, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint:
    """The stages' own tensors (shared vocabulary counted with the target) and their
    context rings, as :func:`load_block_draft` and :meth:`DSparkDraft.kv_bytes` hold them."""
    target = Checkpoint(checkpoint_path(model_cfg))
    target_args = DeepseekV4Args.from_config(target.config, target.path / CONFIG_NAME)
    plan = plan_dspark(draft_dir(spec_cfg, model_cfg), target_args)
    itemsize = getattr(torch, dtype_name(model_cfg.dtype)).itemsize
    a = plan.args
    return Footprint(
        tensors=stored_footprint(plan.ckpt, plan.names, plan.dequant, itemsize),
        kv=context_bytes(plan.num_stages, a, itemsize, skips_drafting(spec_cfg)),
        num_experts=a.n_routed_experts,
    )


def trained_block_size(layout: Any, spec_cfg: Any, model_cfg: Any) -> int | None:
    """``dspark_block_size`` of the draft's config.json (None when it cannot be read:
    ``preflight_block_draft`` reports why)."""
    try:
        size = Checkpoint(draft_dir(spec_cfg, model_cfg)).config.get("dspark_block_size")
    except UserError:
        return None
    return size if isinstance(size, int) and size >= 1 else None


def has_confidence_head(layout: Any, spec_cfg: Any, model_cfg: Any) -> bool | None:
    """Whether the draft stores ``mtp.{S-1}.confidence_head.proj.weight`` (headers only;
    None when the checkpoint cannot be read: ``preflight_block_draft`` says why)."""
    try:
        return plan_dspark(draft_dir(spec_cfg, model_cfg), None).confidence
    except UserError:
        return None


def load_block_draft(
    layout: Any, spec_cfg: Any, *, target: Any, model_cfg: Any, platform: Any
) -> Any:
    from xspec.models.deepseek_v4.model import DeepseekV4Model

    if not isinstance(target, DeepseekV4Model):
        raise CheckpointError(
            f"spec=dspark on model.arch=deepseek_v4 needs its target, got {type(target).__name__}"
        )
    plan = plan_dspark(draft_dir(spec_cfg, model_cfg), target.args)
    steps = platform.step_options()  # the platform's ops and compiler, as the target's
    draft = load_dspark(
        plan,
        embed=target.embed,
        head=target.head,
        window=DraftWindow(platform, steps.ops),
        dtype=target.dtype,
        device=platform.device(),
        expert_parallel=target.expert_parallel,  # the target's EP share
        steps=steps,
        quant_compute=target.quant_compute,
        hold_window=skips_drafting(spec_cfg),  # no backlog where every request drafts
    )
    return LoadedDraft(
        draft, plan.block_size, plan.capture_layer_ids, plan.ckpt.path, BlockLayout.DSPARK
    )
