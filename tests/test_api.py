"""The Python API and the speculative machinery on the Qwen3 tiny preset (fast)."""

from __future__ import annotations

import pytest
import torch

import xspec
from xspec.errors import RequestError

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [300, 7]]


@pytest.fixture(scope="module")
def base() -> xspec.LLM:
    return xspec.LLM(
        model="qwen3_tiny", spec="none", platform="cpu", overrides={"model.dtype": "float32"}
    )


def test_generate_ids_and_text(base: xspec.LLM) -> None:
    outs = base.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert all(o.ttft_s > 0 and o.latency_s >= o.ttft_s and o.tpot_s > 0 for o in outs)
    assert outs[0].prompt_ids == PROMPTS[0]  # ids used exactly as given: no BOS added
    text = base.generate("hello", max_new_tokens=4, ignore_eos=True)[0]
    assert isinstance(text.text, str) and len(text.token_ids) == 4


def test_batched_equals_single(base: xspec.LLM) -> None:
    batched = base.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    single = [base.generate([p], max_new_tokens=10, ignore_eos=True)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    # concurrency 1: continuous batching admits one at a time, same tokens
    serial = base.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, concurrency=1)
    assert [o.token_ids for o in serial] == [o.token_ids for o in batched]


def test_score_matches_greedy(base: xspec.LLM) -> None:
    out = base.generate([PROMPTS[1]], max_new_tokens=6, ignore_eos=True)[0]
    logits = base.score(PROMPTS[1] + out.token_ids[:-1])  # [T, V]
    greedy = logits[len(PROMPTS[1]) - 1 :].argmax(-1).tolist()
    assert greedy == out.token_ids


def test_seeded_sampling_reproducible(base: xspec.LLM) -> None:
    a = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
    )
    b = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
    )
    c = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True
    )
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


@pytest.mark.parametrize(
    ("prompt", "kwargs", "needle"),
    [
        ([], {}, "empty prompt"),
        ("", {}, "empty prompt"),
        ([1, 2, 100000], {}, "outside the vocabulary"),
        ([-1], {}, "outside the vocabulary"),
        ([1] * 5000, {}, "exceeds the model context"),
        ([1, 2], {"max_new_tokens": 0}, "max_new_tokens"),
        ([1, 2], {"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_requests(base: xspec.LLM, prompt: object, kwargs: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=needle):
        base.generate([prompt], **kwargs)


@pytest.mark.parametrize("gamma", [1, 3])
def test_oracle_and_wrong_drafters(base: xspec.LLM, gamma: int) -> None:
    # 17 = 1 (prefill) + 16, a multiple of gamma + 1: the oracle fills every block
    ref = base.generate(PROMPTS, max_new_tokens=17, ignore_eos=True)
    for method, rate in (("oracle", 1.0), ("wrong", 0.0)):
        llm = xspec.LLM(
            model="qwen3_tiny",
            spec=method,
            platform="cpu",
            overrides={"spec.num_speculative_tokens": gamma},
        )
        outs = llm.generate(PROMPTS, max_new_tokens=17, ignore_eos=True)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], method
        rep = llm.metrics.report()
        assert rep.acceptance_rate == pytest.approx(rate), method
        expected_per_step = gamma + 1 if rate == 1.0 else 1
        assert rep.mean_tokens_per_step == pytest.approx(expected_per_step), method


def test_score_shape(base: xspec.LLM) -> None:
    logits = base.score([1, 2, 3])
    assert logits.shape == (3, base._built.target.vocab_size) and logits.dtype == torch.float32


def test_continuous_batching_with_staggered_finishes(base: xspec.LLM) -> None:
    """Requests finishing at different steps free their slot for a waiting one; the
    sequences still running while a newcomer is prefilled must not repeat a token."""
    from xspec.engine.engine import Request
    from xspec.sampling import SamplingParams

    lengths = [3, 11, 5, 8]
    requests = [  # sampled (seeded per request): the random tiny model repeats tokens under greedy
        Request(PROMPTS[i % 3], n, SamplingParams(temperature=1.0, seed=i), ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    staggered = base._built.engine.run(requests, concurrency=2)
    alone = [base._built.engine.run([r], concurrency=1)[0] for r in requests]
    assert [len(g.token_ids) for g in staggered] == lengths
    assert [g.token_ids for g in staggered] == [g.token_ids for g in alone]
