"""``spec=dspark`` and ``spec=dflash``: block drafters for every target family that has them.

The algorithm lives in :mod:`xspec.spec.block`; a target family that lists the method's
layout in ``ModelFamily.block_layouts`` provides its draft model through
``ModelFamily.block_drafts()`` (:class:`~xspec.models.block_draft.BlockDrafts`, its
``block_drafts.py`` module, imported only when selected):

* ``preflight_block_draft(layout, spec_cfg, model_cfg) -> list[str]``: every problem of
  the draft checkpoint, from config.json and tensor headers only (nothing allocated);
* ``trained_block_size(layout, spec_cfg, model_cfg) -> int | None``: the default gamma,
  from config.json only;
* ``load_block_draft(layout, spec_cfg, *, target, model_cfg, platform) -> LoadedDraft``
  (the platform answers device and SAS-mode questions); ``layout`` is the method's, the
  returned ``LoadedDraft.layout`` the one the checkpoint was trained on, which the
  drafter runs (a family refuses a checkpoint the method cannot use, naming the other);
* ``footprint(layout, spec_cfg, model_cfg, gamma) -> Footprint``: the draft's own tensors
  by format and its per-sequence cache, from headers (the memory check before loading);
* ``draft_dir(spec_cfg, model_cfg) -> Path`` and ``has_confidence_head(layout, spec_cfg,
  model_cfg) -> bool | None`` (headers only): where the draft is read from (its
  ``confidence_calibration.json`` sits there) and whether it scores its drafts, for
  ``spec.adaptive``.
"""

from __future__ import annotations

from typing import Any

from xspec.config import Calibration
from xspec.errors import ConfigError
from xspec.models.base import Footprint, StepOptions
from xspec.models.block_draft import BlockDrafts, BlockLayout, LoadedDraft
from xspec.registry import families_where, family_named
from xspec.spec.adaptive.calibration import calibration_path, load_calibration
from xspec.spec.block import BlockDrafter
from xspec.spec.drafter import DraftDepth

CALIBRATION_KEY = "spec.adaptive.calibration"


def _family(layout: BlockLayout, arch: str) -> BlockDrafts:
    """The family's block drafts; ConfigError when this target's family has none."""
    family = family_named(arch)
    if family is None or layout.value not in family.block_layouts:
        families = families_where(lambda f: layout.value in f.block_layouts)
        raise ConfigError(
            f"spec={layout.value} needs a target whose family has {layout.value} drafts "
            f"(model.arch: {', '.join(f.arch for f in families)}), not model.arch={arch}"
        )
    return family.block_drafts()


class DSparkDrafter(BlockDrafter):
    """DSpark: sample from the anchor, Markov head, optional confidence head."""

    method = BlockLayout.DSPARK  # spec.method; ``layout`` (set by __init__) is the draft's

    def __init__(
        self, cfg: Any, *, target: Any, model_cfg: Any, platform: Any, steps: StepOptions
    ) -> None:
        family = _family(self.method, model_cfg.arch)
        loaded: LoadedDraft = family.load_block_draft(
            self.method, cfg, target=target, model_cfg=model_cfg, platform=platform
        )
        gamma = int(cfg.num_speculative_tokens)  # resolved by build
        path = calibration_path(cfg.adaptive.calibration, loaded.path)
        calibration = None
        if path is not None and loaded.model.confidence is not None:
            calibration = load_calibration(path, gamma, CALIBRATION_KEY)
        super().__init__(
            loaded.model,
            layout=loaded.layout,  # e.g. DeepSpec's "dflash" drafts: the DSpark block
            gamma=gamma,
            capture_layer_ids=loaded.capture_layer_ids,
            device=platform.device(),
            calibration=calibration,
        )
        self.draft_dir = loaded.path  # where the weights (and a calibration file) are
        self.mask_drafts = bool(cfg.mask_drafts)  # structured output: xspec.spec.constrained
        self.calibration_file = path if calibration is not None else None

    @classmethod
    def draft_depth(cls, spec_cfg: Any, model_cfg: Any) -> DraftDepth:
        """The draft's trained block size (its config.json) by default; 1 when it cannot
        be read (preflight reports the checkpoint)."""
        try:
            trained = _family(cls.method, model_cfg.arch).trained_block_size(
                cls.method, spec_cfg, model_cfg
            )
        except ConfigError:
            trained = None
        return DraftDepth(default=trained or 1, trained=trained)

    @classmethod
    def preflight(cls, spec_cfg: Any, model_cfg: Any) -> list[str]:
        try:
            family = _family(cls.method, model_cfg.arch)
        except ConfigError as e:
            return [str(e)]
        problems = list(family.preflight_block_draft(cls.method, spec_cfg, model_cfg))
        if problems:
            return problems
        return _adaptive_problems(cls, family, spec_cfg, model_cfg)

    @classmethod
    def footprint(cls, spec_cfg: Any, model_cfg: Any, gamma: int) -> Footprint | None:
        try:
            family = _family(cls.method, model_cfg.arch)
        except ConfigError:
            return None  # preflight reports it
        return family.footprint(cls.method, spec_cfg, model_cfg, gamma)

    # spec.adaptive works with this drafter when its checkpoint has a confidence head
    supports_adaptive = True


def _adaptive_problems(
    cls: type[DSparkDrafter], family: BlockDrafts, spec_cfg: Any, model_cfg: Any
) -> list[str]:
    """``spec.adaptive`` without a confidence head; a calibration file that does not fit."""
    a = spec_cfg.adaptive
    explicit = a.calibration not in (Calibration.auto.value, Calibration.off.value)
    head = family.has_confidence_head(cls.method, spec_cfg, model_cfg)
    path = family.draft_dir(spec_cfg, model_cfg)
    if head is False and (a.enabled or explicit):
        setting = (
            "spec.adaptive.enabled=true" if a.enabled else f"{CALIBRATION_KEY}={a.calibration}"
        )
        return [
            f"{setting} needs a draft with a confidence head; the spec={cls.method.value} "
            f"draft in {path} has none (DSpark checkpoints store confidence_head.proj.weight; "
            f"DFlash drafts never have one); use spec=dspark with such a draft, or set "
            f"spec.adaptive.enabled=false"
        ]
    found = calibration_path(a.calibration, path) if head else None
    if found is None:
        return []
    try:
        load_calibration(found, spec_cfg.num_speculative_tokens, CALIBRATION_KEY)
    except ConfigError as e:
        return [str(e)]
    return []


class DFlashDrafter(DSparkDrafter):
    """DFlash: every block row sampled on its own, no Markov / confidence head. z-lab's
    drafts use the block ``[anchor, mask x gamma]``; DeepSpec's (``Qwen3DSparkModel`` with
    ``markov_rank`` 0) the DSpark block, which ``LoadedDraft.layout`` then says."""

    method = BlockLayout.DFLASH
