"""Chunking invariance and ragged batching of the xspec DeepSeek-V4 model.

Any split of a sequence into forwards, and any ragged batch composition, must give the
full forward's logits: speculative verification (several rows at any position) relies
on it. Differences come only from BLAS blocking over a different row count (~1e-6).
"""

from __future__ import annotations

import time

import pytest
import torch

from xspec.models.base import CapturePoint, CaptureSite, ForwardBatch

TOL = 2e-5

CHUNKINGS = [
    [2, 5, 121, 1, 1, 130, 40],  # ring wrap and window edge inside chunks
    [64, 64, 64, 64, 44],  # every chunk ends on a 4/128 boundary
    [3] * 100,  # MTP-style verify steps straddling every emission point
    [127, 1, 127, 1, 44],  # the HCA emissions (127, 255) are single-row steps
]


@pytest.mark.parametrize("config", ["tiny", "variant"])
@pytest.mark.parametrize("chunks", CHUNKINGS, ids=["uneven", "aligned", "steps3", "emit1"])
def test_chunked_forward_equals_full_forward(dsv4, config, chunks):
    model = dsv4.model(config, 0)
    ids = dsv4.ids(300, model.vocab_size, 7)
    full = dsv4.run(model, ids, model.new_state()).logits
    diff = dsv4.max_diff(dsv4.run_chunks(model, ids, chunks), full)
    assert diff <= TOL, f"{config} {chunks[:4]}...: max abs diff {diff:.3g}"


def test_token_by_token_from_position_zero_equals_full_forward(dsv4):
    """Decoding from the very first token: window-less start, CSA entry 0 (whose previous
    window is empty), ring wrap at 136, HCA emission at 127."""
    model = dsv4.model("tiny", 0)
    ids = dsv4.ids(140, model.vocab_size, 8)
    full = dsv4.run(model, ids, model.new_state()).logits
    diff = dsv4.max_diff(dsv4.run_chunks(model, ids, [1] * 140), full)
    assert diff <= TOL, f"token-by-token max abs diff {diff:.3g}"


def test_ragged_batch_equals_each_sequence_alone(dsv4):
    """Three sequences at positions 0, 124 and 250 score 5, 8 and 3 rows in one batch
    (crossing the 127/128 and 255 boundaries), twice; each equals running alone."""
    model = dsv4.model("tiny", 0)
    capture = [CapturePoint(1, CaptureSite.OUTPUT), CapturePoint(3, CaptureSite.INPUT)]
    prompts = [dsv4.ids(n, model.vocab_size, 20 + i) for i, n in enumerate([20, 140, 270])]
    starts, steps = [0, 124, 250], [[5, 8, 3], [4, 2, 6]]
    batched = [model.new_state() for _ in prompts]
    alone = [model.new_state() for _ in prompts]
    for states in (batched, alone):
        for state, prompt, start in zip(states, prompts, starts):
            if start:
                dsv4.run(model, prompt[:start], state)
    offsets = list(starts)
    for lens in steps:
        rows = [p[o : o + n] for p, o, n in zip(prompts, offsets, lens)]
        out = model(ForwardBatch(torch.cat(rows), lens, batched, capture=capture))
        r0 = 0
        for i, (row_ids, n) in enumerate(zip(rows, lens)):
            ref = dsv4.run(model, row_ids, alone[i], capture=capture)
            got = slice(r0, r0 + n)
            for name, a, b in [
                ("logits", out.logits[got], ref.logits),
                ("hidden", out.hidden[got], ref.hidden),
                ("aux", out.aux_hidden[got], ref.aux_hidden),
            ]:
                diff = dsv4.max_diff(a, b)
                assert diff <= TOL, f"seq {i} at {offsets[i]} {name}: max abs diff {diff:.3g}"
            assert batched[i].num_tokens == alone[i].num_tokens == offsets[i] + n
            r0 += n
        offsets = [o + n for o, n in zip(offsets, lens)]


def test_empty_sequence_in_a_batch_is_left_untouched(dsv4):
    model = dsv4.model("tiny", 0)
    a, b = model.new_state(), model.new_state()
    ids = dsv4.ids(6, model.vocab_size, 3)
    out = model(ForwardBatch(ids, [6, 0], [a, b]))
    assert out.logits.shape == (6, model.vocab_size)
    assert (a.num_tokens, b.num_tokens) == (6, 0)


@pytest.mark.slow
def test_decode_step_cost_is_flat_in_context_length(dsv4):
    """Per-step work is O(window + selected entries + HCA entries): a decode step at
    context 4096 costs about what it costs at 256 (no recompute over the prefix)."""
    model = dsv4.model("tiny", 0)
    ids = dsv4.ids(4096 + 16, model.vocab_size, 9)

    def step_time(context: int) -> float:
        state = model.new_state()
        dsv4.run_chunks(model, ids[:context], [512] * (context // 512) + [context % 512], state)
        times = []
        for i in range(context, context + 12):
            t0 = time.perf_counter()
            dsv4.run(model, ids[i : i + 1], state)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    short, long = step_time(256), step_time(4096 - 16)
    assert long < 2.0 * short, (
        f"decode step: {short * 1e3:.1f} ms at 256, {long * 1e3:.1f} ms at 4080"
    )


@pytest.mark.parametrize("rows", [[0, 5, 299], [299], []])
def test_logit_rows_score_those_rows_only(dsv4, rows):
    """A batch that names its ``logit_rows`` gets exactly those rows' logits (a prefill
    reads only each prompt's last row), and the same hidden states as without."""
    model = dsv4.model("tiny", 0)
    ids = dsv4.ids(300, model.vocab_size, 7)
    full = dsv4.run(model, ids, model.new_state())
    some = dsv4.run(model, ids, model.new_state(), logit_rows=rows)
    assert some.logits.shape == (len(rows), model.vocab_size)
    assert not rows or dsv4.max_diff(some.logits, full.logits[rows]) <= TOL
    assert torch.equal(some.hidden, full.hidden)


@pytest.mark.parametrize("rows", [[3, 1], [0, 0], [-1], [300]])
def test_bad_logit_rows_are_refused(dsv4, rows):
    ids = dsv4.ids(300, 64, 7)
    with pytest.raises(ValueError, match="logit_rows must be ascending row indices in"):
        ForwardBatch(ids, [300], [None], logit_rows=rows)
