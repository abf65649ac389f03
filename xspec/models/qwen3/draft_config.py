"""config.json of a Qwen3 DSpark / DFlash draft directory (torch-free).

Keys are read with the spellings xLLM, DeepSpec and z-lab DFlash use (first present wins);
the Qwen3 geometry keys go through :class:`~xspec.models.qwen3.args.Qwen3Args`. Every bad
key is collected into one :class:`~xspec.errors.CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xspec.errors import CheckpointError
from xspec.models.qwen3.args import Qwen3Args

# config.json spellings, first present wins (xLLM / DeepSpec / z-lab DFlash)
LAYER_ID_KEYS = ("dspark_target_layer_ids", "target_layer_ids", "dflash_config.target_layer_ids")
FILL_ID_KEYS = ("dflash_config.mask_token_id", "mask_token_id", "dspark_noise_token_id")
RANK_KEYS = ("markov_rank", "dspark_markov_rank")
BLOCK_KEYS = ("block_size", "dflash_config.block_size")


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
    problems: list[str] = []
    try:
        args = Qwen3Args.from_config(config, where)
        # DeepSpec copies the target's config (a MoE target's too) but its layers are dense
        args = dataclasses.replace(args, model_type="qwen3", num_experts=0)
    except CheckpointError as e:
        problems += e.problems
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
    return DraftConfig(args, layer_ids, fill_id or 0, rank, block, confidence, with_markov)
