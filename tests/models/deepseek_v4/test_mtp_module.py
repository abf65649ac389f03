"""The DeepSeek-V4 MTP module: formula, chunking/rollback invariance, layouts, loading errors."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from xspec.errors import CheckpointError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.model import Block
from xspec.models.deepseek_v4.mtp import (
    EXPORTED,
    EXPORTED_MODEL_TYPE,
    OFFICIAL,
    MtpBlock,
    load_mtp,
    module_key,
    mtp_tensors,
    plan_mtp,
)
from xspec.models.deepseek_v4.state import BlockContext
from xspec.models.loading import write_checkpoint
from xspec.models.resident import QuantLinear

SEQ = 300  # crosses the 128-token window and wraps the SWA ring twice


def vocab_modules(args: DeepseekV4Args, seed: int) -> tuple[nn.Embedding, nn.Linear]:
    """Random stand-ins for the target's ``embed`` / ``head``."""
    g = torch.Generator().manual_seed(seed)
    embed = nn.Embedding(args.vocab_size, args.hidden_size)
    head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(embed.weight.shape, generator=g))
        head.weight.copy_(torch.randn(head.weight.shape, generator=g) / args.hidden_size**0.5)
    return embed, head


def make_mtp(args: DeepseekV4Args, seed: int = 0, **kw) -> tuple[MtpBlock, nn.Embedding, nn.Linear]:
    embed, head = vocab_modules(args, seed + 100)
    mtp = MtpBlock(args, layer_id=args.num_hidden_layers, embed=embed, head=head, **kw)
    mtp.init_random_(seed)
    return mtp.eval(), embed, head


def inputs(args: DeepseekV4Args, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-like hidden ``[n, hc, d]`` and next tokens ``[n]``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, args.hc_mult, args.hidden_size, generator=g)
    return hidden, torch.randint(0, args.vocab_size, (n,), generator=g)


def rows(mtp: MtpBlock, cache, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Append ``hidden [S, hc, d]`` / ``tokens [S]`` to one sequence's cache -> ``[S, hc, d]``."""
    start, n = cache.num_tokens, tokens.shape[0]
    ctx = BlockContext(tokens, torch.arange(start, start + n), [n], [start], [cache])
    return mtp.draft_hidden(hidden, tokens, ctx)


def rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def reference(
    mtp: MtpBlock, embed: nn.Embedding, head: nn.Linear, hidden: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP formula written out: combine, one Block forward over the whole sequence on a
    fresh cache, hc_head, norm, head -> (hidden ``[S, hc, d]``, logits ``[S, V]``)."""
    a, eps = mtp.args, mtp.args.rms_norm_eps
    e = rms(embed.weight[tokens], eps, mtp.enorm.weight) @ mtp.e_proj.weight.T  # [S, d]
    h = rms(hidden, eps, mtp.hnorm.weight) @ mtp.h_proj.weight.T  # [S, hc, d], per stream
    n = tokens.shape[0]
    cache = mtp.new_cache(max_rollback=0, max_context=a.max_position_embeddings)
    ctx = BlockContext(tokens, torch.arange(n), [n], [0], [cache])
    x = Block.forward(mtp, e[:, None] + h, ctx)
    mix = rms(x.flatten(1), eps) @ mtp.hc_head_fn.T  # [S, hc]
    pre = torch.sigmoid(mix * mtp.hc_head_scale + mtp.hc_head_base) + a.hc_eps
    y = (pre[..., None] * x).sum(1)  # [S, d]
    return x, rms(y, eps, mtp.norm.weight) @ head.weight.T


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("config", ["tiny", "variant"])
@torch.no_grad()
def test_chunked_with_rollback_equals_reference(dsv4, config: str) -> None:
    """Chunks of any size, each followed by speculative rows that are rolled back, give the
    written-out formula over the whole sequence."""
    args = dsv4.configs[config]()
    mtp, embed, head = make_mtp(args)
    hidden, tokens = inputs(args, SEQ, seed=1)
    want_x, want_logits = reference(mtp, embed, head, hidden, tokens)

    cache = mtp.new_cache(max_rollback=3, max_context=args.max_position_embeddings)
    junk_h, junk_t = inputs(args, 3, seed=2)
    got, pos = [], 0
    for n in (50, 1, 77, 3, 1, 100, 68):
        got.append(rows(mtp, cache, hidden[pos : pos + n], tokens[pos : pos + n]))
        pos += n
        rows(mtp, cache, junk_h, junk_t)  # drafts beyond the committed context ...
        cache.truncate(pos)  # ... rolled back exactly
    x = torch.cat(got)
    assert pos == SEQ
    dx, dl = max_diff(x, want_x), max_diff(mtp.draft_logits(x), want_logits)
    assert dx <= 1e-5 and dl <= 1e-5, f"max abs diff: hidden {dx:.3g}, logits {dl:.3g}"


def test_name_map() -> None:
    assert module_key(OFFICIAL, "mtp.0.attn.wq_a.weight") == "attn.wq_a.weight"
    assert module_key(OFFICIAL, "mtp.0.hc_head_fn") == "hc_head_fn"
    assert module_key(OFFICIAL, "mtp.0.emb.tok_emb.weight") == "embed.weight"
    assert module_key(OFFICIAL, "rot.weight") == "rot.weight"
    assert module_key(OFFICIAL, "layers.0.attn.wq_a.weight") is None  # the target's
    assert module_key(OFFICIAL, "embed.weight") is None  # the target's, shared
    assert module_key(EXPORTED, "model.layers.0.ffn.gate.bias") == "ffn.gate.bias"
    assert module_key(EXPORTED, "model.embed_tokens.weight") == "embed.weight"
    assert module_key(EXPORTED, "model.layers.0.shared_head.head.weight") == "head.weight"
    assert module_key(EXPORTED, "model.layers.0.shared_head.norm.weight") == "norm.weight"
    assert module_key(EXPORTED, "model.rot.weight") == "rot.weight"
    assert module_key(EXPORTED, "mtp.0.e_proj.weight") is None


# -- checkpoints ---------------------------------------------------------------------------


def write_official(
    path: Path,
    mtp: MtpBlock,
    extra: dict[str, torch.Tensor] | None = None,
    *,
    extra_first: bool = False,
) -> Path:
    """Target-style ``embed``/``head`` + ``mtp.0.*`` (+ ``extra``) in several shards."""
    args = mtp.args
    target = dict(zip(("embed.weight", "head.weight"), vocab_modules(args, 7)))
    target = {k: m.weight.detach() for k, m in target.items()}
    tensors = mtp_tensors(mtp, OFFICIAL)
    extra = extra or {}
    ordered = {**extra, **target, **tensors} if extra_first else {**target, **tensors, **extra}
    write_checkpoint(path, ordered, args.to_config(), max_shard_bytes=1 << 20)
    return path


def write_exported(path: Path, mtp: MtpBlock, vocab: dict[str, torch.Tensor] | None = None) -> Path:
    """The xLLM export_mtp layout of ``mtp`` (without its shared vocabulary)."""
    config = mtp.args.to_config() | {
        "model_type": EXPORTED_MODEL_TYPE,
        "architectures": ["DeepseekV4MtpForCausalLM"],
        "num_hidden_layers": 1,
        "num_nextn_predict_layers": 1,
        "num_hash_layers": 0,
        "first_k_dense_replace": 0,
        "quantization_config": "",
    }
    write_checkpoint(path, mtp_tensors(mtp, EXPORTED) | (vocab or {}), config)
    return path


def load(path: Path, embed: nn.Embedding, head: nn.Linear, args: DeepseekV4Args) -> MtpBlock:
    return load_mtp(plan_mtp(path, args), embed=embed, head=head, dtype=torch.float32, device="cpu")


@torch.no_grad()
def test_official_and_exported_layouts_load_the_same_module(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, embed, head = make_mtp(args)
    official = load(write_official(tmp_path / "official", mtp), embed, head, args)
    exported_plan = plan_mtp(write_exported(tmp_path / "exported", mtp), args)
    assert exported_plan.layout is EXPORTED and exported_plan.layer_id == 0
    exported = load_mtp(exported_plan, embed=embed, head=head, dtype=torch.float32, device="cpu")
    want = mtp.state_dict()
    for loaded in (official, exported):
        assert loaded.owns_vocab == (False, False)  # the target's embed/head are shared
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("extra_first", [False, True], ids=["dedicated-last", "dedicated-first"])
@torch.no_grad()
def test_dedicated_vocabulary_wins_in_any_shard_order(tmp_path: Path, extra_first: bool) -> None:
    args = DeepseekV4Args.tiny()
    mtp, embed, head = make_mtp(args)
    own_embed, own_head = vocab_modules(args, seed=99)
    dedicated = {
        "mtp.0.embed.weight": own_embed.weight.detach(),
        "mtp.0.head.weight": own_head.weight.detach(),
    }
    path = write_official(tmp_path / "ckpt", mtp, dedicated, extra_first=extra_first)
    loaded = load(path, embed, head, args)  # offered the target's vocab, must not use it
    assert loaded.owns_vocab == (True, True)
    hidden, tokens = inputs(args, 5, seed=3)
    want_x, want_logits = reference(mtp, own_embed, own_head, hidden, tokens)
    x = rows(loaded, loaded.new_cache(max_rollback=0, max_context=4096), hidden, tokens)
    assert max_diff(x, want_x) <= 1e-5 and max_diff(loaded.draft_logits(x), want_logits) <= 1e-5


@torch.no_grad()
def test_exported_vocabulary_aliases(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, embed, head = make_mtp(args)
    own_embed, own_head = vocab_modules(args, seed=5)
    vocab = {
        "model.embed_tokens.weight": own_embed.weight.detach(),
        "model.layers.0.shared_head.head.weight": own_head.weight.detach(),
    }
    loaded = load(write_exported(tmp_path / "exp", mtp, vocab), embed, head, args)
    assert loaded.owns_vocab == (True, True)
    assert torch.equal(loaded.embed.weight, own_embed.weight)
    assert torch.equal(loaded.head.weight, own_head.weight)


@torch.no_grad()
def test_rot_applies_to_the_target_hidden_before_hnorm(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, embed, head = make_mtp(args)
    q, _ = torch.linalg.qr(
        torch.randn(args.hidden_size, args.hidden_size, generator=torch.Generator().manual_seed(4))
    )
    loaded = load(write_official(tmp_path / "rot", mtp, {"rot.weight": q}), embed, head, args)
    assert loaded.rot is not None
    hidden, tokens = inputs(args, 6, seed=5)
    want, _ = reference(mtp, embed, head, hidden @ q.T, tokens)  # rot(H) = H R^T
    got = rows(loaded, loaded.new_cache(max_rollback=0, max_context=4096), hidden, tokens)
    assert max_diff(got, want) <= 1e-5, f"max abs diff {max_diff(got, want):.3g}"


@pytest.mark.parametrize("scheme", ["w8a8", "fp8"])
@torch.no_grad()
def test_quantised_mtp_is_resident(tmp_path: Path, scheme: str) -> None:
    """The MTP block's quantized linears stay as stored; dequantized, they are within the
    format's step of the float weights."""
    from xspec.models.deepseek_v4.convert import quantize_fp8, quantize_w8a8

    args = DeepseekV4Args.tiny()
    mtp, embed, head = make_mtp(args)
    quantize = quantize_w8a8 if scheme == "w8a8" else quantize_fp8
    quantize(write_official(tmp_path / "float", mtp), tmp_path / "q")
    plan = plan_mtp(tmp_path / "q", args)
    assert plan.dequant.get("mtp.0.attn.wq_a.weight") == scheme
    loaded = load_mtp(plan, embed=embed, head=head, dtype=torch.float32, device="cpu")
    stored = {"w8a8": torch.int8, "fp8": torch.float8_e4m3fn}[scheme]
    assert isinstance(loaded.attn.wq_a, QuantLinear)
    assert loaded.attn.wq_a.weight.dtype == stored
    w, q = mtp.attn.wq_a.weight, loaded.attn.wq_a.quantized().dequantize()
    if scheme == "w8a8":  # symmetric per-channel int8: within half a step
        bound = w.abs().amax(dim=1, keepdim=True) / 127 / 2 + 1e-7
    else:  # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 (plus subnormal steps)
        bound = w.abs() * 2**-4 + 2**-9 * w.abs().max()
    assert ((w - q).abs() <= bound).all(), f"max abs diff {max_diff(w, q):.3g}"
    assert torch.equal(loaded.e_proj.weight, mtp.e_proj.weight)  # left FLOAT by the recipe


# -- errors -----------------------------------------------------------------------------------


def problems_of(path: Path, target: DeepseekV4Args) -> str:
    with pytest.raises(CheckpointError) as e:
        plan_mtp(path, target)
    return str(e.value)


def test_missing_misshapen_and_unexpected_tensors_are_named(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, _, _ = make_mtp(args)
    tensors = mtp_tensors(mtp, OFFICIAL)
    del tensors["mtp.0.attn.wkv.weight"]
    tensors["mtp.0.h_proj.weight"] = torch.zeros(3, 3)
    tensors["mtp.0.ffn.gate.tid2eid"] = torch.zeros(args.vocab_size, 2, dtype=torch.int64)
    write_checkpoint(tmp_path / "bad", tensors, args.to_config())
    msg = problems_of(tmp_path / "bad", args)
    assert "missing tensor mtp.0.attn.wkv.weight" in msg
    assert "'mtp.0.h_proj.weight' in model.safetensors has shape [3, 3], expected [256, 256]" in msg
    assert "unexpected tensor 'mtp.0.ffn.gate.tid2eid'" in msg


def test_config_problems(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, _, _ = make_mtp(args)
    # the MTP layer must be sliding-window only
    bad_ratio = dataclasses.replace(args, compress_ratios=[0, 0, 4, 128, 4, 4])
    write_checkpoint(tmp_path / "ratio", mtp_tensors(mtp), bad_ratio.to_config())
    assert "compress_ratios[5] (the MTP layer) is 4" in problems_of(tmp_path / "ratio", args)
    # the target's geometry differs: hidden states / token ids cannot cross over
    other = dataclasses.replace(args, hidden_size=128, vocab_size=300)
    msg = problems_of(write_official(tmp_path / "ok", mtp), other)
    assert "hidden_size is 256 but the target's is 128" in msg
    assert "vocab_size is 512 but the target's is 300" in msg
    # no MTP tensors at all
    write_checkpoint(tmp_path / "none", {"embed.weight": torch.zeros(2, 2)}, args.to_config())
    assert "has no mtp.0.* tensors; set spec.draft_path=" in problems_of(tmp_path / "none", args)
    # a DSpark (Flash-0731) checkpoint is not an MTP one
    cfg = args.to_config() | {"dspark_block_size": 5}
    write_checkpoint(tmp_path / "dspark", mtp_tensors(mtp), cfg)
    assert "use spec=dspark" in problems_of(tmp_path / "dspark", args)
    # both spellings of one tensor
    tensors = mtp_tensors(mtp) | {
        "mtp.0.embed.weight": torch.zeros(args.vocab_size, args.hidden_size),
        "mtp.0.emb.tok_emb.weight": torch.zeros(args.vocab_size, args.hidden_size),
    }
    write_checkpoint(tmp_path / "dup", tensors, args.to_config())
    assert "both provide the MTP's 'embed.weight'" in problems_of(tmp_path / "dup", args)


def test_exported_config_is_validated(tmp_path: Path) -> None:
    args = DeepseekV4Args.tiny()
    mtp, _, _ = make_mtp(args)
    path = write_exported(tmp_path / "exp", mtp)
    config = json.loads((path / "config.json").read_text())
    config["compress_ratios"] = [128, 0]
    (path / "config.json").write_text(json.dumps(config))
    assert "compress_ratios[0] (the MTP layer) is 128" in problems_of(path, args)
