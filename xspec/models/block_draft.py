"""What a block drafter (``spec=dspark`` / ``spec=dflash``, :mod:`xspec.spec.block`) needs
from a model family: the block layouts, the draft model's interface, and a loaded draft.
A family's draft module (``models/<family>/dspark.py``) implements :class:`BlockDrafts`
(``ModelFamily.block_drafts`` returns it) and loads a :class:`LoadedDraft`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from xspec.models.base import Footprint, KvBytes
from xspec.models.draft_heads import ConfidenceHead, MarkovHead


class BlockLayout(str, enum.Enum):
    DSPARK = "dspark"  # sample from the anchor row
    DFLASH = "dflash"  # the anchor row only conditions; mask rows are sampled

    def width(self, gamma: int) -> int:
        """Rows of the draft block for ``gamma`` drafts."""
        return gamma if self is BlockLayout.DSPARK else gamma + 1

    @property
    def first_row(self) -> int:
        """The block row that predicts the first draft (position ``p + 1``)."""
        return 0 if self is BlockLayout.DSPARK else 1


@runtime_checkable
class BlockDraftModel(Protocol):
    """What a block drafter's model provides. Caches count the context rows written:
    ``cache.num_tokens`` is the anchor's position ``p`` when ``propose`` runs."""

    fill_token_id: int  # noise (DSpark) / mask (DFlash) id of the rows after the anchor

    @property
    def markov(self) -> MarkovHead | None: ...

    @property
    def confidence(self) -> ConfidenceHead | None: ...

    def new_cache(self, gamma: int, max_tokens: int | None = None) -> Any:
        """One sequence's empty context cache (``max_tokens`` caps growing buffers);
        it exposes ``nbytes_allocated()``."""
        ...

    def kv_bytes(self, gamma: int) -> KvBytes:
        """Analytic per-sequence bytes of :meth:`new_cache`."""
        ...

    def snapshot(self, cache: Any, start: int) -> Any:
        """A prefix-cache snapshot of ``cache`` (:meth:`xspec.spec.drafter.Drafter.snapshot`):
        what it gained since ``start`` and what a continuation reads; ``nbytes()``."""
        ...

    def restore(self, cache: Any, chain: Sequence[Any]) -> None:
        """Fill the empty ``cache`` with ``chain`` (consecutive blocks from position 0)."""
        ...

    def write_context(self, caches: list[Any], aux: torch.Tensor, seq_lens: list[int]) -> None:
        """Context K/V of ``seq_lens[b]`` new committed positions per sequence from the
        target's captured hidden ``aux [sum seq_lens, K*d]`` (rows in sequence order)."""
        ...

    def forward_block(
        self, caches: list[Any], tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``tokens [B, W]`` at positions ``p_b .. p_b+W-1`` -> (``hidden [B, W, d]``, the
        confidence head's input; raw ``logits [B, W, V]`` fp32). Writes no cache."""
        ...


@dataclass
class LoadedDraft:
    model: BlockDraftModel
    trained_block_size: int  # gamma when spec.num_speculative_tokens is null
    capture_layer_ids: list[int]  # raw checkpoint ids, in the order the draft concatenates
    path: Path  # the draft's directory (a calibration file sits next to its weights)
    layout: BlockLayout  # the block the draft was trained on (may differ from the method's)


class BlockDrafts(Protocol):
    """A family's block-draft functions (its ``block_drafts.py`` module satisfies this).
    ``layout`` is the method's; headers / config.json only, except ``load_block_draft``."""

    def preflight_block_draft(
        self, layout: BlockLayout, spec_cfg: Any, model_cfg: Any, /
    ) -> list[str]:
        """Every problem of the draft checkpoint (nothing allocated)."""
        ...

    def trained_block_size(
        self, layout: BlockLayout, spec_cfg: Any, model_cfg: Any, /
    ) -> int | None:
        """The default gamma (None when unreadable: preflight says why)."""
        ...

    def has_confidence_head(
        self, layout: BlockLayout, spec_cfg: Any, model_cfg: Any, /
    ) -> bool | None:
        """Whether the draft scores its drafts (for ``spec.adaptive``)."""
        ...

    def footprint(
        self, layout: BlockLayout, spec_cfg: Any, model_cfg: Any, gamma: int, /
    ) -> Footprint:
        """The draft's own tensors and per-sequence cache, from headers only (for the
        memory check before loading); called on a draft ``preflight_block_draft`` passed."""
        ...

    def draft_dir(self, spec_cfg: Any, model_cfg: Any, /) -> Path:
        """Where the draft is read from (its ``confidence_calibration.json`` sits there)."""
        ...

    def load_block_draft(
        self, layout: BlockLayout, spec_cfg: Any, /, *, target: Any, model_cfg: Any, platform: Any
    ) -> LoadedDraft:
        """The loaded draft; ``LoadedDraft.layout`` is the one it was trained on (a family
        refuses a checkpoint the method cannot use, naming the other method)."""
        ...
