"""Qwen3 / Qwen3-MoE target models (registry key ``qwen3``).

Importing this package is light: only the torch-free config schema is imported here;
torch, safetensors and the model code load when ``load_model`` runs (or when
``Qwen3Model`` / ``Qwen3State`` are first accessed). :data:`FAMILY` (a
:class:`Qwen3Family`) is what the ``models`` registry hands to xspec.

Checkpoint tensors are the Hugging Face names, mapped one to one onto the module.
Tolerated extras (skipped): ``lm_head.weight`` when ``tie_word_embeddings`` is true
(transformers ties it to the embedding and ignores the stored copy too), and
``*.rotary_emb.inv_freq`` buffers some old exports saved (recomputed from the config).
Any other unexpected tensor is an error: it usually means a wrong directory or an
unsupported variant (e.g. a quantised export), which loading silently would hide.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.errors import CheckpointError, UserError
from xspec.models.family import ModelFamily
from xspec.models.presets import dtype_name
from xspec.models.qwen3.args import Qwen3Args
from xspec.models.qwen3.presets import PRESETS, checkpoint_path

if TYPE_CHECKING:
    import torch

    from xspec.models.base import Footprint, StepOptions
    from xspec.models.block_draft import BlockDrafts
    from xspec.models.loading import Checkpoint
    from xspec.models.qwen3.model import Qwen3Model, Qwen3State

__all__ = [
    "FAMILY",
    "PRESETS",
    "Qwen3Args",
    "Qwen3Family",
    "Qwen3Model",
    "Qwen3State",
    "checkpoint_key",
    "load_model",
    "preflight",
]

_FLOAT_CODES = {"F32", "F16", "BF16", "F64"}


def __getattr__(name: str) -> Any:  # lazy: keep `import xspec.models.qwen3` torch-free
    if name in ("Qwen3Model", "Qwen3State"):
        from xspec.models.qwen3 import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(cfg: Any, *, device: torch.device, max_rollback: int) -> Qwen3Model:
    """Build the model described by the ``model`` config section and load its weights.

    ``cfg``: ``path`` (checkpoint dir; wins over ``preset``), ``preset`` ("tiny" or
    "moe_tiny", generated on first use), ``dtype`` (enum whose value is float32 /
    bfloat16 / float16), ``max_context`` (None = max_position_embeddings).
    ``max_rollback``: every layer is full attention, so any rollback is exact and
    free; the value is only checked.

    Everything is validated (config.json, tensor names / shapes / dtypes from the
    safetensors headers) before a parameter is allocated; weights then stream in one
    tensor at a time.
    """
    import torch

    from xspec.models.loading import Checkpoint, load_params
    from xspec.models.qwen3.model import Qwen3Model

    if max_rollback < 0:
        raise ValueError(f"max_rollback must be >= 0, got {max_rollback}")
    dtype = getattr(torch, dtype_name(cfg.dtype))
    ckpt = Checkpoint(checkpoint_path(cfg))
    args = Qwen3Args.from_config(ckpt.config, ckpt.path / "config.json")
    check_tensors(args, ckpt)
    model = Qwen3Model(args, dtype=dtype, device=device, max_context=cfg.max_context)
    load_params(model, ckpt, lambda name: checkpoint_key(name, args))
    model.checkpoint_dir = ckpt.path  # tokenizer.json, drafters stored beside the target
    return model.eval()


def preflight(cfg: Any) -> list[str]:
    """Problems of the checkpoint ``cfg`` names, from config.json and headers only."""
    from xspec.models.loading import Checkpoint

    try:
        ckpt = Checkpoint(checkpoint_path(cfg))
        check_tensors(Qwen3Args.from_config(ckpt.config, ckpt.path / "config.json"), ckpt)
    except UserError as e:
        return [str(e)]
    return []


def footprint(cfg: Any) -> Footprint:
    """The target's tensors at ``cfg.dtype`` and its K/V per token, from config.json and
    the headers (Qwen3 checkpoints are float; see :class:`~xspec.models.base.Footprint`)."""
    import torch

    from xspec.models.base import Footprint, KvBytes
    from xspec.models.loading import Checkpoint, held_bytes, require_tensors_for

    ckpt = Checkpoint(checkpoint_path(cfg))
    args = Qwen3Args.from_config(ckpt.config, ckpt.path / "config.json")
    require_tensors_for(ckpt, counts(args))
    itemsize = getattr(torch, dtype_name(cfg.dtype)).itemsize
    names = [n for n in ckpt.names() if checkpoint_key(n, args) is not None]
    per_token = args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * itemsize
    return Footprint(
        tensors={n: held_bytes(ckpt, n, itemsize) for n in names},
        kv=KvBytes(0, float(per_token)),  # as Qwen3Model.kv_bytes: full attention
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        max_context=cfg.max_context or args.max_position_embeddings,
    )


class Qwen3Family(ModelFamily):
    """Qwen3 / Qwen3-MoE targets, with DSpark and DFlash block drafts (:mod:`.dspark`)."""

    arch = "qwen3"
    display_name = "Qwen3"
    block_layouts = frozenset({"dspark", "dflash"})

    def load(
        self,
        cfg: Any,
        *,
        device: torch.device,
        max_rollback: int,
        steps: StepOptions,
        expert_parallel: Any = None,
    ) -> Qwen3Model:
        if expert_parallel is not None:
            raise ValueError("Qwen3 targets have no expert-parallel loader")
        # Qwen3 delegates no op to the platform (every op is its reference): of ``steps``
        # its forward reads only the GEMM row padding (``StepOptions.rows``)
        model = load_model(cfg, device=device, max_rollback=max_rollback)
        model.steps = steps
        return model

    def preflight(self, cfg: Any) -> list[str]:
        return preflight(cfg)

    def checkpoint_path(self, cfg: Any) -> Path:
        return checkpoint_path(cfg)

    def footprint(self, cfg: Any, *, max_rollback: int) -> Footprint:
        return footprint(cfg)  # full attention: rollback needs no extra rows

    def block_drafts(self) -> BlockDrafts:
        from xspec.models.qwen3 import block_drafts

        return block_drafts


FAMILY = Qwen3Family()


def checkpoint_key(name: str, args: Qwen3Args) -> str | None:
    """Module state_dict key for checkpoint tensor ``name`` (identity), None = skip."""
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return None
    if name.endswith("rotary_emb.inv_freq"):
        return None
    return name


def counts(args: Qwen3Args) -> dict[str, int]:
    """The config.json counts that each need tensors of their own (layers, experts)."""
    return {"num_hidden_layers": args.num_hidden_layers, "num_experts": args.num_experts}


def check_tensors(args: Qwen3Args, ckpt: Checkpoint) -> None:
    """Headers only: every expected tensor present with its shape and a float dtype, nothing
    unexpected. One CheckpointError lists every problem with tensor name and shard file."""
    from xspec.models.loading import require_tensors_for
    from xspec.models.qwen3.model import Qwen3Model

    require_tensors_for(ckpt, counts(args))
    expected = {k: list(v.shape) for k, v in Qwen3Model(args, device="meta").state_dict().items()}
    problems: list[str] = []
    for name in sorted(ckpt.names()):
        key = checkpoint_key(name, args)
        if key is None:
            continue
        shape, code = ckpt.meta(name)
        where = f"{name!r} in {ckpt.file_of(name).name}"
        if key not in expected:
            problems.append(f"unexpected tensor {where}: not part of this {args.model_type} model")
        elif shape != expected[key]:
            problems.append(f"tensor {where} has shape {shape}, expected {expected[key]}")
        elif code not in _FLOAT_CODES:
            problems.append(
                f"tensor {where} is {code}; only floating-point (F32/BF16/F16) Qwen3 checkpoints "
                "are supported (dequantise it first)"
            )
    present = set(ckpt.names())
    problems += [
        f"missing tensor {key!r} (shape {shape})"
        for key, shape in expected.items()
        if key not in present
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {ckpt.path} does not match its config.json "
            f"({args.model_type}, {args.num_hidden_layers} layers; {len(problems)} problem(s))",
            problems=problems,
        )
