"""DeepSeek-V4 presets (``model.preset``) and where a run's target checkpoint is: the
family (``__init__``) and its DSpark drafts (:mod:`.dspark`) both read these."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from xspec.models.presets import cached, checkpoint_dir, shipped_dir


def _tiny() -> Path:
    return shipped_dir("dsv4_tiny")


def _tiny_dspark() -> Path:
    return shipped_dir("dsv4_tiny_dspark")


@cached
def _tiny_random() -> Path:
    from xspec.models.deepseek_v4.tiny import tiny_dir

    return tiny_dir()


@cached
def _tiny_random_dspark() -> Path:
    from xspec.models.deepseek_v4.tiny import tiny_dspark_dir

    return tiny_dspark_dir()


@cached
def _tiny_random_dspark_quarot() -> Path:
    from xspec.models.deepseek_v4.tiny import tiny_dspark_dir

    return tiny_dspark_dir(dedicated_vocab=True)


# model.preset -> its directory. ``tiny``: the trained checkpoint shipped in the package
# (target + its MTP layer, tokenizer.json; docs/training.md rebuilds it). ``tiny_random``:
# a random one with every feature, generated on first use (tests), and the same random
# target in the Flash-0731 layout (DSpark stages mtp.0..2; the QuaRot-style variant with
# dedicated vocabulary tensors)
PRESETS: dict[str, Callable[[], Path]] = {
    "tiny": _tiny,
    "tiny_random": _tiny_random,
    "tiny_random_0731": _tiny_random_dspark,
    "tiny_random_0731_quarot": _tiny_random_dspark_quarot,
}
# (model.preset, spec method) -> a companion draft directory, when spec.draft_path is null:
# the trained DSpark stages of ``tiny``; the random 0731-layout checkpoint of ``tiny_random``
PRESET_DRAFTS: dict[tuple[str, str], Callable[[], Path]] = {
    ("tiny", "dspark"): _tiny_dspark,
    ("tiny_random", "dspark"): _tiny_random_dspark,
}


def checkpoint_path(cfg: Any) -> Path:
    """``cfg.path``, else the built-in preset's directory (generated on first use)."""
    return checkpoint_dir(cfg, PRESETS, family="DeepSeek-V4", example="/dir/of/DeepSeek-V4-Flash")
