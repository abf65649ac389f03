"""The CPU platform's native fused kernels against the reference torch ops they replace."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from xspec.models.deepseek_v4 import mhc
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.rope import rotate
from xspec.models.ops import REFERENCE_OPS, ModelOps, StepOptions
from xspec.platforms import native


@pytest.fixture(scope="module", params=["native", "baseline"])
def kernels(request) -> native.NativeKernels:
    """The kernels built for this CPU (``-march=native``: AVX vectors here) and for the
    compiler's baseline target (SSE / NEON vectors): the vector code differs."""
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "baseline":
            mp.setattr(native, "_TARGETS", ((),))
        loaded, why = native.load()
    if loaded is None:
        pytest.skip(why)
    return loaded


def test_rms_norm_matches_torch(kernels):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 300, generator=gen) * 3
    w = torch.randn(300, generator=gen)
    weighted = kernels.rms_norm(x, w, 1e-6)
    plain = kernels.rms_norm(x, None, 1e-6)
    assert weighted is not None and plain is not None
    torch.testing.assert_close(weighted, F.rms_norm(x, (300,), w, 1e-6), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(plain, F.rms_norm(x, (300,), eps=1e-6), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inverse", [False, True])
@pytest.mark.parametrize("shape", [(5, 8, 64), (5, 64), (3, 2, 48)])
def test_rope_is_bitwise_the_reference(kernels, shape, inverse):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen)
    rd = 16 if shape[-1] == 64 else 8
    cos, sin = torch.randn(shape[0], rd, generator=gen), torch.randn(shape[0], rd, generator=gen)
    y = kernels.rope(x, cos, sin, inverse)
    assert y is not None
    assert torch.equal(y, rotate(x, cos, sin, inverse=inverse))


@pytest.mark.parametrize(("hc", "iters"), [(4, 20), (2, 10)])
def test_mhc_pre_matches_the_reference_path(kernels, hc, iters):
    args = dataclasses.replace(DeepseekV4Args.tiny(), hc_mult=hc, hc_sinkhorn_iters=iters)
    hc, d = args.hc_mult, args.hidden_size
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, hc, d, generator=gen)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=gen) / (hc * d) ** 0.5
    base, scale = torch.randn((2 + hc) * hc, generator=gen), torch.rand(3, generator=gen) + 0.5
    with torch.no_grad():
        ref = mhc.hc_pre(x, fn, base, scale, args)
        fused = mhc.hc_pre(x, fn, base, scale, args, kernels.ops())
    for name, a, b in zip(("u", "post", "comb"), fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=name)
    comb = fused[2]  # doubly stochastic: columns sum to 1 after the last normalisation
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(6, hc), rtol=0, atol=1e-5)


def test_inputs_a_kernel_does_not_take_fall_back(kernels):
    x = torch.randn(4, 64)
    assert kernels.rms_norm(x.bfloat16(), None, 1e-6) is None
    assert kernels.rms_norm(x.t(), None, 1e-6) is None  # not contiguous
    cos = sin = torch.randn(4, 8)
    assert kernels.rope(x.double(), cos, sin, False) is None
    mix, scale, base = torch.randn(3, 24), torch.ones(3), torch.zeros(24)
    assert kernels.mhc_pre(mix.bfloat16(), scale, base, 4, 20, 1e-6, None) is None
    assert kernels.mhc_pre(mix, scale, base, 4, 20, 1e-6, None)[0] is None  # no streams
    # the reference runs instead, and gives the reference's answer
    assert torch.equal(
        rotate(x.bfloat16(), cos, sin, kernel=kernels.rope), rotate(x.bfloat16(), cos, sin)
    )


def test_no_compiler_means_reference_ops_and_says_why(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    loaded, why = native.load()
    assert loaded is None
    assert "no C compiler" in why and "reference" in why


def test_a_failing_build_says_why(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'fake-cc: cannot compile' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    loaded, why = native.load()
    assert loaded is None
    assert "fake-cc: cannot compile" in why
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written


def test_the_build_is_cached():
    first, _ = native.load()
    again, _ = native.load()
    assert first is not None and again is not None and again.path == first.path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_topk_is_the_reference_selection(kernels, seed):
    """Ragged sequences (decode, verify and a prefill chunk), exact ties (repeated keys:
    the lower index wins), a NaN key (never picked), fewer causal entries than k."""
    from xspec.models.deepseek_v4.compressor import Indexer
    from xspec.models.deepseek_v4.layout import BatchLayout
    from xspec.models.deepseek_v4.rope import Rope, rope_inv_freq

    args = DeepseekV4Args.tiny()
    rope = Rope(rope_inv_freq(args, compressed=True))
    indexer = Indexer(args, rope, dtype=torch.float32, device="cpu")
    fused_indexer = Indexer(args, rope, dtype=torch.float32, device="cpu", ops=kernels.ops())
    gen = torch.Generator().manual_seed(seed)
    starts, lens = [40, 97, 3], [1, 6, 30]
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    layout = BatchLayout(positions, lens, starts)
    counts = layout.entry_counts(4)
    keys = torch.randn(sum(counts), args.index_head_dim, generator=gen)
    keys[5] = keys[2]  # exact ties within the first sequence
    keys[counts[0] + 3] = float("nan")
    q = torch.randn(positions.numel(), args.index_n_heads, args.index_head_dim, generator=gen)
    w = torch.randn(positions.numel(), args.index_n_heads, generator=gen)
    with torch.no_grad():
        reference = indexer.select(q, w, keys, layout)
        fused = fused_indexer.select(q, w, keys, layout)
    assert torch.equal(fused, reference)
    assert (fused == -1).any()  # the 3-token sequence has no complete entry yet


def _attention_case(gen, rows, heads, d):
    """Queries over a window source and a compressed source, with unused (-1) slots:
    one query has no compressed entry at all, one window slot is unused everywhere."""
    q = torch.randn(rows, heads, d, generator=gen)
    window, entries = torch.randn(50, d, generator=gen), torch.randn(12, d, generator=gen)
    w_index = torch.randint(0, 50, (rows, 20), generator=gen)
    w_index[:, 0] = -1
    c_index = torch.randint(-1, 12, (rows, 7), generator=gen)
    c_index[0] = -1
    sink = torch.randn(heads, generator=gen)
    return q, [(window, w_index), (entries, c_index)], sink


@pytest.mark.parametrize(("rows", "heads", "d"), [(1, 8, 64), (6, 8, 64), (7, 6, 40), (5, 16, 24)])
def test_sparse_attention_matches_the_reference(kernels, rows, heads, d):
    """Shapes that take the vector blocks and the remainders (heads not a multiple of
    the vector width, dims not a multiple of the row block, query and row tails)."""
    from xspec.models.deepseek_v4.attention import sparse_attention

    gen = torch.Generator().manual_seed(rows * heads)
    q, parts, sink = _attention_case(gen, rows, heads, d)
    for used in (parts[:1], parts):
        fused = kernels.sparse_attention(q, used, sink, d**-0.5)
        assert fused is not None
        torch.testing.assert_close(fused, sparse_attention(q, used, sink, d**-0.5))


def test_a_query_s_attention_does_not_depend_on_its_batch(kernels):
    """Each query's result is computed alone: the same bits for a query in a batch of
    one, of six, or of twenty (a verify row's attention equals its decode row's)."""
    gen = torch.Generator().manual_seed(3)
    q, parts, sink = _attention_case(gen, 20, 8, 64)
    whole = kernels.sparse_attention(q, parts, sink, 0.125)
    for lo, hi in [(0, 1), (4, 10), (19, 20)]:
        sub = [(kv, index[lo:hi].contiguous()) for kv, index in parts]
        assert torch.equal(kernels.sparse_attention(q[lo:hi], sub, sink, 0.125), whole[lo:hi])


def _moe(ops=REFERENCE_OPS, **changes):
    """A seeded MoE layer (the same weights whatever ``ops`` it is built with)."""
    from xspec.models.deepseek_v4.moe import MoE

    args = dataclasses.replace(DeepseekV4Args.tiny(), **changes)
    gen = torch.Generator().manual_seed(4)
    steps = StepOptions(ops=ops)
    moe = MoE(args, hash_routed=False, dtype=torch.float32, device="cpu", steps=steps)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return moe, args


def _moe_args(moe):
    """The native ``moe`` op's arguments after ``x, input_ids`` for the layer ``moe``."""
    return moe.gate.routing(), moe._stacked(), moe.shared_in_stack, moe.limit


@pytest.mark.parametrize(
    "changes",
    [
        {},  # sqrtsoftplus, normalised top-k, one shared expert (as Flash)
        {"scoring_func": "softmax", "norm_topk_prob": False, "n_shared_experts": 0},
        {"scoring_func": "sigmoid", "num_experts_per_tok": 3, "swiglu_limit": 0.0},
    ],
)
@pytest.mark.parametrize("rows", [1, 6, 13])
def test_moe_matches_the_reference(kernels, changes, rows):
    moe, args = _moe(**changes)
    fused_moe, _ = _moe(ModelOps(moe=kernels.moe), **changes)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, args.hidden_size, generator=gen)
    ids = torch.randint(0, args.vocab_size, (rows,), generator=gen)
    with torch.no_grad():
        reference = moe(x, ids)
        fused = fused_moe(x, ids)
        direct = kernels.moe(x, ids, *_moe_args(moe))
        alone = fused_moe(x[-1:], ids[-1:])
    assert direct is not None and torch.equal(direct, fused)  # the kernel ran
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(alone, fused[-1:])  # one row alone gets the same bits as in the batch


def test_moe_hash_routing_matches_the_reference(kernels):
    from xspec.models.deepseek_v4.moe import MoE

    args = DeepseekV4Args.tiny()
    moe = MoE(args, hash_routed=True, dtype=torch.float32, device="cpu")
    steps = StepOptions(ops=ModelOps(moe=kernels.moe))
    fused_moe = MoE(args, hash_routed=True, dtype=torch.float32, device="cpu", steps=steps)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        table = torch.randint(0, args.n_routed_experts, moe.gate.tid2eid.shape, generator=gen)
        moe.gate.tid2eid.copy_(table)
        fused_moe.load_state_dict(moe.state_dict())
        x = torch.randn(9, args.hidden_size, generator=gen)
        ids = torch.randint(0, args.vocab_size, (9,), generator=gen)
        reference = moe(x, ids)
        fused = fused_moe(x, ids)
        direct = kernels.moe(x, ids, *_moe_args(moe))
    assert direct is not None and torch.equal(direct, fused)  # the kernel ran
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_prefill_sized_moe_calls_go_to_the_grouped_gemms(kernels):
    """Past MOE_MAX_MACS the kernel says no: BLAS is faster there."""
    moe, args = _moe()
    k, inter = args.num_experts_per_tok + 1, args.moe_intermediate_size
    per_row = k * 3 * inter * args.hidden_size
    fits = native.MOE_MAX_MACS // per_row
    with torch.no_grad():
        run = _moe_args(moe)
        for rows, taken in ((fits, True), (fits + 1, False)):
            x = torch.randn(rows, args.hidden_size)
            out = kernels.moe(x, torch.zeros(rows, dtype=torch.long), *run)
            assert (out is not None) == taken


def test_moe_layers_the_kernel_does_not_take_run_the_reference(kernels):
    """Two shared experts do not fit the stack (the kernel says no); bf16 neither."""
    moe, args = _moe(n_shared_experts=2)
    fused_moe, _ = _moe(ModelOps(moe=kernels.moe), n_shared_experts=2)
    x = torch.randn(3, args.hidden_size)
    ids = torch.arange(3)
    with torch.no_grad():
        reference = moe(x, ids)
        routing, stacks = moe.gate.routing(), moe._stacked()
        assert kernels.moe(x, ids, routing, stacks, True, moe.limit) is None
        assert kernels.moe(x.bfloat16(), ids, routing, stacks, False, 1.0) is None
        assert torch.equal(fused_moe(x, ids), reference)


@pytest.mark.parametrize(("ratio", "width"), [(4, 32), (8, 24)])
def test_compress_pool_matches_the_reference(kernels, ratio, width):
    """CSA (ratio 4: two overlapping series) and HCA-like (one series) pooling of rows
    from the rings, the new rows and the pad row (positions before the start)."""
    from xspec.models.deepseek_v4.compressor import Compressor
    from xspec.models.deepseek_v4.rope import Rope, rope_inv_freq

    args = DeepseekV4Args.tiny()
    rope = Rope(rope_inv_freq(args, compressed=True))
    comp = Compressor(args, ratio, width, rope, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(ratio)
    cols = 2 * comp.coff * width
    ring, rows = torch.randn(10, cols, generator=gen), torch.randn(7, cols, generator=gen)
    index = torch.randint(0, 18, (5, comp.coff * ratio), generator=gen)  # 17 = the pad row
    index[0, : ratio // 2] = 17
    fused = kernels.compress_pool(ring, rows, index, ratio, comp.coff, width)
    pad = torch.full((1, cols), float("-inf"))
    pad[:, : comp.coff * width] = 0
    gathered = torch.cat([ring, rows, pad]).index_select(0, index.flatten())
    with torch.no_grad():
        reference = comp.pool(gathered.view(*index.shape, cols))
    assert fused is not None
    torch.testing.assert_close(fused, reference, rtol=1e-6, atol=1e-6)
    assert kernels.compress_pool(ring, rows, index.int(), ratio, comp.coff, width) is None


def test_the_build_targets_this_cpu_and_falls_back_to_the_baseline(monkeypatch, tmp_path):
    """``-march=native`` builds are keyed by the CPU (a shared cache never hands one CPU
    another's build); a compiler that refuses the flag gets the baseline build."""
    fake = tmp_path / "cc"
    real = native.compiler()
    assert real is not None
    fake.write_text(
        f'#!/bin/sh\nfor a in "$@"; do [ "$a" = -march=native ] && exit 1; done\nexec {real} "$@"\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    baseline, why = native.load()
    assert baseline is not None and "baseline target" in why
    monkeypatch.setenv("CC", real)
    first, why = native.load()
    assert first is not None
    if "-march=native" not in why:
        pytest.skip(f"{real} has no -march=native: {why}")
    monkeypatch.setattr(native, "cpu_identity", lambda: "another cpu")
    other, _ = native.load()
    assert other is not None and other.path != first.path != baseline.path


def test_indices_out_of_range_are_refused_not_read(kernels):
    """A kernel never reads outside its buffers: an index out of range returns None, so
    the reference op raises its own error instead."""
    gen = torch.Generator().manual_seed(6)
    q, parts, sink = _attention_case(gen, 3, 8, 64)
    (window, w_index), (entries, c_index) = parts
    c_index = c_index.clone()
    c_index[2, 1] = entries.shape[0]
    assert kernels.sparse_attention(q, [(window, w_index), (entries, c_index)], sink, 0.1) is None

    from xspec.models.deepseek_v4.moe import MoE

    args = DeepseekV4Args.tiny()
    moe = MoE(args, hash_routed=True, dtype=torch.float32, device="cpu")
    x = torch.randn(2, args.hidden_size)
    with torch.no_grad():
        run = _moe_args(moe)
        assert kernels.moe(x, torch.tensor([0, args.vocab_size]), *run) is None
        moe.gate.tid2eid[3, 0] = args.n_routed_experts
        assert kernels.moe(x, torch.tensor([3, 1]), *run) is None
        assert kernels.moe(x, torch.tensor([2, 1]), *run) is not None

    ring, rows = torch.randn(4, 16), torch.randn(2, 16)
    index = torch.tensor([[0, 5, 6, -1]])
    assert kernels.compress_pool(ring, rows, index, 4, 1, 8) is None
    assert kernels.compress_pool(ring, rows, index.clamp(min=0), 4, 1, 8) is not None


def _topk_case() -> tuple[torch.Tensor, ...]:
    """Three query rows over 10 keys: rows 0 and 1 read keys 0..3 and 0..5, row 2 keys
    4..9 (key0 + visible <= 10)."""
    gen = torch.Generator().manual_seed(7)
    q, w = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, generator=gen)
    keys = torch.randn(10, 16, generator=gen)
    return q, w, keys, torch.tensor([0, 0, 4]), torch.tensor([3, 5, 6])


def test_index_topk_refuses_keys_outside_the_buffer(kernels):
    """``key0 + visible`` past the keys, or either negative, is refused (not read); so
    are shapes that do not fit together."""
    q, w, keys, key0, visible = _topk_case()
    assert kernels.index_topk(q, w, keys, key0, visible, 6, 2, 0.25) is not None
    for k0, vis in (([0, 0, 5], [3, 5, 6]), ([0, -1, 4], [3, 5, 6]), ([0, 0, 4], [3, -1, 6])):
        out = kernels.index_topk(q, w, keys, torch.tensor(k0), torch.tensor(vis), 6, 2, 0.25)
        assert out is None, (k0, vis)
    for args in (
        (q, w[:, :1].contiguous(), keys, key0, visible),  # weights not [T, H]
        (q, w, keys[:, :8].contiguous(), key0, visible),  # keys narrower than q
        (q, w, keys, key0[:2], visible),  # a key0 per row
        (q, w, keys, key0, visible[:2]),
        (q.flatten(1), w, keys, key0, visible),
    ):
        assert kernels.index_topk(*args, 6, 2, 0.25) is None


def test_shapes_that_do_not_fit_are_refused_not_read(kernels):
    """Every shape relation a kernel relies on, broken once: None (the reference op
    then raises its own error), not a read past a buffer."""
    x = torch.randn(5, 2, 64)
    cos, sin = torch.randn(5, 16), torch.randn(5, 16)
    assert kernels.rope(x, cos, sin, False) is not None
    for c, s in (
        (cos[:, :15].contiguous(), sin[:, :15].contiguous()),  # rd odd
        (cos[:3], sin[:3]),  # fewer rows than x
        (cos, sin[:, :8].contiguous()),  # cos and sin differ
        (cos.flatten(), sin.flatten()),
    ):
        assert kernels.rope(x, c, s, False) is None
    wide = torch.randn(5, 80)  # rd 80 > d 64
    assert kernels.rope(x, wide, wide, False) is None

    assert kernels.rms_norm(x, torch.ones(63), 1e-6) is None  # weight length != d
    assert kernels.rms_norm(x, torch.ones(1, 64), 1e-6) is None

    mix, scale, base, streams = torch.randn(3, 24), torch.ones(3), torch.zeros(24), None
    assert kernels.mhc_pre(mix, scale, base, 4, 20, 1e-6, streams) is not None
    for m, sc, b, hc, xs in (
        (mix[:, :20].contiguous(), scale, base[:20], 4, None),  # width != (2+hc)*hc
        (mix, scale[:2], base, 4, None),
        (mix, scale, base[:23], 4, None),
        (mix, scale, base, 4, torch.randn(3, 3, 16)),  # hc streams
        (mix, scale, base, 4, torch.randn(2, 4, 16)),  # a stream row per mix row
    ):
        assert kernels.mhc_pre(m, sc, b, hc, 20, 1e-6, xs) is None

    gen = torch.Generator().manual_seed(8)
    q, parts, sink = _attention_case(gen, 3, 8, 32)
    assert kernels.sparse_attention(q, parts, sink[:7], 0.1) is None  # a sink per head
    assert kernels.sparse_attention(q, parts, sink[:, None], 0.1) is None

    ring, rows, index = torch.randn(4, 16), torch.randn(2, 16), torch.tensor([[0, 1, 2, 3]])
    assert kernels.compress_pool(ring.flatten(), rows, index, 4, 1, 8) is None
    assert kernels.compress_pool(ring, rows, index, 0, 1, 8) is None


def test_moe_shapes_that_do_not_fit_are_refused_not_read(kernels):
    moe, args = _moe()
    x, ids = torch.randn(3, args.hidden_size), torch.arange(3)
    with torch.no_grad():
        w1, w2, w3 = moe._stacked()
    gate, shared = moe.gate.routing(), moe.shared_in_stack

    def run(gate=gate, stacks=(w1, w2, w3), ids=ids):
        with torch.no_grad():
            return kernels.moe(x, ids, gate, stacks, shared, moe.limit)

    def gate_with(**changes):
        return dataclasses.replace(gate, **changes)

    assert run() is not None and run(gate=gate_with()) is not None
    narrow = w2[:, :, :-1].contiguous()
    assert run(stacks=(w1, narrow, w3)) is None  # w2's inter != w1's
    assert run(stacks=(w1, w2, w3[:, :-1].contiguous())) is None
    assert run(stacks=(w1[:-1], w2[:-1], w3[:-1])) is None  # an expert short
    assert run(ids=ids[:2]) is None  # a token id per row
    wide = torch.randn(gate.weight.shape[0], args.hidden_size + 1)
    assert run(gate=gate_with(weight=wide)) is None
    assert run(gate=gate_with(bias=torch.zeros(gate.weight.shape[0] - 1))) is None
    assert run(gate=gate_with(top_k=gate.weight.shape[0] + 1)) is None
    k = args.num_experts_per_tok
    table = torch.zeros(args.vocab_size, k + 1, dtype=torch.int64)  # a row of k per token
    assert run(gate=gate_with(tid2eid=table, bias=None)) is None
    table = torch.zeros(args.vocab_size, k, dtype=torch.int64)
    assert run(gate=gate_with(tid2eid=table, bias=None)) is not None


@pytest.mark.parametrize("heads", [8, 4, 6])
def test_a_minus_inf_sink_weighs_nothing(kernels, heads):
    """exp(-inf) is 0 in the vector softmax too (it was NaN for a block of lanes)."""
    from xspec.models.deepseek_v4.attention import sparse_attention

    gen = torch.Generator().manual_seed(heads)
    q, parts, _ = _attention_case(gen, 3, heads, 32)
    sink = torch.full((heads,), float("-inf"))
    sink[0] = 0.5  # one finite sink in the block: the max is finite, the rest exp(-inf)
    fused = kernels.sparse_attention(q, parts, sink, 0.1)
    assert fused is not None and not fused.isnan().any()
    torch.testing.assert_close(fused, sparse_attention(q, parts, sink, 0.1))
    everywhere = torch.full((heads,), float("-inf"))
    fused = kernels.sparse_attention(q, parts, everywhere, 0.1)
    assert fused is not None and not fused.isnan().any()
    torch.testing.assert_close(fused, sparse_attention(q, parts, everywhere, 0.1))


# reads 60 floats past x's buffer through the raw entry point (the wrapper would refuse)
_ASAN_PROBE = """
import ctypes, torch
from xspec.platforms import native
kernels, why = native.load()
assert kernels is not None, why
x, y = torch.randn(4), torch.empty(64)
kernels.lib.xspec_rms_norm(x.data_ptr(), None, 1, 64, ctypes.c_float(1e-6), y.data_ptr())
"""


@pytest.mark.slow
def test_the_kernel_tests_pass_under_asan(tmp_path):
    """This file's tests (all but the slow ones) against ``kernels.c`` built with
    ``-fsanitize=address``, in a fresh process that preloads the sanitizer's runtime: a
    read or write past a tensor's buffer aborts that run. A probe first checks that the
    sanitizer is live. ``python -m pytest -m slow tests/platforms/test_native.py -k asan``
    """
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    found = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True)
    runtime = found.stdout.strip()
    if found.returncode != 0 or not os.path.isabs(runtime):
        pytest.skip(f"{cc} has no AddressSanitizer runtime (libasan.so)")
    asan_cc = tmp_path / "asan-cc"
    asan_cc.write_text(f'#!/bin/sh\nexec {cc} -fsanitize=address -fno-omit-frame-pointer "$@"\n')
    asan_cc.chmod(0o755)
    env = {
        **os.environ,
        "CC": str(asan_cc),  # a compiler of its own: its builds get their own cache names
        "XSPEC_CACHE_DIR": str(tmp_path / "cache"),
        "LD_PRELOAD": runtime,  # python is not instrumented: the runtime must load first
        "ASAN_OPTIONS": "detect_leaks=0",  # the interpreter's own allocations at exit
    }
    root = Path(__file__).resolve().parents[2]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, *args]
        return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=1200)

    probe = run("-c", _ASAN_PROBE)
    if "AddressSanitizer" not in probe.stderr and "building kernels.c failed" in probe.stderr:
        pytest.skip(f"{cc} cannot build with -fsanitize=address: {probe.stderr[-500:]}")
    assert "AddressSanitizer: heap-buffer-overflow" in probe.stderr, probe.stderr[-2000:]
    tests = run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", __file__)
    assert tests.returncode == 0, (tests.stdout + tests.stderr)[-4000:]


# -- W8A8 quant_linear ---------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 6, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_quant_linear_equals_the_native_semantics(
    kernels, rows: int, dtype: torch.dtype
) -> None:
    """int8 codes times the stored int8 weight, exact int32 sums: bit for bit the
    plain-torch semantics (xspec.models.quantized.native_linear), bias included."""
    from xspec.models.deepseek_v4.convert import quantize_int8
    from xspec.models.quantized import QuantizedWeight, native_linear

    gen = torch.Generator().manual_seed(rows)
    q, s = quantize_int8(torch.randn(200, 1000, generator=gen))
    w = QuantizedWeight("w8a8", q, s, torch.zeros_like(s), dtype, "native")
    x = (torch.randn(rows, 1000, generator=gen) * 3).to(dtype)
    bias = torch.randn(200, generator=gen)
    got = kernels.quant_linear(x, w, bias)
    assert got is not None and got.dtype == dtype
    assert torch.equal(got, native_linear(x, w, bias))
    prefill = torch.randn(40, 1000, generator=gen).to(dtype)  # torch._int_mm, same semantics
    assert torch.equal(kernels.quant_linear(prefill, w, None), native_linear(prefill, w, None))
    asym = QuantizedWeight("w8a8", q, s, torch.ones_like(s), dtype, "native")
    assert kernels.quant_linear(x, asym, None) is None


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
@pytest.mark.parametrize("rows", [1, 6, 40])
def test_lowbit_quant_linear_is_the_native_semantics(kernels, fmt: str, rows: int) -> None:
    """FP8 / MXFP4 from the stored bytes: the plain-torch semantics up to summation
    order, and each row the same alone as in a batch (prefill, decode and verify agree)."""
    from xspec.models.deepseek_v4.convert import quantize_fp8_blocks
    from xspec.models.deepseek_v4.quant import quant_mxfp4
    from xspec.models.quantized import QuantizedWeight, native_linear

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 512, generator=gen) / 16
    q, s = quant_mxfp4(w) if fmt == "mxfp4" else quantize_fp8_blocks(w, [128, 128])
    weight = QuantizedWeight(fmt, q, s, None, torch.float32, "native")
    x = torch.randn(rows, 512, generator=gen) * 2
    bias = torch.randn(200, generator=gen)
    got = kernels.quant_linear(x, weight, bias)
    assert got is not None and got.shape == (rows, 200)
    torch.testing.assert_close(got, native_linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    alone = kernels.quant_linear(x[-1:], weight, bias)
    assert alone is not None and torch.equal(alone[0], got[-1])
    cut = (q[:, :48] if fmt == "mxfp4" else q[:, :96]).contiguous()
    odd = QuantizedWeight(fmt, cut, s, None, torch.float32)
    assert kernels.quant_linear(x[:, :96], odd, None) is None  # K not a multiple of 128
