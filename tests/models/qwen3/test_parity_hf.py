"""Logit parity with transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM.

Both sides load the same random checkpoint directory (HF through from_pretrained, which
also proves the layout is a real Hugging Face one; xspec through load_model). The
reference is always HF's single full forward; xspec must match it whether it scores
the sequence at once, in uneven chunks, token by token, or inside a ragged batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from xspec.config import DType, ModelConfig  # noqa: E402
from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch  # noqa: E402
from xspec.models.loading import write_checkpoint  # noqa: E402
from xspec.models.qwen3 import Qwen3Args, load_model  # noqa: E402
from xspec.models.qwen3.model import Qwen3Model  # noqa: E402

# fp32, logits std ~2. Observed max abs diff: full forward 0 (dense) / ~5e-6 (MoE: expert
# summation order); chunked <= ~9e-6; token-by-token <= ~1.5e-5 (1-row GEMV + unmasked SDPA
# kernels round differently from HF's 96-row GEMM).
TOL = 3e-5
N = 96  # tokens per reference sequence


def _variants() -> dict[str, Qwen3Args]:
    dense, moe = Qwen3Args.tiny(False), Qwen3Args.tiny(True)
    return {
        # tied head, default RoPE (Qwen3-0.6B style)
        "dense": dense,
        # untied, norm_topk_prob, every layer sparse (Qwen3-30B-A3B style)
        "moe": moe,
        # MQA, smaller head_dim than hidden/heads, linear RoPE scaling, untied head
        "dense_mqa_linear": dataclasses.replace(
            dense,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
        # dense layer 2 inside a MoE, no renormalisation, YaRN, tied head
        "moe_mixed_yarn": dataclasses.replace(
            moe,
            mlp_only_layers=[2],
            norm_topk_prob=False,
            tie_word_embeddings=True,
            rope_theta=1e6,
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        ),
    }


@pytest.fixture(scope="module", params=list(_variants()))
def pair(request, tmp_path_factory):
    """(xspec model, HF model) loaded from one freshly written checkpoint directory."""
    args = _variants()[request.param]
    src = Qwen3Model(args).init_random_(seed=1)
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    write_checkpoint(path, dict(src.state_dict()), args.to_config(), max_shard_bytes=1 << 20)
    cls = transformers.Qwen3MoeForCausalLM if args.is_moe else transformers.Qwen3ForCausalLM
    hf = cls.from_pretrained(path, dtype=torch.float32).eval()
    cfg = ModelConfig(arch="qwen3", path=str(path), dtype=DType.float32)
    ours = load_model(cfg, device=torch.device("cpu"), max_rollback=8)
    return ours, hf


def _ids(seed: int, n: int = N) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))  # [n]


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0]  # [n, V]


def _score_chunks(model: Qwen3Model, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    state, out, start = model.new_state(), [], 0
    for n in chunks:
        out.append(model(ForwardBatch(ids[start : start + n], [n], [state])).logits)
        start += n
    assert start == len(ids) and state.num_tokens == len(ids)
    return torch.cat(out)  # [n, V]


def _assert_close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"{what}: max abs diff {diff:.3g} > {TOL}"


def test_full_forward_matches_hf(pair):
    ours, hf = pair
    ids = _ids(0)
    want = _hf_logits(hf, ids)
    assert want.std() > 0.5, "degenerate reference logits"
    _assert_close(_score_chunks(ours, ids, [N]), want, "full forward")


def test_chunked_prefill_matches_hf(pair):
    ours, hf = pair
    ids = _ids(1)
    _assert_close(_score_chunks(ours, ids, [7, 30, 1, 17, 41]), _hf_logits(hf, ids), "chunked")


def test_token_by_token_decode_matches_hf(pair):
    ours, hf = pair
    ids = _ids(2)
    got = _score_chunks(ours, ids, [16] + [1] * (N - 16))  # prefill 16, decode 80
    _assert_close(got, _hf_logits(hf, ids), "token-by-token decode")


def test_ragged_batch_matches_hf_and_single_runs(pair):
    """3 sequences at different positions (10, 0, 33 cached) score 5 / 12 / 1 rows at once."""
    ours, hf = pair
    seqs = [_ids(10 + i, n) for i, n in enumerate((15, 12, 34))]
    cached = [10, 0, 33]
    states = []
    for ids, c in zip(seqs, cached):
        state = ours.new_state()
        if c:
            ours(ForwardBatch(ids[:c], [c], [state]))
        states.append(state)
    new = [ids[c:] for ids, c in zip(seqs, cached)]
    lens = [len(x) for x in new]
    got = ours(ForwardBatch(torch.cat(new), lens, states)).logits.split(lens)
    for i, (ids, c) in enumerate(zip(seqs, cached)):
        _assert_close(got[i], _hf_logits(hf, ids)[c:], f"ragged sequence {i} vs HF")
        alone = _score_chunks(ours, ids, [c, len(ids) - c] if c else [len(ids)])[c:]
        # not bitwise: BLAS picks different kernels for 18 rows than for 1 (gemv vs gemm)
        _assert_close(got[i], alone, f"ragged sequence {i} vs running alone")
        assert states[i].num_tokens == len(ids)


def test_captured_residuals_match_hf_hidden_states(pair):
    """HF hidden_states[i] is the residual entering layer i (last entry: after the norm)."""
    ours, hf = pair
    ids, L, d = _ids(3, 24), ours.num_layers, ours.hidden_size
    capture = [CapturePoint(layer=layer, site=CaptureSite.INPUT) for layer in range(L)]
    out = ours(ForwardBatch(ids, [len(ids)], [ours.new_state()], capture))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states
    aux = out.aux_hidden.view(len(ids), L, d)
    for layer in range(L):
        _assert_close(aux[:, layer], ref[layer][0], f"residual entering layer {layer}")
    _assert_close(ours.model.norm(out.hidden), ref[L][0], "final normed hidden")


def test_checkpoint_dir_is_what_hf_saves(pair, tmp_path: Path):
    """HF's own save_pretrained of the loaded model loads back into xspec identically."""
    ours, hf = pair
    hf.save_pretrained(tmp_path)
    cfg = ModelConfig(arch="qwen3", path=str(tmp_path), dtype=DType.float32)
    again = load_model(cfg, device=torch.device("cpu"), max_rollback=0)
    mine, theirs = ours.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys()
    for k in mine:
        assert torch.equal(mine[k], theirs[k]), k
