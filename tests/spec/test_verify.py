"""Rejection sampler unit tests on hand-built inputs (xspec/spec/verify.py)."""

from __future__ import annotations

import pytest
import torch

from xspec.sampling import inverse_cdf
from xspec.spec.verify import rejection_sample


def _one_hot(ids: list[list[int]], vocab: int) -> torch.Tensor:
    """ids [B, L] -> one-hot probs [B, L, V] float32 (greedy target rows)."""
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _random_case(bsz: int, gamma: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Peaked random p, q (so acceptances and rejections both happen) and drafts ~ q."""
    g = _gen(seed)
    p = torch.softmax(3 * torch.randn(bsz, gamma + 1, vocab, generator=g), dim=-1)
    q = torch.softmax(3 * torch.randn(bsz, gamma, vocab, generator=g), dim=-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).reshape(bsz, gamma)
    return p, q, drafts


def _reference(
    p: torch.Tensor,  # [B, gamma+1, V]
    drafts: torch.Tensor,  # [B, gamma]
    q: torch.Tensor | None,  # [B, gamma, V] or None (one-hot q)
    seeds: list[int | None],
    num_drafts: torch.Tensor,  # [B]
) -> torch.Tensor:
    """Row-by-row transcription of the algorithm, from identically seeded generators: [B, gamma+1]."""
    out = torch.full((p.shape[0], p.shape[1]), -1, dtype=torch.long)
    for b, seed in enumerate(seeds):
        n = int(num_drafts[b])
        if seed is None:  # greedy
            a = 0
            while a < n and drafts[b, a] == p[b, a].argmax():
                a += 1
            out[b, :a] = drafts[b, :a]
            out[b, a] = p[b, a].argmax()
            continue
        u = torch.rand(n + 1, generator=_gen(seed))
        a = 0
        for k in range(n):
            d = int(drafts[b, k])
            q_k = (
                q[b, k]
                if q is not None
                else torch.nn.functional.one_hot(drafts[b, k], p.shape[-1]).float()
            )
            if u[k] * q_k[d] < p[b, k, d]:  # accept with probability min(1, p/q)
                a += 1
                continue
            residual = (p[b, k] - q_k).clamp(min=0)
            out[b, :a] = drafts[b, :a]
            out[b, a] = inverse_cdf(residual[None], u[n : n + 1])[0]
            break
        else:
            out[b, :n] = drafts[b, :n]
            out[b, n] = inverse_cdf(p[b, n][None], u[n : n + 1])[0]
    return out


def test_greedy_all_accepted_gets_bonus() -> None:
    target = _one_hot([[5, 2, 7, 1]], vocab=8)  # argmax per row: 5, 2, 7 then bonus 1
    res = rejection_sample(target, torch.tensor([[5, 2, 7]]), None, [None])
    assert res.output_tokens.tolist() == [[5, 2, 7, 1]]
    assert res.num_accepted.tolist() == [3]


def test_greedy_first_rejected_emits_target_argmax() -> None:
    target = _one_hot([[4, 2, 7, 1], [5, 3, 7, 1]], vocab=8)
    res = rejection_sample(target, torch.tensor([[5, 2, 7], [5, 2, 7]]), None, [None, None])
    assert res.output_tokens.tolist() == [[4, -1, -1, -1], [5, 3, -1, -1]]
    assert res.num_accepted.tolist() == [0, 1]
    assert res.output_tokens.dtype == torch.long and res.num_accepted.dtype == torch.long


def test_greedy_ties_take_lowest_index_and_ignore_draft_probs() -> None:
    target = torch.tensor([[[0.4, 0.4, 0.2], [0.1, 0.1, 0.8]]])  # row 0: tie between 0 and 1
    draft_probs = torch.tensor([[[0.0, 1.0, 0.0]]])  # irrelevant to a greedy row
    res = rejection_sample(target, torch.tensor([[1]]), draft_probs, [None])
    assert res.output_tokens.tolist() == [[0, -1]]


def test_num_drafts_below_gamma_and_minus_one_padding() -> None:
    target = _one_hot([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6]], vocab=8)
    drafts = torch.tensor([[3, -1, -1], [3, 4, -1], [-1, -1, -1]])
    num_drafts = torch.tensor([1, 2, 0])
    res = rejection_sample(target, drafts, None, [None] * 3, num_drafts)
    # Row 0: 1 draft accepted, bonus from target row 1. Row 2: baseline (no drafts).
    assert res.output_tokens.tolist() == [[3, 4, -1, -1], [3, 4, 5, -1], [3, -1, -1, -1]]
    assert res.num_accepted.tolist() == [1, 2, 0]


def test_draft_beyond_num_drafts_is_ignored_even_if_correct() -> None:
    target = _one_hot([[3, 4, 5]], vocab=8)
    res = rejection_sample(target, torch.tensor([[3, 4]]), None, [None], torch.tensor([1]))
    assert res.output_tokens.tolist() == [[3, 4, -1]]  # 4 is the bonus, not an accepted draft
    assert res.num_accepted.tolist() == [1]


@pytest.mark.parametrize("dense_q", [True, False])
def test_random_rows_match_reference_transcription(dense_q: bool) -> None:
    bsz, gamma, vocab = 24, 3, 6
    p, q, drafts = _random_case(bsz, gamma, vocab, seed=11)
    num_drafts = torch.tensor([gamma, 2, 1, 0] * 6)
    seeds = [None if b % 5 == 0 else 100 + b for b in range(bsz)]  # mixed greedy/random
    q_in = q if dense_q else None
    for trial in range(5):
        seeds_t = [s if s is None else s + 1000 * trial for s in seeds]
        gens = [None if s is None else _gen(s) for s in seeds_t]
        res = rejection_sample(p, drafts, q_in, gens, num_drafts)
        ref = _reference(p, drafts, q_in, seeds_t, num_drafts)
        assert torch.equal(res.output_tokens, ref), f"trial {trial}:\n{res.output_tokens}\n{ref}"
        assert torch.equal(res.num_accepted, (ref >= 0).sum(-1) - 1)
    committed = (res.output_tokens >= 0).sum(-1)
    assert bool((committed <= num_drafts + 1).all()) and bool((committed >= 1).all())


def test_mixed_batch_rows_equal_rows_run_alone() -> None:
    bsz, gamma, vocab = 6, 4, 7
    p, q, drafts = _random_case(bsz, gamma, vocab, seed=3)
    num_drafts = torch.tensor([4, 3, 4, 0, 2, 4])
    seeds = [None, 1, 2, None, 4, 5]
    gens = [None if s is None else _gen(s) for s in seeds]
    batch = rejection_sample(p, drafts, q, gens, num_drafts)
    for b, s in enumerate(seeds):
        alone = rejection_sample(
            p[b : b + 1],
            drafts[b : b + 1],
            q[b : b + 1],
            [None if s is None else _gen(s)],
            num_drafts[b : b + 1],
        )
        assert torch.equal(batch.output_tokens[b], alone.output_tokens[0]), (
            f"row {b} depends on its batch"
        )


def test_seeded_rows_reproduce_and_consume_n_plus_one_uniforms() -> None:
    p, q, drafts = _random_case(4, 3, 5, seed=5)
    num_drafts = torch.tensor([3, 1, 0, 2])
    runs = []
    for _ in range(2):
        gens = [_gen(40 + b) for b in range(4)]
        runs.append(rejection_sample(p, drafts, q, gens, num_drafts).output_tokens)
        for b, g in enumerate(gens):  # each generator advanced by exactly n_b + 1 draws
            ref = _gen(40 + b)
            torch.rand(int(num_drafts[b]) + 1, generator=ref)
            assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref)), f"row {b}"
    assert torch.equal(runs[0], runs[1])
    # Seeds matter: over 64 rows two seed sets give different outputs (fixed seeds, deterministic).
    p, q, drafts = _random_case(64, 3, 5, seed=6)
    outs = [
        rejection_sample(p, drafts, q, [_gen(s + b) for b in range(64)]).output_tokens
        for s in (0, 500)
    ]
    assert not torch.equal(outs[0], outs[1])


def test_greedy_rows_consume_no_randomness() -> None:
    p, q, drafts = _random_case(2, 2, 5, seed=8)
    shared = _gen(9)
    rejection_sample(p, drafts, q, [None, None], None)
    rejection_sample(p, drafts, q, [None, shared], None)
    ref = _gen(9)
    torch.rand(3, generator=ref)  # only the random row's n + 1 = 3 draws
    assert torch.equal(torch.rand(2, generator=shared), torch.rand(2, generator=ref))


def test_p_at_least_q_always_accepts_and_p_zero_never_does() -> None:
    vocab, bsz = 4, 200
    p = torch.tensor([0.1, 0.6, 0.0, 0.3]).expand(bsz, 2, vocab).contiguous()
    q = torch.tensor([0.1, 0.3, 0.3, 0.3]).expand(bsz, 1, vocab).contiguous()
    gen = _gen(0)
    accept = rejection_sample(p, torch.full((bsz, 1), 1), q, [gen] * bsz)  # p(1)=0.6 >= q(1)=0.3
    assert accept.num_accepted.tolist() == [1] * bsz
    reject = rejection_sample(p, torch.full((bsz, 1), 2), q, [gen] * bsz)  # p(2) = 0
    assert reject.num_accepted.tolist() == [0] * bsz
    # Residual max(p - q, 0) = [0, 0.3, 0, 0]: the correction is always token 1.
    assert reject.output_tokens[:, 0].tolist() == [1] * bsz
    assert bool((reject.output_tokens[:, 1] == -1).all())


def test_deterministic_draft_one_hot_q_equals_dense_one_hot() -> None:
    p, _, drafts = _random_case(16, 3, 6, seed=21)
    dense = torch.nn.functional.one_hot(drafts, 6).float()
    a = rejection_sample(p, drafts, None, [_gen(b) for b in range(16)])
    b = rejection_sample(p, drafts, dense, [_gen(b) for b in range(16)])
    assert torch.equal(a.output_tokens, b.output_tokens)


def test_degenerate_residual_falls_back_to_p() -> None:
    # p == q and the drafted token 0 has p = q = 0: rejected, residual all zero.
    dist = torch.tensor([0.0, 0.0, 0.5, 0.5])
    p = dist.expand(500, 2, 4).contiguous()
    q = dist.expand(500, 1, 4).contiguous()
    res = rejection_sample(p, torch.zeros(500, 1, dtype=torch.long), q, [_gen(1)] * 500)
    first = res.output_tokens[:, 0]
    assert res.num_accepted.tolist() == [0] * 500
    assert set(first.tolist()) == {2, 3}, "fallback must sample from p's support"


def test_bad_inputs_raise_value_error() -> None:
    p = torch.full((2, 3, 4), 0.25)
    drafts = torch.tensor([[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="target_probs"):
        rejection_sample(p[:, :2], drafts, None, [None, None])
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, drafts, torch.full((2, 2, 5), 0.2), [None, None])
    with pytest.raises(ValueError, match="one generator"):
        rejection_sample(p, drafts, None, [None])
    with pytest.raises(ValueError, match="num_drafts"):
        rejection_sample(p, drafts, None, [None, None], torch.tensor([3, 0]))
    with pytest.raises(ValueError, match="outside"):
        rejection_sample(p, torch.tensor([[0, 4], [2, 3]]), None, [None, None])
    # -1 beyond num_drafts is fine.
    rejection_sample(p, torch.tensor([[0, -1], [2, 3]]), None, [None, None], torch.tensor([1, 2]))
