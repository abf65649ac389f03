"""DeepSeek-V4 DSpark stages: index sets, the batched cached draft forward against a naive
dense reference, the confidence head, the checkpoint plan (vocabulary latch, errors)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.platforms.conformance import NativeSas, PlatformCfg
from xspec.errors import CheckpointError
from xspec.models.deepseek_v4.args import DeepseekV4Args
from xspec.models.deepseek_v4.dspark import (
    HOLD_ROWS,
    PENDING_ROWS,
    DraftWindow,
    DSparkDraft,
    block_index,
    context_index,
    plan_dspark,
    visible_context,
)
from xspec.models.deepseek_v4.mhc import hc_post, hc_pre
from xspec.models.deepseek_v4.tiny import dspark_config, dspark_tensors
from xspec.models.loading import write_checkpoint
from xspec.platforms.base import SasMode
from xspec.platforms.cpu import CpuPlatform

WINDOW = 8  # small, so contexts wrap the rings many times


def small_args() -> DeepseekV4Args:
    return dataclasses.replace(DeepseekV4Args.tiny(), sliding_window=WINDOW)


def platform(native_sas: str) -> CpuPlatform:
    return CpuPlatform(PlatformCfg(name="cpu", native_sas=NativeSas(native_sas)))


@pytest.fixture(scope="module")
def draft() -> DSparkDraft:
    d = DSparkDraft(
        small_args(),
        num_stages=3,
        markov_rank=16,
        noise_token_id=511,
        confidence=True,
        embed=None,
        head=None,
    )
    d.init_random_(7)
    return d.eval()


# -- index sets --------------------------------------------------------------------------


def test_ori_win_left_and_visible_context() -> None:
    assert SasMode.NATIVE.ori_win_left(128, 5) == 132
    assert SasMode.COMPAT.ori_win_left(128, 5) == 127
    assert SasMode.NATIVE.ori_win_left(128, 0) == 127
    # visible keys = ori_win_left + 1: native keeps the whole window of context
    assert visible_context(SasMode.NATIVE, 128, 5) == 128
    assert visible_context(SasMode.COMPAT, 128, 5) == 123


def test_context_index_wraps_the_ring() -> None:
    # sequence 0 at p=10 in a ring of 4 sees positions 6..9 -> slots 2, 3, 0, 1 (+ 0 * 4);
    # sequence 1 at p=2 sees positions -2..1 -> -1, -1, then slots 0, 1 of ring row 1
    index = context_index(torch.tensor([10, 2]), ring=4, visible=4)
    assert index.tolist() == [[2, 3, 0, 1], [-1, -1, 4, 5]]
    # positions 4..8 in a ring of 4 wrap (remainder, never clamp): 0, 1, 2, 3, 0
    assert context_index(torch.tensor([9]), ring=4, visible=5).tolist() == [[0, 1, 2, 3, 0]]


def test_block_index_is_the_whole_block_for_every_row() -> None:
    assert block_index(2, 3, torch.device("cpu")).tolist() == [
        [0, 1, 2],
        [0, 1, 2],
        [0, 1, 2],
        [3, 4, 5],
        [3, 4, 5],
        [3, 4, 5],
    ]


# -- the draft forward against a dense reference -------------------------------------------


def naive_block(
    draft: DSparkDraft, aux: torch.Tensor, tokens: torch.Tensor, mode: SasMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, no caches: every context K/V recomputed from ``aux [p, K*d]``, the
    visible set written out as positions. ``tokens [W]`` -> (h [W, d], logits [W, V])."""
    args, (p, width) = draft.args, (aux.shape[0], tokens.shape[0])
    first, last = draft.stages[0], draft.stages[-1]
    main_x = first.main_norm(first.main_proj(aux))  # [p, d]
    visible = visible_context(mode, WINDOW, width)
    ctx_pos = torch.arange(max(0, p - visible), p)
    blk_pos = torch.arange(p, p + width)
    x = first.embed(tokens).unsqueeze(1).expand(-1, args.hc_mult, -1).contiguous()
    for stage in draft.stages:
        attn = stage.attn
        rot_ctx = attn.rope.rotation(ctx_pos, p + width)
        rot_blk = attn.rope.rotation(blk_pos, p + width)
        u, post, comb = hc_pre(x, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, args)
        u = stage.attn_norm(u)
        _, q = attn.query(u, rot_blk)  # [W, H, D]
        keys = torch.cat([attn.key_value(main_x[ctx_pos], rot_ctx), attn.key_value(u, rot_blk)])
        logits = torch.einsum("whd,kd->whk", q.float(), keys.float()) * attn.head_dim**-0.5
        sink = attn.attn_sink.float().view(1, -1, 1).expand(width, -1, 1)
        probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
        out = torch.einsum("whk,kd->whd", probs, keys.float())
        x = hc_post(attn.output(out, rot_blk, u.dtype), x, post, comb)
        u, post, comb = hc_pre(x, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, args)
        x = hc_post(stage.ffn(stage.ffn_norm(u), tokens), x, post, comb)
    h = last.hyper_head(x)
    return h, last.head(last.norm(h)).float()


def test_context_is_computed_only_when_the_sequence_drafts(draft: DSparkDraft) -> None:
    """Committed rows are held back and no K/V is computed until the sequence drafts,
    however many steps it goes without (of the rows held then, only the last ``window``
    are kept, and computed); the drafts then equal a cache written row by row at once.
    Checked after a long prompt, after fewer rows than the window (the backlog's ring
    not aligned to its slots) and after more than a window of steps without drafts."""
    draft.set_window(DraftWindow(platform("auto")))
    window = draft.args.sliding_window
    gen = torch.Generator().manual_seed(3)
    k_d = 3 * draft.args.hidden_size
    lazy, eager = draft.new_cache(3), draft.new_cache(3)

    def commit(rows: torch.Tensor) -> None:
        """``rows`` one step at a time, a step that does not draft each: nothing computed."""
        before = [r.data.clone() for r in lazy.rings]
        for row in rows:
            draft.write_context([lazy], row[None], [1])
            draft.write_context([eager], row[None], [1])
            draft.flush_context([eager])
        assert all(torch.equal(r.data, b) for r, b in zip(lazy.rings, before))
        assert lazy.observed == eager.num_tokens
        assert lazy.backlog_rows <= window and lazy.pending_rows < lazy.held.shape[0]

    def drafts_equal() -> None:
        tokens = torch.randint(0, 511, (1, 3), generator=gen)
        got = draft.forward_block([lazy], tokens)[1]  # flushes first
        assert (lazy.pending_rows, lazy.backlog_rows, lazy.backlog) == (0, 0, None)
        assert lazy.num_tokens == eager.num_tokens
        want = draft.forward_block([eager], tokens)[1]
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        for a, b in zip(lazy.rings, eager.rings):
            torch.testing.assert_close(a.data, b.data, atol=2e-5, rtol=2e-5)

    prompt = torch.randn(2 * window + 5, k_d, generator=gen)
    draft.write_context([lazy], prompt, [len(prompt)])  # a prompt: its last window rows
    assert (lazy.num_tokens, lazy.backlog_rows) == (window + 5, window)
    assert all(not r.data.any() for r in lazy.rings)  # nothing computed yet
    for row in prompt:
        draft.write_context([eager], row[None], [1])
        draft.flush_context([eager])
    drafts_equal()
    commit(torch.randn(PENDING_ROWS + 13, k_d, generator=gen))  # part of a window
    assert lazy.backlog_rows > 0
    drafts_equal()
    commit(torch.randn(window + 2 * PENDING_ROWS + 3, k_d, generator=gen))  # beyond it
    assert lazy.backlog_rows == window
    drafts_equal()


def test_without_a_held_window_a_full_buffer_is_written_at_once(draft: DSparkDraft) -> None:
    """``hold_window`` off (a run in which every request drafts every step): a prompt and
    a full buffer of held rows are written at once, no backlog is allocated, and the
    drafts equal a cache written row by row."""
    draft.set_window(DraftWindow(platform("auto")))
    gen = torch.Generator().manual_seed(4)
    k_d = 3 * draft.args.hidden_size
    draft.hold_window = False
    try:
        lazy, eager = draft.new_cache(3), draft.new_cache(3)
        rows = torch.randn(2 * draft.args.sliding_window + 5 + PENDING_ROWS, k_d, generator=gen)
        prompt, steps = rows[:-PENDING_ROWS], rows[-PENDING_ROWS:]
        draft.write_context([lazy], prompt, [len(prompt)])  # written now
        assert (lazy.num_tokens, lazy.pending_rows, lazy.backlog) == (len(prompt), 0, None)
        for n, row in enumerate(steps, 1):  # held, until the buffer is full
            draft.write_context([lazy], row[None], [1])
            assert lazy.backlog is None and lazy.pending_rows == n % PENDING_ROWS
        assert lazy.num_tokens == len(rows)
        for row in rows:
            draft.write_context([eager], row[None], [1])
            draft.flush_context([eager])
        tokens = torch.randint(0, 511, (1, 3), generator=gen)
        torch.testing.assert_close(
            draft.forward_block([lazy], tokens)[1],
            draft.forward_block([eager], tokens)[1],
            atol=2e-5,
            rtol=2e-5,
        )
    finally:
        draft.hold_window = True


def test_a_batch_of_held_rows_equals_each_cache_taken_alone(draft: DSparkDraft) -> None:
    """One ``write_context`` over caches at different fill levels (some rows held back,
    one cache's rows overflowing its buffer to its backlog, one sequence without rows)
    leaves every cache as the same rows written to it alone; the held rows are scattered
    into one stack of the buffers, which the next call of the same batch reuses."""
    gen = torch.Generator().manual_seed(5)
    k_d = 3 * draft.args.hidden_size
    batch = [draft.new_cache(3) for _ in range(4)]
    alone = [draft.new_cache(3) for _ in range(4)]
    held = min(HOLD_ROWS, draft.args.sliding_window)  # each buffer's rows (held_rows)
    assert batch[0].held.shape[0] == held
    for lens in ([2, 0, 5, 1], [1, 1, held - 1, 1], [3, 1, 1, 0], [1, 1, 1, 1]):
        aux = torch.randn(sum(lens), k_d, generator=gen)
        draft.write_context(batch, aux, lens)
        for cache, rows in zip(alone, aux.split(lens)):
            draft.write_context([cache], rows, [len(rows)])
        for a, b in zip(batch, alone):
            counts = [(c.num_tokens, c.backlog_rows, c.pending_rows) for c in (a, b)]
            assert counts[0] == counts[1]
            torch.testing.assert_close(a.held[: a.pending_rows], b.held[: b.pending_rows])
    assert batch[2].backlog_rows > 0  # it overflowed: moved to its backlog
    assert all(c.held_ring.stack is batch[0].held_ring.stack for c in batch)
    tokens = torch.randint(0, 511, (4, 3), generator=gen)
    torch.testing.assert_close(
        draft.forward_block(batch, tokens)[1], draft.forward_block(alone, tokens)[1]
    )


@pytest.mark.parametrize("native_sas", ["auto", "off"])
@pytest.mark.parametrize("width", [1, 3, 6])
def test_cached_batched_draft_equals_dense_reference(
    draft: DSparkDraft, native_sas: str, width: int
) -> None:
    """Three sequences at different positions, context written in chunks of 1..11 rows
    (wrapping the rings), drafted after every chunk; both SAS modes."""
    window = DraftWindow(platform(native_sas))
    draft.set_window(window)
    gen = torch.Generator().manual_seed(width)
    k_d = 3 * draft.args.hidden_size
    history = [torch.empty(0, k_d) for _ in range(3)]
    caches = [draft.new_cache(width) for _ in range(3)]
    for chunks in ([3, 1, 11], [1, 2, 1], [9, 1, 4], [1, 1, 1]):
        aux = [torch.randn(n, k_d, generator=gen) for n in chunks]
        draft.write_context(caches, torch.cat(aux), list(chunks))
        history = [torch.cat([h, a]) for h, a in zip(history, aux)]
        tokens = torch.randint(0, 511, (3, width), generator=gen)
        h, logits = draft.forward_block(caches, tokens)  # [B, W, d], [B, W, V]
        for b in range(3):
            h_ref, logits_ref = naive_block(draft, history[b], tokens[b], window.mode)
            torch.testing.assert_close(logits[b], logits_ref, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(h[b], h_ref, atol=2e-5, rtol=2e-5)
    assert [c.num_tokens for c in caches] == [
        sum(x) for x in zip([3, 1, 11], [1, 2, 1], [9, 1, 4], [1, 1, 1])
    ]


def test_sas_modes_differ_only_through_the_lost_context(draft: DSparkDraft) -> None:
    """With fewer than window - W context rows both layouts see the same keys."""
    k_d = 3 * draft.args.hidden_size
    aux = torch.randn(2, k_d, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[5, 511, 511]])
    out = {}
    for native_sas in ("auto", "off"):
        draft.set_window(DraftWindow(platform(native_sas)))
        caches = [draft.new_cache(3)]
        draft.write_context(caches, aux, [2])
        out[native_sas] = draft.forward_block(caches, tokens)[1]
    torch.testing.assert_close(out["auto"], out["off"])


def test_confidence_batched_equals_per_position(draft: DSparkDraft) -> None:
    head, markov = draft.confidence, draft.markov
    assert head is not None and head.with_markov
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(2, 5, draft.args.hidden_size, generator=gen)
    prev = torch.randint(0, 512, (2, 5), generator=gen)
    batched = head(h, markov.embed(prev))  # [2, 5]
    for k in range(5):
        single = head(h[:, k], markov.embed(prev[:, k]))  # [2]
        torch.testing.assert_close(batched[:, k], single)
        manual = torch.sigmoid(
            torch.cat([h[:, k], markov.markov_w1.weight[prev[:, k]]], -1) @ head.proj.weight[0]
        )
        torch.testing.assert_close(single, manual)


# -- checkpoint plan ---------------------------------------------------------------------------


def write_dspark(
    path: Path,
    *,
    dedicated: bool = False,
    config_edit=None,
    tensor_edit=None,
    vocab_first: bool = False,
) -> Path:
    args = DeepseekV4Args.tiny()
    config = dspark_config(args)
    tensors = dspark_tensors(config, 5, dedicated_vocab=dedicated)
    if config_edit:
        config_edit(config)
    if tensor_edit:
        tensor_edit(tensors)
    vocab = {k: t for k, t in tensors.items() if k.endswith(("embed.weight", "head.weight"))}
    rest = {k: t for k, t in tensors.items() if k not in vocab}
    # the dedicated tensors in the first or the last shard: the latch must not care
    ordered = (vocab | rest) if vocab_first else (rest | vocab)
    write_checkpoint(path, ordered, config, max_shard_bytes=4 << 20)
    return path


@pytest.mark.parametrize("vocab_first", [False, True])
def test_dedicated_vocabulary_wins_in_any_shard_order(tmp_path: Path, vocab_first: bool) -> None:
    path = write_dspark(tmp_path / "d", dedicated=True, vocab_first=vocab_first)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) >= 2  # really sharded
    plan = plan_dspark(path, DeepseekV4Args.tiny())
    assert plan.own_embed and plan.own_head
    from xspec.models.deepseek_v4.dspark import load_dspark

    shared = (nn.Embedding(512, 256), nn.Linear(256, 512, bias=False))
    draft = load_dspark(
        plan, embed=shared[0], head=shared[1], window=None, dtype=torch.float32, device="cpu"
    )
    want = dspark_tensors(dspark_config(DeepseekV4Args.tiny()), 5, dedicated_vocab=True)
    assert draft._vocab[0] is not shared[0] and draft._vocab[1] is not shared[1]
    torch.testing.assert_close(draft._vocab[0].weight, want["mtp.0.embed.weight"])
    torch.testing.assert_close(draft._vocab[1].weight, want["mtp.2.head.weight"])


def test_shared_vocabulary_without_dedicated_tensors(tmp_path: Path) -> None:
    plan = plan_dspark(write_dspark(tmp_path / "d"), DeepseekV4Args.tiny())
    assert not plan.own_embed and not plan.own_head and plan.confidence
    assert plan.capture_layer_ids == [2, 3, 4] and plan.block_size == 5 and plan.num_stages == 3


def test_layer_input_capture_reads_the_previous_output(tmp_path: Path) -> None:
    path = write_dspark(
        tmp_path / "d", config_edit=lambda c: c.update(dspark_capture="layer_input")
    )
    assert plan_dspark(path, None).capture_layer_ids == [1, 2, 3]


def _rank(t: dict) -> None:
    t["mtp.2.markov_head.markov_w2.weight"] = torch.zeros(512, 8)


BAD = [
    ("noise id", lambda c: c.update(dspark_noise_token_id=512), None, "dspark_noise_token_id=512"),
    (
        "layer id",
        lambda c: c.update(dspark_target_layer_ids=[2, 3, 9]),
        None,
        "layer ids in [0, 5)",
    ),
    ("no dspark keys", lambda c: c.pop("dspark_block_size"), None, "lacks dspark_block_size"),
    ("markov rank", None, _rank, "Markov head rank mismatch"),
    (
        "stage count",
        lambda c: c.update(dspark_target_layer_ids=[3, 4]),
        None,
        "beyond the 2 stages",
    ),
    ("capture", lambda c: c.update(dspark_capture="middle"), None, "dspark_capture='middle'"),
    (
        "missing",
        None,
        lambda t: t.pop("mtp.1.attn.wkv.weight"),
        "missing tensor mtp.1.attn.wkv.weight",
    ),
]


@pytest.mark.parametrize(
    ("name", "config_edit", "tensor_edit", "message"), BAD, ids=[b[0] for b in BAD]
)
def test_plan_errors(tmp_path: Path, name: str, config_edit, tensor_edit, message: str) -> None:
    path = write_dspark(tmp_path / "d", config_edit=config_edit, tensor_edit=tensor_edit)
    with pytest.raises(CheckpointError) as err:
        plan_dspark(path, DeepseekV4Args.tiny())
    assert message in str(err.value)


def test_hidden_mismatch_with_the_target(tmp_path: Path) -> None:
    path = write_dspark(tmp_path / "d")
    other = dataclasses.replace(DeepseekV4Args.tiny(), hidden_size=128)
    with pytest.raises(CheckpointError, match="hidden_size is 256 but the target's is 128"):
        plan_dspark(path, other)
