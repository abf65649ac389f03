"""Exact rollback: scoring rows, truncating, and continuing equals never having scored
the dropped rows (SWA ring slots, compressor rows, compressed entries, indexer keys)."""

from __future__ import annotations

import pytest
import torch

from xspec.models.base import ForwardBatch

TOL = 2e-5  # only BLAS blocking over different row counts differs (~1e-6)


def prefill(dsv4, model, prompt, n):
    state = model.new_state()
    if n:
        dsv4.run(model, prompt[:n], state)
    return state


def test_truncate_then_continue_equals_never_scored_in_a_batch(dsv4):
    """Sequence A at 250 scores 7 rows and keeps 2 (the dropped rows hold the CSA and
    HCA emission at 255); sequence B at 124 scores 6 and keeps 3 (dropped: the HCA
    emission at 127, the ring's 128th slot). Both then continue in one batch."""
    model = dsv4.model("tiny", 0)
    vocab = model.vocab_size
    prompts = [dsv4.ids(270, vocab, 31), dsv4.ids(150, vocab, 32)]
    starts, scored, kept, more = [250, 124], [7, 6], [2, 3], [9, 8]
    states = [prefill(dsv4, model, p, s) for p, s in zip(prompts, starts)]
    drafts = [dsv4.ids(n, vocab, 40 + i) for i, n in enumerate(scored)]
    rows = [torch.cat([p[s : s + k], d[k:]]) for p, s, k, d in zip(prompts, starts, kept, drafts)]
    model(ForwardBatch(torch.cat(rows), scored, states))
    for state, s, k in zip(states, starts, kept):
        model.truncate(state, s + k)
        assert state.num_tokens == s + k
    cont = [p[s + k : s + k + m] for p, s, k, m in zip(prompts, starts, kept, more)]
    out = model(ForwardBatch(torch.cat(cont), more, states)).logits

    r0 = 0
    for i, (prompt, s, k, m) in enumerate(zip(prompts, starts, kept, more)):
        ref_state = prefill(dsv4, model, prompt, s + k)
        ref = dsv4.run(model, cont[i], ref_state).logits
        diff = dsv4.max_diff(out[r0 : r0 + m], ref)
        assert diff <= TOL, f"sequence {i}: continuation after rollback differs by {diff:.3g}"
        assert_same_state(dsv4, states[i], ref_state)
        r0 += m


def assert_same_state(dsv4, state, ref) -> None:
    """Every valid cache row equals the reference's (entries, rings of live positions)."""
    assert state.num_tokens == ref.num_tokens
    for layer, (a, b) in enumerate(zip(state.layers, ref.layers)):
        for ca, cb in zip(a.compressors(), b.compressors()):
            assert ca.n_entries == cb.n_entries == state.num_tokens // ca.ratio
            diff = dsv4.max_diff(ca.valid_entries(), cb.valid_entries())
            assert diff <= TOL, f"layer {layer}: compressed entries differ by {diff:.3g}"
        live = a.window_rows(state.num_tokens)  # the raw rows the next query reads
        diff = dsv4.max_diff(live, b.window_rows(state.num_tokens))
        assert diff <= TOL, f"layer {layer}: SWA ring differs by {diff:.3g}"


@pytest.mark.parametrize("config", ["tiny", "variant"])
def test_speculative_rounds_match_a_single_forward(dsv4, config):
    """Simulated verification: from position 100 to ~300, score gamma+1 = 5 rows (the
    first committed, four random drafts), keep a random prefix of them plus the true
    token; every committed row's logits equal one full forward over the committed text."""
    model = dsv4.model(config, 1)
    gen = torch.Generator().manual_seed(5)
    text = dsv4.ids(100, model.vocab_size, 50)
    state = model.new_state()
    committed_logits = [dsv4.run(model, text, state).logits]
    while text.shape[0] < 300:
        drafts = torch.randint(0, model.vocab_size, (4,), generator=gen)
        nxt = torch.randint(0, model.vocab_size, (1,), generator=gen)
        rows = torch.cat([nxt, drafts])
        logits = dsv4.run(model, rows, state).logits
        keep = int(torch.randint(1, 6, (1,), generator=gen))  # accepted drafts + the anchor
        model.truncate(state, text.shape[0] + keep)
        text = torch.cat([text, rows[:keep]])
        committed_logits.append(logits[:keep])
    full = dsv4.run(model, text, model.new_state()).logits
    diff = dsv4.max_diff(torch.cat(committed_logits), full)
    assert diff <= TOL, f"{config}: speculative rounds vs single forward max abs diff {diff:.3g}"


def test_truncate_range_is_enforced(dsv4):
    model = dsv4.model("tiny", 0)  # max_rollback 8
    state = prefill(dsv4, model, dsv4.ids(40, model.vocab_size, 60), 40)
    with pytest.raises(ValueError, match=r"exact range is \[32, 40\]"):
        model.truncate(state, 41)
    with pytest.raises(ValueError, match="larger max_rollback"):
        model.truncate(state, 31)
    model.truncate(state, 35)
    for layer in state.layers:  # counters drop the entries of truncated windows
        assert layer.num_tokens == 35
        assert all(c.n_entries == 35 // c.ratio for c in layer.compressors())
    # the ring only reaches 8 rows behind the furthest position ever held (40)
    with pytest.raises(ValueError, match=r"exact range is \[32, 35\]"):
        model.truncate(state, 27)
    model.truncate(state, 32)
    model.truncate(state, 32)  # a no-op truncate is allowed
    assert state.num_tokens == 32
