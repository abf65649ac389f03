"""config.json of a Qwen3 DSpark / DFlash draft directory (torch-free).

Keys are read with the spellings xLLM, DeepSpec and z-lab DFlash use (first present wins);
the Qwen3 geometry keys go through :class:`~xspec.models.qwen3.args.Qwen3Args`. Every bad
key is collected into one :class:`~xspec.errors.CheckpointError` naming the file; a
config.json of another family (e.g. a DeepSeek-V4 DSpark directory) is refused with one
message naming the family and the option that loads it.

The block layout the draft was trained with is read from the config too (see
:func:`trained_layout`): the same tensors serve two layouts that differ by one row, so a
draft read with the other one proposes every token one position off.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xspec.errors import CheckpointError
from xspec.models.families import FAMILIES, family_of
from xspec.models.qwen3.args import Qwen3Args

# config.json spellings, first present wins (xLLM / DeepSpec / z-lab DFlash)
LAYER_ID_KEYS = ("dspark_target_layer_ids", "target_layer_ids", "dflash_config.target_layer_ids")
FILL_ID_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id")
RANK_KEYS = ("markov_rank", "dspark_markov_rank")
BLOCK_KEYS = ("block_size", "dflash_config.block_size")
# block layouts (the values of xspec.spec.block.BlockLayout), recognised by
# architectures first, then by the key spellings
DSPARK_ARCHITECTURES = ("Qwen3DSparkModel",)  # DeepSpec: DSpark and its "dflash" configs
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)  # z-lab DFlash


@dataclass(frozen=True)
class DraftConfig:
    """What a Qwen3 DSpark / DFlash draft's config.json says."""

    args: Qwen3Args  # geometry of the draft layers (always dense)
    target_layer_ids: list[int]  # raw checkpoint ids, -1 = embedding output
    fill_token_id: int  # mask (DFlash) / noise (DSpark) id of the rows after the anchor
    markov_rank: int  # 0 = no Markov head
    block_size: int | None  # trained block size (rows of the trained block)
    confidence: bool  # enable_confidence_head
    confidence_with_markov: bool
    layout: str | None  # the trained block layout ("dspark" | "dflash"), None = unknown
    layout_source: str  # what in config.json says so (for messages)


def trained_layout(config: dict) -> tuple[str | None, str]:
    """(block layout, the config entry that names it) of a draft's config.json.

    * ``dspark`` (``[anchor, noise x (gamma-1)]``, row i predicts ``p+i+1``):
      ``architectures`` ``Qwen3DSparkModel`` (DeepSpec; its "dflash" configs are this
      layout with ``markov_rank`` 0), or xLLM's ``dspark_*`` keys;
    * ``dflash`` (``[anchor, mask x gamma]``, row i predicts ``p+i``): ``architectures``
      ``DFlashDraftModel`` or a ``dflash_config`` object (z-lab DFlash);
    * None: nothing says (the requested method's layout is used).
    """
    archs = config.get("architectures")
    for arch in archs if isinstance(archs, list) else []:
        if arch in DSPARK_ARCHITECTURES:
            return "dspark", f"architectures {archs!r}"
        if arch in DFLASH_ARCHITECTURES:
            return "dflash", f"architectures {archs!r}"
    if isinstance(config.get("dflash_config"), dict):
        return "dflash", "a 'dflash_config' object"
    dspark_keys = sorted(k for k in config if k.startswith("dspark_"))
    if dspark_keys:
        return "dspark", f"keys {dspark_keys}"
    return None, "no architectures / dflash_config / dspark_* key"


def _foreign_family(config: dict, where: Path) -> None:
    """Refuse a config.json of another model family with the option that loads it."""
    family = family_of(config)
    if family is None or family == "qwen3":
        return
    name, how = FAMILIES[family]
    if family == "deepseek_v4" and any(k.startswith("dspark_") for k in config):
        name, how = f"{name} DSpark", f"{how} spec=dspark (a DeepSeek-V4 target)"
    found = config.get("model_type") or config.get("architectures")
    raise CheckpointError(
        f"{where}: this is a {name} checkpoint ({found!r}), not a Qwen3 DSpark/DFlash draft; "
        f"use it with {how}"
    )


def _lookup(config: dict, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    """(key, value) of the first dotted key present in ``config``."""
    for key in keys:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return key, node
    return None


def _int(found: tuple[str, Any] | None, problems: list[str], *, low: int) -> int | None:
    if found is None:
        return None
    key, value = found
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        problems.append(f"{key!r} must be an integer >= {low}, got {value!r}")
        return None
    return value


def _flag(config: dict, key: str, problems: list[str]) -> bool:
    value = config.get(key, False)
    if not isinstance(value, bool):
        problems.append(f"{key!r} must be true or false, got {value!r}")
        return False
    return value


def parse_config(config: dict, where: Path) -> DraftConfig:
    """Validate a draft's config.json; one CheckpointError naming every bad key."""
    _foreign_family(config, where)
    problems: list[str] = []
    try:
        args = Qwen3Args.from_config(config, where)
        # DeepSpec copies the target's config (a MoE target's too) but its layers are dense
        args = dataclasses.replace(args, model_type="qwen3", num_experts=0)
    except CheckpointError as e:
        problems += e.problems or [str(e)]  # a message without a list is the whole reason
        args = None
    ids = _lookup(config, LAYER_ID_KEYS)
    layer_ids: list[int] = []
    if ids is None:
        problems.append(f"missing key: one of {list(LAYER_ID_KEYS)} (the target layer ids)")
    elif not (
        isinstance(ids[1], list)
        and ids[1]
        and all(isinstance(i, int) and not isinstance(i, bool) for i in ids[1])
    ):
        problems.append(f"{ids[0]!r} must be a non-empty list of layer ids, got {ids[1]!r}")
    else:
        layer_ids = list(ids[1])
    fill = _lookup(config, FILL_ID_KEYS)
    if fill is None:
        problems.append(f"missing key: one of {list(FILL_ID_KEYS)} (the mask / noise token id)")
    fill_id = _int(fill, problems, low=0)
    if fill_id is not None and args is not None and fill_id >= args.vocab_size:
        problems.append(
            f"{fill[0]!r} = {fill_id} is outside the draft vocabulary (vocab_size {args.vocab_size})"  # type: ignore[index]
        )
    rank = _int(_lookup(config, RANK_KEYS), problems, low=0) or 0
    kind = str(config.get("markov_head_type", "vanilla")).lower()
    if rank and kind != "vanilla":
        problems.append(
            f"markov_head_type={kind!r} is not supported yet (only 'vanilla'; "
            "markov_rank > 0 needs it)"
        )
    block = _int(_lookup(config, BLOCK_KEYS), problems, low=1)
    confidence = _flag(config, "enable_confidence_head", problems)
    with_markov = confidence and _flag(config, "confidence_head_with_markov", problems)
    if with_markov and not rank:
        problems.append("confidence_head_with_markov=true needs a Markov head (markov_rank > 0)")
    if problems or args is None:
        raise CheckpointError(
            f"{where}: invalid Qwen3 DSpark/DFlash draft config ({len(problems)} problem(s))",
            problems=problems,
        )
    layout, source = trained_layout(config)
    return DraftConfig(
        args, layer_ids, fill_id or 0, rank, block, confidence, with_markov, layout, source
    )
