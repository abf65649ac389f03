"""The rejection sampler preserves the target distribution (chi-square, fixed seeds).

Each case draws N = 1e5 verify rows in ONE ``rejection_sample`` call whose rows share
one generator, drafts d ~ q, and checks the emitted tokens against p with a Pearson
chi-square test at significance 0.001. Critical values are hard-coded (scipy is not a
dependency; ``test_critical_values_match_scipy`` checks them when scipy is installed).
Seeds are fixed, so every test is deterministic. A token with p = 0 must never appear.

The negative control runs the non-exact "selected-only" sampler some engines use (keep
only q(d) and, on rejection, resample p with d zeroed) on an adversarial pair and
checks that the same test rejects it, so these tests can fail.
"""

from __future__ import annotations

import pytest
import torch

from xspec.sampling import SamplingParams, logits_to_probs
from xspec.spec.verify import rejection_sample

N = 100_000

# Upper 0.001 quantiles of chi-square, dof 1..63 (scipy.stats.chi2.isf(0.001, dof)).
CHI2_CRIT_0001 = [
    10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
    31.264, 32.909, 34.528, 36.123, 37.697, 39.252, 40.79, 42.312, 43.82, 45.315,
    46.797, 48.268, 49.728, 51.179, 52.62, 54.052, 55.476, 56.892, 58.301, 59.703,
    61.098, 62.487, 63.87, 65.247, 66.619, 67.985, 69.346, 70.703, 72.055, 73.402,
    74.745, 76.084, 77.419, 78.75, 80.077, 81.4, 82.72, 84.037, 85.351, 86.661,
    87.968, 89.272, 90.573, 91.872, 93.168, 94.461, 95.751, 97.039, 98.324, 99.607,
    100.888, 102.166, 103.442,
]  # fmt: skip


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic of samples tokens [M] against probs [V]; returns (stat, dof).

    Fails outright if a zero-probability token was sampled (that is never noise).
    Every token with p > 0 is a cell; rare ones are pooled, see below.
    """
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()  # [V]
    probs = probs.double()
    impossible = (probs == 0) & (counts > 0)
    assert not bool(impossible.any()), (
        f"sampled p=0 tokens {impossible.nonzero().flatten().tolist()}"
    )
    support = probs > 0
    observed, expected = counts[support], probs[support] * tokens.numel()
    # Cells expecting < 5 samples break the chi-square approximation: pool them into one
    # cell (and that cell into the smallest other one if it is still < 5).
    small = expected < 5
    if bool(small.any()):
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        if expected[-1] < 5 and expected.numel() > 1:
            j = int(expected[:-1].argmin())
            observed[j] += observed[-1]
            expected[j] += expected[-1]
            observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, expected.numel() - 1


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor, what: str) -> float:
    """Assert tokens [M] ~ probs [V]; returns the statistic for the caller's messages."""
    stat, dof = chi_square(tokens, probs)
    if dof == 0:
        return stat  # one-token support: the p=0 check above is the whole test
    freq = torch.bincount(tokens, minlength=probs.shape[0]).double() / tokens.numel()
    diff = (freq - probs.double()).abs().max().item()
    crit = CHI2_CRIT_0001[dof - 1]
    assert stat < crit, (
        f"{what}: chi2={stat:.1f} >= {crit} (dof {dof}); max abs freq diff {diff:.4f}"
    )
    return stat


def run_gamma1(p: torch.Tensor, q: torch.Tensor, seed: int, dense_q: bool = True) -> torch.Tensor:
    """N rows of one verify step with gamma = 1, drafts d ~ q: first emitted token [N]."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)[:, None]  # [N, 1]
    target = p.expand(N, 2, p.shape[0])  # rows 0 and 1 of the target are both p (bonus too)
    draft_probs = q.expand(N, 1, q.shape[0]) if dense_q else None
    res = rejection_sample(target, drafts, draft_probs, [gen] * N)
    return res.output_tokens[:, 0]


def _dist(values: list[float]) -> torch.Tensor:
    t = torch.tensor(values)
    return t / t.sum()


def _random_dist(vocab: int, seed: int, scale: float = 1.5) -> torch.Tensor:
    return torch.softmax(
        scale * torch.randn(vocab, generator=torch.Generator().manual_seed(seed)), dim=-1
    )


CASES = {
    "equal": (_random_dist(6, 1), _random_dist(6, 1)),
    "disjoint_supports": (_dist([0.5, 0.3, 0.2, 0, 0, 0]), _dist([0, 0, 0, 0.2, 0.3, 0.5])),
    "one_hot_q": (_dist([0.1, 0.2, 0.3, 0.4]), _dist([0, 0, 1, 0])),
    "q_zero_where_p_positive": (_dist([0.3, 0.3, 0.2, 0.2]), _dist([0.5, 0.5, 0, 0])),
    "q_puts_mass_on_p_zero": (_dist([0.2, 0.3, 0.5, 0]), _dist([0.6, 0.2, 0.1, 0.1])),
    "p_one_hot": (_dist([0, 0, 0, 1, 0]), _random_dist(5, 2)),
    "random_v8": (_random_dist(8, 3), _random_dist(8, 4)),
    "random_peaked_v8": (_random_dist(8, 5, scale=3.0), _random_dist(8, 6, scale=3.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_first_token_follows_target(name: str) -> None:
    p, q = CASES[name]
    tokens = run_gamma1(p, q, seed=list(CASES).index(name) + 7)
    assert_follows(tokens, p, name)
    if name == "p_one_hot":
        assert bool((tokens == 3).all())


def test_deterministic_drafts_follow_target() -> None:
    """draft_probs=None (one-hot q at whatever the drafter chose) is exact for any drafts."""
    p = _dist([0.1, 0.4, 0.2, 0.3, 0.0])
    for seed, drafter in enumerate([_dist([0, 0, 0, 0, 1]), _dist([0.7, 0.1, 0.1, 0.1, 0]), p]):
        assert_follows(run_gamma1(p, drafter, seed=seed, dense_q=False), p, f"drafter {seed}")


def test_processed_distributions_follow_target() -> None:
    """Target and draft logits through the same top-k / top-p / temperature processing."""
    gen = torch.Generator().manual_seed(12)
    logits = 2 * torch.randn(2, 8, generator=gen)  # row 0 target, row 1 draft
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=0)
    p, q = logits_to_probs(logits, [params, params])
    assert_follows(run_gamma1(p, q, seed=13), p, "top-k/top-p processed")


def test_negative_control_selected_only_sampler_fails() -> None:
    """Sparse q (only q(d) kept): on rejection p(d) < q(d), so max(p - q_sparse, 0) is
    exactly p with d zeroed, the selected-only resampling. It is not exact."""
    p, q = CASES["q_puts_mass_on_p_zero"]
    gen = torch.Generator().manual_seed(99)
    drafts = torch.multinomial(q, N, replacement=True, generator=gen)[:, None]  # [N, 1]
    # [N, 1, V]: q(d) at the drafted token, zeros elsewhere (xLLM's re-densified probs)
    sparse_q = torch.zeros(N, 1, 4).scatter_(2, drafts[..., None], q[drafts][..., None])
    res = rejection_sample(p.expand(N, 2, 4), drafts, sparse_q, [gen] * N)
    stat, dof = chi_square(res.output_tokens[:, 0], p)
    assert stat > 10 * CHI2_CRIT_0001[dof - 1], (
        f"negative control passed: chi2={stat:.1f} (dof {dof})"
    )
    # The exact sampler with the same seed passes on the same pair.
    assert_follows(run_gamma1(p, q, seed=99), p, "exact sampler on the control pair")


def test_gamma2_tokens_follow_target_conditionally() -> None:
    """gamma = 2 with context-dependent target and draft distributions (Markov tables).

    x1 ~ p_1; given d_1 accepted and x1 = t, x2 ~ P2[t]; given both accepted and x2 = s,
    the bonus x3 ~ P3[s]. A quarter of the rows carry one draft only (num_drafts = 1),
    whose x2 is the bonus from P2[x1].
    """
    vocab, gen = 5, torch.Generator().manual_seed(2024)
    p1, q1 = _random_dist(vocab, 30), _random_dist(vocab, 31)
    tables = torch.softmax(1.5 * torch.randn(3, vocab, vocab, generator=gen), dim=-1)
    p2_table, q2_table, p3_table = tables  # [V, V] each: row = previous token
    d1 = torch.multinomial(q1, N, replacement=True, generator=gen)  # [N]
    d2 = torch.multinomial(q2_table[d1], 1, generator=gen)[:, 0]  # [N] drawn given d1
    drafts = torch.stack([d1, d2], dim=1)  # [N, 2]
    target = torch.stack([p1.expand(N, vocab), p2_table[d1], p3_table[d2]], dim=1)  # [N, 3, V]
    draft_probs = torch.stack([q1.expand(N, vocab), q2_table[d1]], dim=1)  # [N, 2, V]
    num_drafts = torch.where(torch.arange(N) % 4 == 0, 1, 2)  # [N]
    out = rejection_sample(target, drafts, draft_probs, [gen] * N, num_drafts).output_tokens

    assert_follows(out[:, 0], p1, "x1")
    stat, dof = 0.0, 0
    for t in range(vocab):
        rows = (out[:, 1] >= 0) & (out[:, 0] == t)  # first token accepted and equal to t
        s, k = chi_square(out[rows, 1], p2_table[t])
        stat, dof = stat + s, dof + k
    assert stat < CHI2_CRIT_0001[dof - 1], f"x2 | x1: chi2={stat:.1f} (dof {dof})"
    stat, dof = 0.0, 0
    for s_tok in range(vocab):
        rows = (out[:, 2] >= 0) & (out[:, 1] == s_tok)
        s, k = chi_square(out[rows, 2], p3_table[s_tok])
        stat, dof = stat + s, dof + k
    assert dof > 0 and stat < CHI2_CRIT_0001[dof - 1], f"bonus x3 | x2: chi2={stat:.1f} (dof {dof})"


def test_critical_values_match_scipy() -> None:
    chi2 = pytest.importorskip("scipy.stats").chi2
    for dof, crit in enumerate(CHI2_CRIT_0001, start=1):
        assert abs(chi2.isf(0.001, dof) - crit) < 1e-3, f"dof {dof}"
