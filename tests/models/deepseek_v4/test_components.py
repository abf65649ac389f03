"""Component checks of the xspec DeepSeek-V4 model: mHC, routing, compressor pooling,
RoPE tables, capture, config parsing, state byte accounting, stand-alone Block reuse."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from xspec.errors import CheckpointError, ConfigError, RequestError
from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.compressor import stable_topk
from xspec.models.deepseek_v4.mhc import hc_pre, sinkhorn
from xspec.models.deepseek_v4.model import Block, DeepseekV4Model
from xspec.models.deepseek_v4.moe import MoE
from xspec.models.deepseek_v4.rope import Rope, apply_rope, rope_inv_freq
from xspec.models.deepseek_v4.state import BlockContext, DeepseekV4State, kv_bytes

# -- mHC ---------------------------------------------------------------------------------


def test_sinkhorn_comb_is_doubly_stochastic(dsv4):
    model = DeepseekV4Model(DeepseekV4Args.tiny())  # not the cached one: weights change
    model.init_random_(0)
    block = model.layers[2]
    x = torch.randn(
        64, model.args.hc_mult, model.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    _, _, comb = hc_pre(x, block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale, model.args)
    assert (comb > 0).all()
    col = (comb.sum(dim=-2) - 1).abs().max().item()  # the loop ends on a column step
    row = (comb.sum(dim=-1) - 1).abs().max().item()
    assert col <= 1e-5, f"column sums off by {col:.3g}"
    assert row <= 2e-2, f"row sums off by {row:.3g}"  # 20 rounds: rows nearly converged
    # and it is a projection: more iterations drive the rows to 1 as well
    peaked = torch.softmax(
        torch.randn(256, 4, 4, generator=torch.Generator().manual_seed(1)) * 3, -1
    )
    err = [(sinkhorn(peaked + 1e-6, n, 1e-6).sum(-1) - 1).abs().max().item() for n in (2, 20, 400)]
    assert err[0] > err[1] > err[2] and err[2] <= 1e-3, f"row errors by iterations: {err}"


# -- MoE ---------------------------------------------------------------------------------


def test_hash_routing_takes_experts_from_tid2eid():
    args = DeepseekV4Args.tiny()
    moe = MoE(args, hash_routed=True, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(0)
    for p in moe.parameters():
        p.data = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
    table = torch.rand(args.vocab_size, args.n_routed_experts, generator=gen).argsort(dim=1)[:, :2]
    moe.gate.tid2eid.copy_(table)
    ids = torch.tensor([5, 17, 5, 300])
    x = torch.randn(4, args.hidden_size, generator=gen)
    weights, experts = moe.gate(x, ids)
    assert torch.equal(experts, table[ids])
    scores = F.softplus(x @ moe.gate.weight.t()).sqrt().gather(1, table[ids])
    expect_w = scores / scores.sum(-1, keepdim=True) * args.routed_scaling_factor
    assert dsv4_close(weights, expect_w, 1e-6)
    # the layer output uses exactly those experts, weighted, plus the shared expert
    expect = torch.stack(
        [
            sum(
                moe.experts[int(e)](x[i : i + 1], expect_w[i, j].view(1, 1))[0]
                for j, e in enumerate(table[t])
            )
            + moe.shared_experts(x[i : i + 1])[0]
            for i, t in enumerate(ids)
        ]
    )
    assert dsv4_close(moe(x, ids), expect, 1e-5)


def test_learned_routing_bias_selects_but_does_not_weight():
    args = DeepseekV4Args.tiny()
    moe = MoE(args, hash_routed=False, dtype=torch.float32, device="cpu")
    x = torch.randn(3, args.hidden_size, generator=torch.Generator().manual_seed(2))
    moe.gate.weight.data.normal_(generator=torch.Generator().manual_seed(3))
    moe.gate.bias.data.zero_()
    moe.gate.bias.data[[6, 7]] = 100.0  # forces experts 6 and 7
    weights, experts = moe.gate(x, torch.zeros(3, dtype=torch.long))
    assert sorted(experts[0].tolist()) == [6, 7]
    scores = F.softplus(x @ moe.gate.weight.t()).sqrt().gather(1, experts)
    assert dsv4_close(weights, scores / scores.sum(-1, keepdim=True) * 1.5, 1e-6)


def test_swiglu_clamp():
    args = dataclasses.replace(DeepseekV4Args.tiny(), swiglu_limit=0.5)
    expert = MoE(args, hash_routed=False, dtype=torch.float32, device="cpu").shared_experts
    gen = torch.Generator().manual_seed(4)
    for p in expert.parameters():
        p.data = torch.randn(p.shape, generator=gen)
    x = torch.randn(5, args.hidden_size, generator=gen)
    gate = (x @ expert.w1.weight.t()).clamp(max=0.5)
    up = (x @ expert.w3.weight.t()).clamp(-0.5, 0.5)
    expect = (F.silu(gate) * up) @ expert.w2.weight.t()
    assert dsv4_close(expert(x), expect, 1e-4)


# -- compressor / indexer ------------------------------------------------------------------


@pytest.mark.parametrize("layer", [2, 3])  # CSA (overlapping), HCA
def test_compressor_entries_equal_the_formula(dsv4, layer):
    """Entries emitted chunk by chunk equal a direct per-entry evaluation of the pooling
    formula (incl. the empty previous window of CSA entry 0) + norm + rope at w*m."""
    model = DeepseekV4Model(DeepseekV4Args.tiny())  # not the cached one: weights change
    model.init_random_(0)
    comp = model.layers[layer].attn.compressor
    m, width, coff = comp.ratio, comp.width, comp.coff
    n = 300
    x = torch.randn(n, model.hidden_size, generator=torch.Generator().manual_seed(layer))
    pos = torch.arange(n)
    kv, score = comp.project(x, pos)
    cache = model.layers[layer].new_cache(max_rollback=8, max_context=4096).compressor
    start = 0
    for c in (37, 100, 1, 162):
        comp.update(cache, kv[start : start + c], score[start : start + c], start)
        start += c
    assert cache.n_entries == n // m
    expect = []
    for w in range(n // m):
        rows_kv = [kv[w * m : (w + 1) * m, -width:]]
        rows_sc = [score[w * m : (w + 1) * m, -width:]]
        if coff == 2:  # Ca half of the previous window (none before window 0)
            prev = slice((w - 1) * m, w * m)
            rows_kv.insert(0, kv[prev, :width] if w else torch.zeros(m, width))
            rows_sc.insert(0, score[prev, :width] if w else torch.full((m, width), -math.inf))
        k, s = torch.cat(rows_kv), torch.cat(rows_sc)
        pooled = (k * torch.softmax(s, dim=0)).sum(0, keepdim=True)
        cos, sin = comp.rope.cos_sin(torch.tensor([w * m]))
        expect.append(apply_rope(comp.norm(pooled), cos, sin))
    diff = dsv4.max_diff(cache.valid_entries(), torch.cat(expect))
    assert diff <= 1e-5, f"compressed entries differ from the formula by {diff:.3g}"


def test_stable_topk_breaks_ties_towards_lower_index():
    scores = torch.tensor([[0.0, 3.0, 0.0, 0.0, 2.0, 0.0], [1.0, 5.0, 4.0, 3.0, 2.0, 0.0]])
    assert stable_topk(scores, 3).tolist() == [[0, 1, 4], [1, 2, 3]]
    inf = torch.full((1, 5), -math.inf)
    assert stable_topk(inf, 2).tolist() == [[0, 1]]


def test_stable_topk_ranks_nan_last():
    nan = math.nan
    scores = torch.tensor([[nan, 3.0, nan, 1.0, 2.0], [nan, nan, nan, nan, nan]])
    assert stable_topk(scores, 2).tolist() == [[1, 4], [0, 1]]


def test_indexer_survives_nan_scores(dsv4):
    """A NaN in the indexer's scores (a numerical fault) never reaches top-k as a pick: the
    forward completes, and the NaN query row selects nothing it should not."""
    model = DeepseekV4Model(DeepseekV4Args.tiny())  # not the cached one: weights change
    model.init_random_(0)
    layer = next(i for i, r in enumerate(model.args.target_compress_ratios) if r == 4)
    indexer = model.layers[layer].attn.indexer
    with torch.no_grad():
        indexer.weights_proj.weight[0, 0] = math.nan  # every query's head-0 weight is NaN
    ids = dsv4.ids(64, model.args.vocab_size, 1)
    dsv4.run(model, ids, model.new_state())  # raised a shape error in stable_topk before


# -- RoPE ----------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["tiny", "variant"])
def test_rope_tables_equal_transformers(dsv4, config):
    transformers = pytest.importorskip("transformers")
    args = dsv4.configs[config]()
    hf_config = transformers.DeepseekV4Config(**args.to_config())
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    hf = DeepseekV4RotaryEmbedding(hf_config)
    assert torch.equal(rope_inv_freq(args, compressed=False), hf.main_inv_freq)
    assert torch.equal(rope_inv_freq(args, compressed=True), hf.compress_inv_freq)
    assert not torch.equal(hf.main_inv_freq, hf.compress_inv_freq)


def test_inverse_rope_undoes_rope_and_keeps_the_nope_part():
    args = DeepseekV4Args.tiny()
    rope = Rope(rope_inv_freq(args, compressed=True))
    x = torch.randn(7, 3, args.head_dim, generator=torch.Generator().manual_seed(5))
    cos, sin = rope.cos_sin(torch.arange(100, 107))
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., : -args.qk_rope_head_dim], x[..., : -args.qk_rope_head_dim])
    assert not torch.allclose(y, x)
    assert dsv4_close(apply_rope(y, cos, sin, inverse=True), x, 1e-5)


# -- capture -------------------------------------------------------------------------------


def test_capture_returns_residual_stream_means(dsv4):
    model = DeepseekV4Model(DeepseekV4Args.tiny())  # not the cached one: weights change
    model.init_random_(0)
    ids = dsv4.ids(20, model.vocab_size, 6)
    L = model.num_layers
    points = [CapturePoint(0, CaptureSite.INPUT)]
    for layer in range(L):
        points += [
            CapturePoint(layer, CaptureSite.OUTPUT),
            CapturePoint(layer + 1, CaptureSite.INPUT),
        ]
    out = dsv4.run(model, ids, model.new_state(), capture=points)
    d = model.hidden_size
    assert out.aux_hidden.shape == (20, len(points) * d)
    parts = out.aux_hidden.split(d, dim=-1)
    assert torch.equal(parts[0], model.embed.weight[ids])  # identical streams before layer 0
    for layer in range(L):  # OUTPUT of l is the INPUT of l+1
        assert torch.equal(parts[1 + 2 * layer], parts[2 + 2 * layer])
    assert torch.equal(parts[-1], out.hidden.mean(dim=1))  # INPUT of L: the final residual
    assert dsv4.run(model, ids, model.new_state()).aux_hidden is None
    with pytest.raises(ConfigError, match="capture points"):
        dsv4.run(model, ids, model.new_state(), capture=[CapturePoint(L, CaptureSite.OUTPUT)])


# -- config --------------------------------------------------------------------------------


def test_config_round_trip_and_draft_ratios():
    args = DeepseekV4Args.tiny()
    again = DeepseekV4Args.from_config(args.to_config(), "config.json")
    assert again == args
    assert args.target_compress_ratios == [0, 0, 4, 128, 4]
    assert args.draft_compress_ratios == [0]
    flash = dict(args.to_config(), num_hidden_layers=3, compress_ratios=[0, 4, 128, 0, 0, 0])
    flash.update(
        dspark_block_size=5, dspark_target_layer_ids=[0, 1, 2], quantization_config={"fmt": "e4m3"}
    )
    parsed = DeepseekV4Args.from_config(flash, "config.json")
    assert parsed.draft_compress_ratios == [0, 0, 0] and parsed.dspark_block_size == 5
    assert parsed.to_config()["quantization_config"] == {"fmt": "e4m3"}  # unread keys survive


def test_config_errors_list_every_problem_with_the_file():
    cfg = DeepseekV4Args.tiny().to_config()
    del cfg["hidden_size"]
    cfg.update(compress_ratios=[0, 8, 4], scoring_func="relu", head_dim=16, num_key_value_heads=4)
    with pytest.raises(CheckpointError) as err:
        DeepseekV4Args.from_config(cfg, "/ckpt/config.json")
    text = str(err.value)
    assert "/ckpt/config.json" in text
    for needle in ("'hidden_size'", "compress_ratios", "scoring_func", "num_key_value_heads"):
        assert needle in text, f"{needle} missing from: {text}"
    cfg = dict(DeepseekV4Args.tiny().to_config(), compress_ratios=[0, 4], head_dim=16, o_groups=3)
    with pytest.raises(CheckpointError) as err:
        DeepseekV4Args.from_config(cfg, "c.json")
    assert len(err.value.problems) == 3, err.value.problems  # ratios too short, head_dim, o_groups


# -- state ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", ["tiny", "variant"])
def test_state_bytes_equal_the_formula(dsv4, config, dtype):
    args = dsv4.configs[config]()
    model = DeepseekV4Model(args, dtype=dtype, max_rollback=5)
    state = model.new_state()
    fixed, per_token = kv_bytes(args, dtype, max_rollback=5)
    assert state.nbytes_fixed() == fixed
    assert state.nbytes_per_token() == per_token
    state.reserve(1000)  # growth capacity stays within 2x of what 1000 tokens need
    grown = state.nbytes_allocated() - fixed
    assert per_token * 1000 - 64 <= grown <= 2 * per_token * 1000 + 16 * 64 * 8


def test_tiny_state_numbers():
    """The section-10 table, fp32 rows, max_rollback 8: SWA 5 x 136 x 64 x 4 B; CSA
    main/indexer rows 2 x 16 x 128 x 4 B / 2 x 16 x 64 x 4 B; HCA rows 2 x 136 x 64 x 4 B."""
    fixed, per_token = kv_bytes(DeepseekV4Args.tiny(), torch.float32, max_rollback=8)
    swa = 5 * 136 * 64 * 4
    csa = 2 * (2 * 16 * 128 * 4 + 2 * 16 * 64 * 4)
    hca = 2 * 136 * 64 * 4
    assert fixed == swa + csa + hca
    assert per_token == 2 * (64 * 4 / 4 + 32 * 4 / 4) + 64 * 4 / 128


# -- model API -----------------------------------------------------------------------------


def test_checkpoint_names_and_dtypes():
    model = DeepseekV4Model(DeepseekV4Args.tiny(), dtype=torch.bfloat16)
    sd = model.state_dict()
    for name in (
        "embed.weight",
        "head.weight",
        "norm.weight",
        "hc_head_fn",
        "layers.0.ffn.gate.tid2eid",
        "layers.2.attn.indexer.wq_b.weight",
        "layers.2.attn.indexer.weights_proj.weight",
        "layers.2.attn.indexer.compressor.ape",
        "layers.3.attn.compressor.norm.weight",
        "layers.3.ffn.gate.bias",
        "layers.4.ffn.experts.7.w2.weight",
        "layers.4.ffn.shared_experts.w3.weight",
    ):
        assert name in sd, name
    assert not [k for k in sd if "rope" in k or "inv_freq" in k]
    for name, t in sd.items():
        fp32 = any(s in name for s in ("attn_sink", "hc_", "ffn.gate.", "ape", "norm"))
        if name.endswith("tid2eid"):
            assert t.dtype == torch.int64
        else:
            assert t.dtype == (torch.float32 if fp32 else torch.bfloat16), name


def test_init_random_is_deterministic_and_tid2eid_valid(dsv4):
    a = DeepseekV4Model(DeepseekV4Args.tiny())
    a.init_random_(3)
    b = DeepseekV4Model(DeepseekV4Args.tiny())
    b.init_random_(3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.embed.weight, dsv4.model("tiny", 0).embed.weight)
    table = a.layers[1].ffn.gate.tid2eid
    assert table.min() >= 0 and table.max() < a.args.n_routed_experts
    assert (table[:, 0] != table[:, 1]).all()


def test_bad_requests_are_rejected(dsv4):
    model = DeepseekV4Model(DeepseekV4Args.tiny(), max_context=16)
    with pytest.raises(RequestError, match="outside"):
        model(ForwardBatch(torch.tensor([1, 512]), [2], [model.new_state()]))
    with pytest.raises(RequestError, match="max_context=16"):
        model(ForwardBatch(torch.zeros(17, dtype=torch.long), [17], [model.new_state()]))
    other = DeepseekV4State([], 8)
    with pytest.raises(ValueError, match="new_state"):
        model(ForwardBatch(torch.zeros(1, dtype=torch.long), [1], [other]))


def test_standalone_block_chunks_and_rolls_back(dsv4):
    """The MTP / DSpark reuse path: one SWA-only Block with its own caches."""
    args = DeepseekV4Args.tiny()
    block = Block(args, layer_id=5, compress_ratio=0, hash_routed=False)
    gen = torch.Generator().manual_seed(9)
    for p in block.parameters():  # 1-D tensors (norms, mHC scales) around 1
        p.data = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]) + (p.dim() == 1)
    n = 150
    x = torch.randn(n, args.hc_mult, args.hidden_size, generator=gen)
    ids = torch.randint(0, args.vocab_size, (n,), generator=gen)

    def run(cache, rows: slice, start: int):
        ctx = BlockContext(ids[rows], torch.arange(start, rows.stop), [rows.stop - start], [start])
        return block(x[rows], ctx.for_block([cache]))

    full = run(block.new_cache(max_rollback=4, max_context=512), slice(0, n), 0)
    cache = block.new_cache(max_rollback=4, max_context=512)
    first = run(cache, slice(0, 140), 0)
    run(cache, slice(140, 144), 140)  # scored, then rejected
    cache.truncate(141)
    rest = run(cache, slice(141, n), 141)
    diff = max(dsv4.max_diff(first, full[:140]), dsv4.max_diff(rest, full[141:]))
    assert diff <= 2e-5, f"stand-alone block chunk/rollback max abs diff {diff:.3g}"


def dsv4_close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"
    return True


def test_bfloat16_model_runs_and_tracks_fp32(dsv4):
    """Coarse sanity of the bf16 path (real checkpoints are bf16): fp32 logits out, bf16
    residual, fp32-kept tensors untouched, and mostly the same greedy tokens as fp32."""
    ref = dsv4.model("tiny", 0)
    model = DeepseekV4Model(ref.args, dtype=torch.bfloat16)
    model.load_state_dict(ref.state_dict())
    ids = dsv4.ids(200, ref.vocab_size, 11)
    out = dsv4.run(model, ids, model.new_state())
    assert out.logits.dtype == torch.float32 and out.hidden.dtype == torch.bfloat16
    assert torch.isfinite(out.logits).all()
    same = (out.logits.argmax(-1) == dsv4.run(ref, ids, ref.new_state()).logits.argmax(-1)).float()
    assert same.mean() >= 0.8, f"bf16 greedy agreement {same.mean():.2f}"


# -- MoE: the three ways to run the routed experts -------------------------------------------


def _moe_out(moe, x, ids, *, grouped: bool, grad: bool):
    moe.can_group, moe.grouped = True, grouped
    try:
        with torch.set_grad_enabled(grad):
            return moe(x, ids).detach()
    finally:
        moe.can_group = moe.grouped = False


@pytest.mark.parametrize("rows", [1, 6, 40, 300])
def test_moe_grouped_host_and_per_expert_paths_agree(dsv4, rows):
    """Grouped GEMMs without a host sync, the eager host path (grouped GEMMs from three
    experts with rows, else one GEMM per expert) and the per-expert reference (autograd
    takes it) compute the same routed sum."""
    model = dsv4.model("tiny", 0)
    moe = model.layers[-1].ffn  # learned routing
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, model.args.hidden_size, generator=gen)
    ids = dsv4.ids(rows, model.vocab_size, rows)
    reference = _moe_out(moe, x, ids, grouped=False, grad=True)
    eager = _moe_out(moe, x, ids, grouped=False, grad=False)
    grouped = _moe_out(moe, x, ids, grouped=True, grad=False)
    torch.testing.assert_close(eager, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped, reference, rtol=1e-5, atol=1e-5)


def test_expert_weights_are_views_of_the_stacks(dsv4):
    moe = dsv4.model("tiny", 0).layers[0].ffn
    for e, expert in enumerate(moe.experts):
        assert expert.w1.weight.data_ptr() == moe.w1[e].data_ptr()
        assert expert.w2.weight.data_ptr() == moe.w2[e].data_ptr()
    # state_dict keeps the checkpoint names only (the stacks are not persistent)
    assert not any(k.endswith((".w1", ".w2", ".w3")) for k in moe.state_dict())


def test_replaced_expert_weights_restack(dsv4):
    model = dsv4.model("variant", 1)
    moe = copy.deepcopy(model.layers[0].ffn)
    new = torch.randn_like(moe.experts[0].w1.weight)
    moe.load_state_dict({**moe.state_dict(), "experts.0.w1.weight": new}, assign=True)
    with torch.no_grad():
        stacks = moe._stacked()
    assert stacks is not None and torch.equal(stacks[0][0], new)


def test_grouped_gemms_only_where_the_platform_kernel_serves():
    from xspec.models.deepseek_v4.moe import MoE
    from xspec.models.ops import ModelOps, StepOptions

    def moe(**ops) -> MoE:  # fp32 weights
        steps = StepOptions(ops=ModelOps(**ops))
        return MoE(DeepseekV4Args.tiny(), False, dtype=torch.float32, device="cpu", steps=steps)

    assert not moe().can_group  # no platform ops: the reference
    assert not moe(grouped_mm_dtypes=frozenset({"bfloat16"})).can_group
    host = moe(grouped_mm_dtypes=frozenset({"float32"}))
    assert host.can_group and not host.grouped  # the host: grouped from 3 experts with rows
    assert moe(grouped_mm_dtypes=frozenset({"float32"}), grouped_mm_eager=True).grouped
    # no host sync at all
