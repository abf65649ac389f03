"""The ``tiny`` DeepSeek-V4 preset: a small random checkpoint with every Flash feature.

``DeepseekV4Args.tiny()`` (SWA, CSA and HCA layers, 3 hash
layers, hc_mult 4, index_topk 8) with ``init_random_(seed)`` weights, written in the
official layout as 2+ safetensors shards (so the index path is always exercised) with
``config.json = args.to_config()``. Generation is deterministic: same bytes every run.

Bump :data:`VERSION` whenever the generated content changes (model init, extra
tensors, config): the cache directory name includes it, so stale presets are never
reused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.loading import preset_dir, write_checkpoint

VERSION = "2"


def extra_tensors(args: DeepseekV4Args, seed: int) -> dict[str, torch.Tensor]:
    """Tensors stored next to the target's: the MTP layer ``mtp.0.*`` (official layout,
    random like the target, sharing its ``embed`` / ``head``, so ``spec=mtp`` runs)."""
    from torch import nn

    from xspec.models.deepseek_v4.mtp import OFFICIAL, MtpBlock, mtp_tensors

    d, vocab = args.hidden_size, args.vocab_size
    # meta stand-ins for the target's shared vocabulary: never stored, never allocated
    embed = nn.Embedding(vocab, d, device="meta")
    head = nn.Linear(d, vocab, bias=False, device="meta")
    mtp = MtpBlock(args, layer_id=args.num_hidden_layers, embed=embed, head=head)
    mtp.init_random_(seed + 1000)  # its own stream, not a copy of the target's layer 0
    return mtp_tensors(mtp, OFFICIAL)


def generate_tiny(path: Path, *, seed: int = 0) -> None:
    """Write the tiny checkpoint directory ``path`` (must not exist or be empty)."""
    from xspec.models.deepseek_v4.model import DeepseekV4Model

    args = DeepseekV4Args.tiny()
    model = DeepseekV4Model(args, dtype=torch.float32, device="cpu")
    model.init_random_(seed)
    tensors = dict(model.state_dict()) | extra_tensors(args, seed)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    # about half the bytes per shard -> at least two shards
    write_checkpoint(path, tensors, args.to_config(), max_shard_bytes=total // 2 + 1)


def tiny_dir() -> Path:
    """The preset directory under $XSPEC_CACHE_DIR/presets, generated on first use."""
    return preset_dir("dsv4_tiny", VERSION, generate_tiny)
