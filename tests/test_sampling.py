"""SamplingParams, logits processing and seeded draws (xspec/sampling.py)."""

from __future__ import annotations

import math

import pytest
import torch

from xspec.errors import RequestError
from xspec.sampling import (
    SamplingParams,
    draw_uniforms,
    inverse_cdf,
    logits_to_probs,
    make_generator,
    regime_of,
    sample,
)

GREEDY = SamplingParams()


def _support(probs: torch.Tensor) -> list[list[int]]:
    """Token ids with nonzero probability, per row."""
    return [row.nonzero().flatten().tolist() for row in probs]


def test_greedy_rows_are_one_hot_at_argmax_with_lowest_index_ties() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0, 2.0], [3.0, 3.0, 3.0, 3.0], [-5.0, -4.0, -6.0, -4.5]])
    probs = logits_to_probs(logits, [GREEDY] * 3)
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected), probs


def test_low_precision_logits_give_float32_probs() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    probs = logits_to_probs(logits, [SamplingParams(temperature=1.0)])
    ref = torch.softmax(torch.tensor([[1.0, 2.0, 3.0]]), dim=-1)
    assert probs.dtype == torch.float32
    diff = (probs - ref).abs().max().item()
    assert diff < 1e-7, f"max abs diff {diff}"


def test_temperature_scales_logits_before_softmax() -> None:
    logits = torch.tensor([[1.0, 2.0, 4.0, 0.0]])
    for t in (0.5, 1.0, 2.0):
        probs = logits_to_probs(logits, [SamplingParams(temperature=t)])
        ref = torch.softmax(logits / t, dim=-1)
        diff = (probs - ref).abs().max().item()
        assert diff < 1e-7, f"temperature {t}: max abs diff {diff} (softmax runs in sorted order)"


def test_top_k_keeps_exactly_k_largest_ties_to_lowest_index() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, 2.0, -1.0, 2.0]])
    params = SamplingParams(temperature=1.0, top_k=3)
    probs = logits_to_probs(logits, [params])
    # 3.0 is first; of the three 2.0 ties the two lowest indices (2, 3) survive.
    assert _support(probs) == [[1, 2, 3]]
    ref = torch.softmax(torch.tensor([3.0, 2.0, 2.0]), dim=-1)
    diff = (probs[0, [1, 2, 3]] - ref).abs().max().item()
    assert diff < 1e-7, f"renormalised top-k mass: max abs diff {diff}"
    # top_k >= V keeps everything.
    all_kept = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_k=99)])
    diff = (all_kept - torch.softmax(logits, dim=-1)).abs().max().item()
    assert diff < 1e-7, f"top_k >= V: max abs diff {diff} (softmax runs in sorted order)"


def test_top_p_keeps_smallest_nucleus_reaching_top_p() -> None:
    # Probabilities exactly 0.5, 0.25, 0.125, 0.125 (log-probs as logits).
    logits = torch.tensor([[0.5, 0.125, 0.25, 0.125]]).log()
    cases = {0.5: [0], 0.5001: [0, 2], 0.75: [0, 2], 0.8: [0, 1, 2], 1.0: [0, 1, 2, 3], 1e-6: [0]}
    for top_p, support in cases.items():
        probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=top_p)])
        assert _support(probs) == [support], f"top_p={top_p}: {probs}"
        kept = torch.tensor([0.5, 0.125, 0.25, 0.125])[support]
        diff = (probs[0, support] - kept / kept.sum()).abs().max().item()
        assert diff < 1e-7, f"top_p={top_p}: max abs diff {diff}"


def test_top_p_applies_after_top_k() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # top-k 2 leaves 0.4/0.7, 0.3/0.7 = 0.571, 0.429; top_p 0.5 then keeps only token 0.
    probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_k=2, top_p=0.5)])
    assert torch.equal(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]])), probs
    # Without top-k, 0.4 < 0.5 so top_p 0.5 keeps tokens 0 and 1.
    probs = logits_to_probs(logits, [SamplingParams(temperature=1.0, top_p=0.5)])
    assert _support(probs) == [[0, 1]]


def test_mixed_rows_each_use_their_own_params() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]] * 4)
    params = [
        GREEDY,
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=0.9),
    ]
    probs = logits_to_probs(logits, params)
    for i, p in enumerate(params):
        alone = logits_to_probs(logits[i : i + 1], [p])
        assert torch.equal(probs[i : i + 1], alone), f"row {i} depends on its batch mates"
    assert torch.equal(probs[0], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert torch.equal(probs[2], torch.tensor([0.0, 0.0, 1.0, 0.0]))
    sums = probs.sum(dim=-1)
    assert (sums - 1).abs().max().item() < 1e-6, sums


def test_a_batch_without_greedy_rows_matches_each_row_alone() -> None:
    """Every row random (the batch of a sampled workload) takes the path that keeps no
    one-hot rows; each row is still what it is on its own, shared objects included."""
    logits = torch.randn(6, 9, generator=torch.Generator().manual_seed(4))
    shared = SamplingParams(temperature=0.8, top_k=4)
    params = [shared, SamplingParams(temperature=1.3), shared, SamplingParams(0.5, top_p=0.6)]
    params += [shared, SamplingParams(temperature=2.0, top_k=2, top_p=0.9)]
    probs = logits_to_probs(logits, params)
    for i, p in enumerate(params):
        assert torch.equal(probs[i : i + 1], logits_to_probs(logits[i : i + 1], [p])), i
        assert probs[i].tolist() == pytest.approx(_reference_probs(logits[i].tolist(), p), abs=1e-6)


def test_problems_name_each_bad_key() -> None:
    assert SamplingParams().problems() == []
    assert SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3).problems() == []
    bad = SamplingParams(temperature=-1.0, top_k=-2, top_p=0.0, seed=-5).problems()
    assert bad == [
        "sampling.temperature must be a finite number >= 0 (got -1.0); use 0 for greedy",
        "sampling.top_k must be an integer >= 0 (got -2); use 0 to disable top-k",
        "sampling.top_p must be in (0, 1] (got 0.0); use 1.0 to disable top-p",
        "sampling.seed must be null or an integer in [0, 2**64) (got -5)",
    ]
    assert SamplingParams(temperature=0.7).valid and not SamplingParams(top_k=-1).valid
    assert len(SamplingParams(temperature=math.nan, top_p=1.5).problems()) == 2
    assert len(SamplingParams(temperature=math.inf, top_k=2.5).problems()) == 2  # type: ignore[arg-type]


def test_logits_to_probs_rejects_invalid_params_with_row_numbers() -> None:
    logits = torch.zeros(2, 4)
    with pytest.raises(RequestError, match=r"row 1: sampling.top_p"):
        logits_to_probs(logits, [GREEDY, SamplingParams(temperature=1.0, top_p=2.0)])
    with pytest.raises(ValueError, match="2 logits rows but 1"):
        logits_to_probs(logits, [GREEDY])
    # one object on several rows (a verify block) is named on each of them
    bad = SamplingParams(temperature=-1.0)
    with pytest.raises(RequestError, match=r"row 0: .*\n.*row 2: sampling.temperature"):
        logits_to_probs(torch.zeros(3, 4), [bad, GREEDY, bad])


def test_greedy_property_and_generator() -> None:
    assert GREEDY.greedy and make_generator(GREEDY) is None
    params = SamplingParams(temperature=0.8, seed=1234)
    assert not params.greedy
    a, b = make_generator(params), make_generator(params)
    assert a is not None and b is not None
    assert torch.equal(torch.rand(8, generator=a), torch.rand(8, generator=b))
    assert make_generator(SamplingParams(temperature=1.0, seed=None)) is not None
    tiny = SamplingParams(temperature=1e-30, seed=1)  # would overflow logits / temperature
    assert tiny.greedy and make_generator(tiny) is None
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), [tiny])
    assert torch.equal(probs, torch.tensor([[0.0, 1.0, 0.0]])), probs


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    probs = torch.softmax(torch.randn(6, 50, generator=torch.Generator().manual_seed(0)), dim=-1)

    def run(seed: int) -> torch.Tensor:
        gens = [make_generator(SamplingParams(temperature=1.0, seed=seed + i)) for i in range(6)]
        return torch.stack([sample(probs, gens) for _ in range(20)])  # [20, 6]

    assert torch.equal(run(7), run(7))
    assert not torch.equal(run(7), run(8))


def test_sample_greedy_rows_take_argmax_and_consume_nothing() -> None:
    probs = logits_to_probs(
        torch.tensor([[0.0, 5.0, 1.0], [2.0, 1.0, 0.0]]), [GREEDY, SamplingParams(temperature=1.0)]
    )
    gen = torch.Generator().manual_seed(3)
    tokens = sample(probs, [None, gen])
    ref = torch.Generator().manual_seed(3)
    ref_token = inverse_cdf(probs[1:], torch.rand(1, generator=ref))
    assert tokens[0].item() == 1
    assert tokens[1].item() == ref_token.item()
    # Exactly one uniform was consumed from the random row's generator.
    assert torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=ref))
    with pytest.raises(ValueError, match="not one-hot"):
        sample(torch.full((1, 4), 0.25), [None])


def test_inverse_cdf_never_returns_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 6)
    u = torch.tensor([0.0, 0.25, 0.4999999, 0.5, 0.75, 0.99999994])
    assert inverse_cdf(probs, u).tolist() == [1, 1, 1, 3, 3, 3]
    # Unnormalised rows (verify residuals) are fine.
    assert inverse_cdf(torch.tensor([[0.0, 0.2, 0.2]]), torch.tensor([0.6])).tolist() == [2]


def test_sample_matches_distribution() -> None:
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).expand(40_000, 4)
    gen = torch.Generator().manual_seed(0)
    tokens = sample(probs, [gen] * probs.shape[0])  # one shared generator: one rand call
    freq = torch.bincount(tokens, minlength=4).double() / tokens.numel()
    diff = (freq - probs[0].double()).abs().max().item()
    assert freq[1].item() == 0.0
    assert diff < 0.01, f"max abs diff of frequencies {diff}"


def test_draw_uniforms_layout() -> None:
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    u = draw_uniforms([g1, None, g2, g1], [2, 0, 3, 1], torch.device("cpu"))
    r1 = torch.rand(3, generator=torch.Generator().manual_seed(1))  # rows 0 and 3 share g1
    r2 = torch.rand(3, generator=torch.Generator().manual_seed(2))
    assert u.shape == (4, 3)
    assert torch.equal(u[0, :2], r1[:2]) and torch.equal(u[3, :1], r1[2:])
    assert torch.equal(u[2], r2)
    assert u[1].abs().sum().item() == 0.0
    with pytest.raises(ValueError, match="no generator"):
        draw_uniforms([None], [1], torch.device("cpu"))


def test_draw_uniforms_one_generator_a_row_and_given_uniforms() -> None:
    """Each request its own generator (a served batch): row i holds its generator's next
    ``counts[i]`` draws, wherever the rows are full or not; ``sample(uniforms=...)`` is
    what ``sample`` draws itself."""
    seeds = [3, 4, 5]
    for counts in ([2, 2, 2], [2, 1, 0]):
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        u = draw_uniforms(gens, counts, torch.device("cpu"))
        assert u.shape == (3, 2)
        for i, (s, n) in enumerate(zip(seeds, counts)):
            ref = torch.Generator().manual_seed(s)
            assert torch.equal(u[i, :n], torch.rand(n, generator=ref)), (counts, i)
            assert not u[i, n:].any(), (counts, i)
            # it consumed exactly its own count
            assert torch.equal(torch.rand(3, generator=gens[i]), torch.rand(3, generator=ref))
    probs = torch.softmax(torch.randn(3, 7, generator=torch.Generator().manual_seed(1)), -1)
    probs[1] = torch.nn.functional.one_hot(torch.tensor(4), 7).float()
    drawn = sample(
        probs, [torch.Generator().manual_seed(8), None, torch.Generator().manual_seed(9)]
    )
    u = torch.tensor(
        [torch.rand(1, generator=torch.Generator().manual_seed(s)).item() for s in (8, 0, 9)]
    )
    assert torch.equal(
        sample(probs, [torch.Generator(), None, torch.Generator()], uniforms=u), drawn
    )
    with pytest.raises(ValueError, match="uniforms must be"):
        sample(probs, [torch.Generator(), None, torch.Generator()], uniforms=u[:2])


def _reference_probs(row: list[float], sp: SamplingParams) -> list[float]:
    """Plain-Python transcription of the processing rules for one row."""
    vocab = len(row)
    if sp.greedy:
        best = max(range(vocab), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    scaled = [x / sp.temperature for x in row]
    ranking = sorted(range(vocab), key=lambda i: (-scaled[i], i))  # ties -> lowest index first
    kept = ranking[: sp.top_k] if sp.top_k > 0 else ranking
    if sp.top_p < 1.0:
        top = max(scaled[i] for i in kept)
        weights = [math.exp(scaled[i] - top) for i in kept]
        total, mass, nucleus = sum(weights), 0.0, []
        for i, w in zip(kept, weights):
            if nucleus and mass >= sp.top_p:
                break
            nucleus.append(i)
            mass += w / total
        kept = nucleus
    top = max(scaled[i] for i in kept)
    weights = {i: math.exp(scaled[i] - top) for i in kept}
    total = sum(weights.values())
    return [weights.get(i, 0.0) / total for i in range(vocab)]


def test_processing_matches_plain_python_reference_with_many_ties() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 12
    # Small-integer logits: many exact ties at the top-k and top-p boundaries.
    logits = torch.randint(-3, 3, (96, vocab), generator=gen).float()
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t in (0.0, 0.5, 1.0, 2.0)
        for k in (0, 1, 3, 11)
        for p in (1.0, 0.3, 0.7)
    ]  # 48 combinations, each used twice
    params = params + params[::-1]
    probs = logits_to_probs(logits, params)
    for i, sp in enumerate(params):
        ref = torch.tensor(_reference_probs(logits[i].tolist(), sp))
        assert _support(probs[i : i + 1]) == _support(ref[None]), f"row {i} {sp}: support differs"
        diff = (probs[i] - ref).abs().max().item()
        assert diff < 1e-6, f"row {i} {sp}: max abs diff {diff}"


def test_nonfinite_rows() -> None:
    from xspec.sampling import nonfinite_rows

    logits = torch.tensor([[0.0, 1.0], [math.nan, 1.0], [2.0, math.inf], [-math.inf, 0.0]])
    assert nonfinite_rows(logits).tolist() == [False, True, True, True]


def test_the_sampling_regime_has_one_name_for_labels_and_for_messages() -> None:
    """One function names a regime: the short label (metrics, acceptance estimates) and
    the phrase a calibration file's messages use (its fitted regime, the requests')."""
    from xspec.spec.adaptive.calibration import ConfidenceCalibration

    cases = [
        (SamplingParams(top_k=5, top_p=0.9), "greedy", "greedy (temperature 0)"),
        (SamplingParams(temperature=0.8), "T=0.8", "temperature 0.8"),
        (
            SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
            "T=1,top_k=5,top_p=0.9",
            "temperature 1, top_k 5, top_p 0.9",
        ),
    ]
    for params, label, words in cases:
        assert regime_of(params) == label
        assert regime_of(params, words=True) == words
        fit = ConfidenceCalibration(
            [1.0], sampling_temperature=params.temperature, sampling_top_k=params.top_k
        )
        fit.sampling_top_p = params.top_p
        assert fit.fitted_regime() == words
