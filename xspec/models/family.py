"""What a model folder offers xspec: one :class:`ModelFamily` per family (torch-free).

The ``models`` registry maps ``model.arch`` to an *instance* of a subclass (the built-ins:
``xspec.models.qwen3:FAMILY``, ``xspec.models.deepseek_v4:FAMILY``; a plugin registers
its own through the entry-point group ``xspec.models``). Everything build, the drafters
and the CLI ask of a family before or while loading is a method here: the target loader,
header-only checks, the checkpoint directory, the routed-expert count, and the drafters
the family offers (block drafts for ``spec=dspark`` / ``spec=dflash``, an MTP layer for
``spec=mtp``). A family answers only for what it declares: ``block_layouts`` and
``offers_mtp`` say which drafter methods it implements, so a drafter never names a family.

Importing a family module must stay light (no torch): methods import model code lazily.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from xspec.models.base import Footprint, StepOptions, TargetModel
    from xspec.models.block_draft import BlockDrafts


class ModelFamily(abc.ABC):
    """One model family (a folder under ``xspec/models/``), registered as ``arch``."""

    arch: ClassVar[str]  # the registry name: ``model.arch`` and the folder name
    display_name: ClassVar[str]  # for messages ("DeepSeek-V4")
    # BlockLayout values ("dspark", "dflash") whose drafts :meth:`block_drafts` provides
    block_layouts: ClassVar[frozenset[str]] = frozenset()
    offers_mtp: ClassVar[bool] = False  # :meth:`preflight_mtp` / :meth:`load_mtp` exist
    # parallel.ep > 1: ``load(..., expert_parallel=...)`` loads one rank's experts
    supports_expert_parallel: ClassVar[bool] = False

    @abc.abstractmethod
    def load(
        self,
        cfg: Any,
        *,
        device: torch.device,
        max_rollback: int,
        steps: StepOptions,
        expert_parallel: Any = None,
    ) -> TargetModel:
        """The target model of the ``model`` config section, weights loaded, its step
        functions built with ``steps`` (the platform's ops and compiler). ``max_rollback``: the most rows a verify
        step may later truncate; ``expert_parallel`` (an
        :class:`~xspec.parallel.expert.ExpertParallel`, only when
        ``supports_expert_parallel``): load only this rank's experts. A bad checkpoint
        raises ``CheckpointError`` naming the tensor and file."""

    def preflight(self, cfg: Any) -> list[str]:
        """Problems of the checkpoint ``cfg`` names, from config.json and headers only."""
        return []

    def checkpoint_path(self, cfg: Any) -> Path | None:
        """The target checkpoint directory (its config.json and tokenizer), None when the
        family cannot name it before loading."""
        return None

    def num_routed_experts(self, cfg: Any) -> int | None:
        """Routed experts per MoE layer (``parallel.ep`` must divide it); None when
        unknown or unreadable (``preflight`` reports why)."""
        return None

    def footprint(self, cfg: Any, *, max_rollback: int) -> Footprint | None:
        """What the target will hold (weights by format, per-sequence KV), from config.json
        and the headers only, for the memory check before loading
        (:mod:`xspec.engine.memory`); None when the family cannot say (that check then
        waits for the loaded model). Called only on a checkpoint ``preflight`` passed."""
        return None

    # -- the drafters the family offers ---------------------------------------------

    def block_drafts(self) -> BlockDrafts:
        """The family's block-draft functions (``spec=dspark`` / ``spec=dflash``); called
        only when ``block_layouts`` names the method's layout."""
        raise NotImplementedError(f"{type(self).__name__} offers no block drafts")

    def preflight_mtp(self, spec_cfg: Any, model_cfg: Any) -> list[str]:
        """``spec=mtp``: problems of the MTP layer's checkpoint, from headers only."""
        raise NotImplementedError(f"{type(self).__name__} offers no MTP layer")

    def footprint_mtp(self, spec_cfg: Any, model_cfg: Any, *, gamma: int) -> Footprint:
        """``spec=mtp``: the MTP layer's :meth:`footprint` (its own tensors, its cache)."""
        raise NotImplementedError(f"{type(self).__name__} offers no MTP layer")

    def load_mtp(self, spec_cfg: Any, *, target: TargetModel, model_cfg: Any) -> Any:
        """``spec=mtp``: the loaded MTP module, sharing ``target``'s embedding and head."""
        raise NotImplementedError(f"{type(self).__name__} offers no MTP layer")
