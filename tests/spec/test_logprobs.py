"""Logprobs from the verify forward's rows, equal to ``spec=none``'s.

The tokens (and the top alternatives' ids) are equal under speculation; by default the
values agree to the forward's row-count invariance (TOL, as
tests/models/deepseek_v4/test_chunking.py: BLAS blocks a verify block of n + 1 rows
differently from one row, ~1e-6 in fp32), and with ``platform.batch_invariant=true`` bit
for bit (xspec.models.invariant), also across batch compositions. Prompt logprobs are the
ones ``xspec.LLM.score`` gives, bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import xspec
from xspec.engine.engine import Generation
from xspec.sampling import TokenLogprob

TOL = 2e-5
PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
NEW = 24
KW: dict[str, Any] = dict(frequency_penalty=0.7, min_tokens=4, logit_bias={32: 2.0}, logprobs=5)


def trained(spec: str, model: str = "dsv4_tiny", **overrides: Any) -> xspec.LLM:
    overrides = {"model.dtype": "float32", **overrides}
    return xspec.LLM(model=model, spec=spec, platform="cpu", overrides=overrides)


def invariant(spec: str, model: str = "dsv4_tiny", **overrides: Any) -> xspec.LLM:
    return trained(spec, model, **{"platform.batch_invariant": True, **overrides})


@pytest.fixture(scope="module")
def none_llm() -> xspec.LLM:
    return trained("none")


@pytest.fixture(scope="module")
def baseline(none_llm: xspec.LLM) -> list[Generation]:
    return none_llm.generate(PROMPTS, NEW, **KW)


def assert_same(a: list[TokenLogprob], b: list[TokenLogprob]) -> None:
    assert [x.token for x in a] == [y.token for y in b]
    assert [[i for i, _ in x.top] for x in a] == [[i for i, _ in y.top] for y in b]
    diff = max(
        max(abs(x.logprob - y.logprob), *(abs(u - v) for (_, u), (_, v) in zip(x.top, y.top)))
        for x, y in zip(a, b)
    )
    assert diff <= TOL, f"max abs logprob diff {diff:.3g}"


@pytest.mark.parametrize("spec", ["mtp", "dspark"])
def test_greedy_logprobs_equal_spec_none(spec: str, baseline: list[Generation]) -> None:
    gens = trained(spec).generate(PROMPTS, NEW, **KW)
    assert sum(g.spec.num_accepted_tokens for g in gens) > 5
    for g, b in zip(gens, baseline):
        assert g.token_ids == b.token_ids
        assert g.logprobs is not None and b.logprobs is not None
        assert len(g.logprobs) == len(g.token_ids)
        assert_same(g.logprobs, b.logprobs)


def assert_bit_identical(gens: list[Generation], want: list[Generation]) -> None:
    for g, b in zip(gens, want, strict=True):
        assert g.token_ids == b.token_ids
        assert g.logprobs is not None and g.logprobs == b.logprobs  # values and top-k


@pytest.mark.parametrize(
    ("model", "spec", "adaptive"),
    [
        ("dsv4_tiny", "mtp", False),
        ("dsv4_tiny", "dspark", False),
        ("dsv4_tiny", "dspark", True),
        ("qwen3_tiny", "dspark", False),
        ("qwen3_tiny", "dflash", False),
    ],
)
def test_batch_invariant_logprobs_are_spec_none_s_bit_for_bit(
    model: str, spec: str, adaptive: bool
) -> None:
    want = invariant("none", model).generate(PROMPTS, NEW, **KW)
    llm = invariant(spec, model, **{"spec.adaptive": adaptive})
    gens = llm.generate(PROMPTS, NEW, **KW)
    # its rows came from multi-row verify forwards (the untrained qwen3_tiny drafters'
    # drafts are rejected: there the values checked are the bonus rows')
    assert all(g.spec.num_drafts > 0 for g in gens)
    assert_bit_identical(gens, want)


def test_batch_invariant_logprobs_do_not_depend_on_the_batch() -> None:
    """One request alone and beside two others (rows of other lengths in its forwards)."""
    llm = invariant("dspark")
    alone = llm.generate(PROMPTS[:1], NEW, **KW)
    batched = llm.generate([PROMPTS[0], "import os\nimport sys\n", "Once upon"], NEW, **KW)
    assert_bit_identical(batched[:1], alone)


def test_raw_logprobs_are_the_model_s_and_processed_ones_what_it_samples(
    none_llm: xspec.LLM, baseline: list[Generation]
) -> None:
    gen = baseline[0]
    ids = none_llm.tokenizer.encode(PROMPTS[0]) + gen.token_ids
    lp = torch.log_softmax(none_llm.score(ids), dim=-1)  # [T, V] teacher-forced
    n = len(ids) - len(gen.token_ids)
    assert gen.logprobs is not None
    for k, x in enumerate(gen.logprobs):
        assert abs(x.logprob - lp[n - 1 + k, x.token].item()) <= TOL
        top = lp[n - 1 + k].topk(5)
        assert [i for i, _ in x.top] == top.indices.tolist()
    # greedy, processed: the argmax of the processed logits is the chosen token
    processed = none_llm.generate(PROMPTS[:1], NEW, **{**KW, "logprobs_mode": "processed"})[0]
    assert processed.token_ids == gen.token_ids and processed.logprobs is not None
    assert all(x.top[0][0] == x.token for x in processed.logprobs)
    assert processed.logprobs[0].logprob != gen.logprobs[0].logprob  # the bias shows
    # sampled, processed: the log of the distribution sampled from (top_k 3: 3 finite)
    sampled = none_llm.generate(
        PROMPTS[:1], 8, temperature=0.8, top_k=3, logprobs=4, logprobs_mode="processed"
    )[0]
    assert sampled.logprobs is not None
    for x in sampled.logprobs:
        probs = torch.tensor([v for _, v in x.top]).exp()
        assert x.top[3][1] == float("-inf") and abs(probs[:3].sum().item() - 1) < 1e-5


def test_prompt_logprobs_equal_score(none_llm: xspec.LLM) -> None:
    ids = none_llm.tokenizer.encode(PROMPTS[1])
    gen = none_llm.generate([ids], 1, prompt_logprobs=2)[0]
    lp = torch.log_softmax(none_llm.score(ids), dim=-1)
    assert gen.prompt_logprobs is not None and gen.prompt_logprobs[0] is None
    got = [x.logprob for x in gen.prompt_logprobs[1:] if x is not None]
    assert got == [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert gen.logprobs is None  # not asked for


def test_streamed_deltas_carry_their_tokens_logprobs(none_llm: xspec.LLM) -> None:
    llm = trained("mtp")
    streamed: list[TokenLogprob] = []
    final = None
    for delta in llm.generate(PROMPTS[:1], NEW, stream=True, **KW):
        assert delta.logprobs is not None and len(delta.logprobs) == len(delta.token_ids)
        streamed += delta.logprobs
        final = delta.generation
    assert final is not None and final.logprobs == streamed
