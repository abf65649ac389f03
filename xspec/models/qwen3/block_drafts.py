"""Qwen3's block drafts for ``spec=dspark`` / ``spec=dflash``
(:class:`~xspec.models.block_draft.BlockDrafts`, what the family's ``block_drafts()``
returns): where the draft is (``spec.draft_path`` or the tiny presets' companions), its
problems and footprint from config.json and headers, its trained block size, and loading
it. The model itself is :mod:`.dspark`, which imports nothing of the presets (the tiny
presets' generator, :mod:`.tiny`, builds drafts with it)."""

from __future__ import annotations

from typing import Any

import torch

from xspec.errors import CheckpointError, UserError
from xspec.models.base import Footprint, KvBytes
from xspec.models.block_draft import BlockLayout, LoadedDraft
from xspec.models.loading import CONFIG_NAME, Checkpoint, held_bytes, load_params
from xspec.models.presets import dtype_name
from xspec.models.qwen3.args import Qwen3Args
from xspec.models.qwen3.draft_config import parse_config
from xspec.models.qwen3.dspark import (
    DraftPlan,
    Qwen3BlockDraft,
    block_layout,
    plan_draft,
    plan_for,
)
from xspec.models.qwen3.presets import checkpoint_path, draft_dir


def preflight_block_draft(method: BlockLayout, spec_cfg: Any, model_cfg: Any) -> list[str]:
    """Every problem of the draft for this target, from config.json and headers only."""
    try:
        target = Checkpoint(checkpoint_path(model_cfg))
        target_args = Qwen3Args.from_config(target.config, target.path / CONFIG_NAME)
    except UserError:
        return []  # the target loader reports its own checkpoint precisely
    try:
        path = draft_dir(spec_cfg, model_cfg)
    except UserError as e:
        return [str(e)]
    try:
        plan_draft(method, path, target_args)
    except UserError as e:
        where = f"spec={method.value} draft {path}"
        return [f"{where}: {p}" for p in e.problems] or [f"{where}: {e}"]
    return []


def _config_plan(method: BlockLayout, spec_cfg: Any, model_cfg: Any) -> DraftPlan | None:
    """The plan from the draft's config.json alone (None when it cannot be read or does
    not suit the method: ``preflight_block_draft`` reports why)."""
    try:
        ckpt = Checkpoint(draft_dir(spec_cfg, model_cfg))
        cfg = parse_config(ckpt.config, ckpt.path / CONFIG_NAME)
        layout = block_layout(method, cfg, ckpt.path / CONFIG_NAME)
    except UserError:
        return None
    return plan_for(layout, cfg, own_vocab=False)


def footprint(method: BlockLayout, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint:
    """The draft's own tensors (its vocabulary only when it stores one) and its context
    K/V per token, as :func:`load_block_draft` and ``Qwen3BlockDraft.kv_bytes`` hold them."""
    target = Checkpoint(checkpoint_path(model_cfg))
    target_args = Qwen3Args.from_config(target.config, target.path / CONFIG_NAME)
    ckpt, plan = plan_draft(method, draft_dir(spec_cfg, model_cfg), target_args)
    itemsize = getattr(torch, dtype_name(model_cfg.dtype)).itemsize
    a = plan.cfg.args
    names = [n for n in ckpt.names() if plan.rename(n) is not None]
    per_token = a.num_hidden_layers * 2 * a.num_key_value_heads * a.head_dim * itemsize
    return Footprint(
        tensors={n: held_bytes(ckpt, n, itemsize) for n in names}, kv=KvBytes(0, float(per_token))
    )


def trained_block_size(method: BlockLayout, spec_cfg: Any, model_cfg: Any) -> int | None:
    """The draft's default gamma from its config.json."""
    plan = _config_plan(method, spec_cfg, model_cfg)
    return plan.trained_gamma if plan is not None else None


def has_confidence_head(method: BlockLayout, spec_cfg: Any, model_cfg: Any) -> bool | None:
    """Whether the draft scores its proposals (a DSpark-layout draft with
    ``enable_confidence_head``; refused under spec=dflash, never in z-lab DFlash)."""
    plan = _config_plan(method, spec_cfg, model_cfg)
    return plan.use_confidence if plan is not None else None


def load_block_draft(
    method: BlockLayout, spec_cfg: Any, *, target: Any, model_cfg: Any, platform: Any
) -> LoadedDraft:
    from xspec.models.qwen3.model import Qwen3Model

    if not isinstance(target, Qwen3Model):
        raise CheckpointError(f"a Qwen3 {method.value} draft needs a Qwen3 target")
    ckpt, plan = plan_draft(method, draft_dir(spec_cfg, model_cfg), target.args)
    model = Qwen3BlockDraft(
        plan,
        target=target,
        dtype=target.dtype,
        device=platform.device(),
        max_context=target.max_context,
    )
    load_params(model, ckpt, plan.rename)
    return LoadedDraft(
        model=model.eval(),
        trained_block_size=plan.trained_gamma,
        capture_layer_ids=list(plan.cfg.target_layer_ids),
        path=ckpt.path,
        layout=plan.layout,
    )
