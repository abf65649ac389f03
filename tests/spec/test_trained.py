"""The trained dsv4_tiny shipped in the package: speculation is exact and real.

Greedy ``spec=mtp`` / ``spec=dspark`` output equals ``spec=none`` token for token on
held-out prompts, at several concurrencies; and the drafters are not noise: their greedy
acceptance on those prompts is far above what a random drafter gets (0 here)."""

from __future__ import annotations

import pytest

import xspec
from xspec.train import corpus

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return corpus.prompts(corpus.source_files(split="heldout"), 4, seed=11, max_chars=240)


@pytest.fixture(scope="module")
def baseline(prompts) -> list[list[int]]:
    llm = xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu")
    return [g.token_ids for g in llm.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True)]


@pytest.mark.parametrize(("spec", "min_tokens_per_step"), [("mtp", 1.5), ("dspark", 2.5)])
def test_greedy_equals_baseline_and_drafts_are_accepted(
    prompts, baseline, spec, min_tokens_per_step
) -> None:
    llm = xspec.LLM(model="dsv4_tiny", spec=spec, platform="cpu")
    for concurrency in (1, 4):
        out = llm.generate(
            prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, concurrency=concurrency
        )
        assert [g.token_ids for g in out] == baseline
    report = llm.metrics.report()
    assert report.mean_tokens_per_step >= min_tokens_per_step, report.format()


def test_tokenizer_is_the_trained_one(prompts) -> None:
    llm = xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu")
    ids = llm.tokenizer.encode(prompts[0])
    assert len(ids) < 0.6 * len(prompts[0].encode())  # BPE, not bytes
    assert llm.tokenizer.decode(ids) == prompts[0]
