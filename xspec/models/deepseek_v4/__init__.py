"""DeepSeek-V4 (Flash) target model (registry key ``deepseek_v4``).

Importing this package is light: only the torch-free config schema is imported here;
torch, safetensors and the model code load when :func:`load_model` runs (or when
``DeepseekV4Model`` is first accessed).

Checkpoints: the official DeepSeek layout (names equal the module's state_dict keys),
its W8A8 (msModelSlim) and FP8-block variants, and QuaRot checkpoints; see
:mod:`xspec.models.deepseek_v4.weights`. ``model.preset: tiny`` is a small random
checkpoint with every Flash feature, generated on first use (:mod:`.tiny`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.presets import checkpoint_dir, dtype_name, shipped_dir

if TYPE_CHECKING:
    import torch

    from xspec.models.deepseek_v4.model import DeepseekV4Model

__all__ = [
    "PRESETS",
    "PRESET_DRAFTS",
    "DeepseekV4Args",
    "DeepseekV4Model",
    "checkpoint_path",
    "load_model",
    "preflight",
]


def _tiny() -> Path:
    return shipped_dir("dsv4_tiny")


def _tiny_dspark() -> Path:
    return shipped_dir("dsv4_tiny_dspark")


def _tiny_random() -> Path:
    from xspec.models.deepseek_v4.tiny import tiny_dir

    return tiny_dir()


def _tiny_random_dspark() -> Path:
    from xspec.models.deepseek_v4.tiny import tiny_dspark_dir

    return tiny_dspark_dir()


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


def __getattr__(name: str) -> Any:  # lazy: keep `import xspec.models.deepseek_v4` torch-free
    if name == "DeepseekV4Model":
        from xspec.models.deepseek_v4 import model

        return model.DeepseekV4Model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(
    cfg: Any, *, device: torch.device, max_rollback: int, expert_parallel: Any = None
) -> DeepseekV4Model:
    """Build the model described by the ``model`` config section and load its weights.

    ``cfg``: ``path`` (checkpoint dir; wins over ``preset``), ``preset`` (e.g. "tiny",
    generated on first use), ``dtype`` (an enum whose value is float32 / bfloat16 /
    float16), ``max_context`` (None = the model's default). config.json and every tensor
    header are validated before anything is allocated; weights then stream in one tensor
    at a time. The returned model carries ``checkpoint_dir`` (drafters read it).
    ``expert_parallel`` (an :class:`~xspec.parallel.expert.ExpertParallel`): load only
    this rank's experts; the drafters then load theirs the same way.
    """
    import torch

    from xspec.models.deepseek_v4.weights import load_checkpoint

    dtype = getattr(torch, dtype_name(cfg.dtype))
    return load_checkpoint(
        checkpoint_path(cfg),
        dtype=dtype,
        device=device,
        max_rollback=max_rollback,
        max_context=cfg.max_context,
        expert_parallel=expert_parallel,
    )


def preflight(cfg: Any) -> list[str]:
    """Problems of the checkpoint ``cfg`` names, from config.json and headers only."""
    from xspec.errors import UserError
    from xspec.models.deepseek_v4.weights import check_checkpoint
    from xspec.models.loading import CONFIG_NAME, Checkpoint

    try:
        ckpt = Checkpoint(checkpoint_path(cfg))
        check_checkpoint(ckpt, DeepseekV4Args.from_config(ckpt.config, ckpt.path / CONFIG_NAME))
    except UserError as e:
        return [str(e)]
    return []


def num_routed_experts(cfg: Any) -> int | None:
    """The target's routed experts per MoE layer (config.json; None when unreadable:
    ``preflight`` reports why). ``parallel.ep`` must divide it."""
    from xspec.errors import UserError
    from xspec.models.loading import Checkpoint

    try:
        value = Checkpoint(checkpoint_path(cfg)).config.get("n_routed_experts")
    except UserError:
        return None
    return value if isinstance(value, int) else None


# read by xspec.build.check
load_model.preflight = preflight  # type: ignore[attr-defined]
load_model.num_routed_experts = num_routed_experts  # type: ignore[attr-defined]
load_model.checkpoint_path = lambda cfg: checkpoint_path(cfg)  # type: ignore[attr-defined]


def checkpoint_path(cfg: Any) -> Path:
    """``cfg.path``, else the built-in preset's directory (generated on first use)."""
    return checkpoint_dir(cfg, PRESETS, family="DeepSeek-V4", example="/dir/of/DeepSeek-V4-Flash")
