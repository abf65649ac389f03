"""Which model family a ``config.json`` describes (torch-free).

A checkpoint given to the wrong model option (a Qwen3 directory under
``model=dsv4_flash``, or the reverse) would otherwise fail with a list of missing keys
and tensors; recognising the family from ``model_type`` / ``architectures`` turns that
into one message naming the option that loads it.
"""

from __future__ import annotations

from pathlib import Path

from xspec.errors import CheckpointError

# family key -> (display name, how to load it)
FAMILIES = {
    "qwen3": ("Qwen3", "model=qwen3"),
    "deepseek_v4": ("DeepSeek-V4", "model=dsv4_flash"),
    "deepseek_v4_mtp": (
        "exported DeepSeek-V4 MTP drafter",
        "spec.draft_path with model=dsv4_flash spec=mtp",
    ),
}
_MODEL_TYPES = {
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "deepseek_v4": "deepseek_v4",
    "deepseek_v4_mtp": "deepseek_v4_mtp",
}
_ARCHITECTURE_PREFIXES = {"Qwen3": "qwen3", "DeepseekV4": "deepseek_v4"}


def family_of(config: dict) -> str | None:
    """The family key of a parsed config.json, or None when it names no known family."""
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in _MODEL_TYPES:
        return _MODEL_TYPES[model_type]
    architectures = config.get("architectures")
    for arch in architectures if isinstance(architectures, list) else []:
        for prefix, family in _ARCHITECTURE_PREFIXES.items():
            if isinstance(arch, str) and arch.startswith(prefix):
                return family
    return None


def check_family(config: dict, where: Path | str, accepted: tuple[str, ...]) -> None:
    """Raise one CheckpointError when ``config`` belongs to a known family not in ``accepted``."""
    family = family_of(config)
    if family is None or family in accepted:
        return
    name, how = FAMILIES[family]
    expected = FAMILIES[accepted[0]][0]
    found = config.get("model_type") or config.get("architectures")
    raise CheckpointError(
        f"{where}: this is a {name} checkpoint ({found!r}), not a {expected} one; use it with {how}"
    )
