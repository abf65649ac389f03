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


DSPARK_VERSION = "1"
DSPARK_STAGES = 3
DSPARK_BLOCK = 5


def dspark_config(args: DeepseekV4Args, *, markov_rank: int = 16) -> dict:
    """config.json of the tiny Flash-0731 layout: the target's, one compress ratio per
    stage after the main layers, and the dspark_* keys (the last three layers' outputs)."""
    n = args.num_hidden_layers
    cfg = args.to_config()
    cfg["compress_ratios"] = args.target_compress_ratios + [0] * DSPARK_STAGES
    cfg["num_nextn_predict_layers"] = DSPARK_STAGES
    cfg.update(
        dspark_block_size=DSPARK_BLOCK,
        dspark_markov_rank=markov_rank,
        dspark_noise_token_id=args.vocab_size - 1,
        dspark_target_layer_ids=list(range(n - DSPARK_STAGES, n)),
    )
    return cfg


def dspark_tensors(
    config: dict, seed: int, *, dedicated_vocab: bool = False, confidence: bool = True
) -> dict[str, torch.Tensor]:
    """Random DSpark stages ``mtp.0..2`` for ``config`` (official names); with
    ``dedicated_vocab`` also ``mtp.0.embed.weight`` / ``mtp.2.head.weight`` (QuaRot-style)."""
    from torch import nn

    from xspec.models.deepseek_v4.dspark import DSparkDraft

    args = DeepseekV4Args.from_config(config, "tiny DSpark config")
    d, vocab = args.hidden_size, args.vocab_size
    embed = None if dedicated_vocab else nn.Embedding(vocab, d, device="meta")
    head = None if dedicated_vocab else nn.Linear(d, vocab, bias=False, device="meta")
    draft = DSparkDraft(
        args,
        num_stages=len(config["dspark_target_layer_ids"]),
        markov_rank=config["dspark_markov_rank"],
        noise_token_id=config["dspark_noise_token_id"],
        confidence=confidence,
        embed=embed,
        head=head,
    )
    draft.init_random_(seed)
    return {k: t.detach() for k, t in draft.state_dict().items()}


def generate_tiny_dspark(path: Path, *, seed: int = 0, dedicated_vocab: bool = False) -> None:
    """The tiny checkpoint in the Flash-0731 layout: the ``tiny`` target's tensors (same
    seed, same bytes) + DSpark stages ``mtp.0..2`` in one directory, two+ shards."""
    from xspec.models.deepseek_v4.model import DeepseekV4Model

    args = DeepseekV4Args.tiny()
    model = DeepseekV4Model(args, dtype=torch.float32, device="cpu")
    model.init_random_(seed)
    config = dspark_config(args)
    tensors = dict(model.state_dict()) | dspark_tensors(
        config, seed + 2000, dedicated_vocab=dedicated_vocab
    )
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_checkpoint(path, tensors, config, max_shard_bytes=total // 2 + 1)


def tiny_dspark_dir(*, dedicated_vocab: bool = False) -> Path:
    """The tiny 0731-layout directory under $XSPEC_CACHE_DIR/presets (``spec=dspark`` with
    ``model=dsv4_tiny`` reads it; ``model.preset=tiny_0731`` names it), generated on first
    use. ``dedicated_vocab``: the QuaRot-style variant whose stages own their
    ``mtp.0.embed`` / ``mtp.2.head`` (``model.preset=tiny_0731_quarot``)."""
    if dedicated_vocab:
        return preset_dir(
            "dsv4_tiny_dspark_quarot",
            DSPARK_VERSION,
            lambda path: generate_tiny_dspark(path, dedicated_vocab=True),
        )
    return preset_dir("dsv4_tiny_dspark", DSPARK_VERSION, generate_tiny_dspark)
