"""Qwen3 presets (``model.preset``), where a run's target checkpoint is, and the tiny
presets' companion DSpark / DFlash draft directories: the family (``__init__``) and its
block drafts (:mod:`.dspark`) both read these. Generating a preset imports :mod:`.tiny`
on first use, which writes drafts with :mod:`.dspark`'s name map (lazily: no import
cycle at module level)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from xspec.models.presets import cached, checkpoint_dir, draft_checkpoint_dir

PRESETS = {"tiny": False, "moe_tiny": True}  # model.preset -> is MoE
EXAMPLE_DIR = "/dir/of/qwen3/draft (config.json with target_layer_ids, mask_token_id)"


def checkpoint_path(cfg: Any) -> Path:
    """``cfg.path``, else the tiny preset's directory (generated on first use)."""

    def preset(moe: bool) -> Callable[[], Path]:
        @cached
        def make() -> Path:
            from xspec.models.qwen3.tiny import tiny_dir

            return tiny_dir(moe)

        return make

    presets = {name: preset(moe) for name, moe in PRESETS.items()}
    return checkpoint_dir(
        cfg, presets, family="Qwen3", example="/dir/with/config.json (Hugging Face layout)"
    )


def draft_dir(spec_cfg: Any, model_cfg: Any) -> Path:
    """``spec.draft_path``, else the tiny presets' companion drafts (generated on first use)."""
    from xspec.models.block_draft import BlockLayout  # imports torch: not at package import

    def preset(moe: bool, method: str) -> Any:
        @cached
        def make() -> Path:
            from xspec.models.qwen3.tiny import tiny_draft_dir

            return tiny_draft_dir(moe, BlockLayout(method))

        return make

    drafts = {
        (name, method.value): preset(moe, method.value)
        for name, moe in PRESETS.items()
        for method in BlockLayout
    }
    return draft_checkpoint_dir(
        spec_cfg, model_cfg, preset_drafts=drafts, target_dir=None, example=EXAMPLE_DIR
    )
