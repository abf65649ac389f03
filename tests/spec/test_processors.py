"""Logits processors under speculation: each verify row sees its own history.

Penalties, ``logit_bias`` and ``min_tokens`` change the next token's distribution with the
tokens before it. Greedy outputs with ``spec=mtp`` / ``spec=dspark`` (fixed and adaptive)
equal ``spec=none``'s token for token (the trained tiny DeepSeek-V4 in fp32, whose drafts
are accepted, so the rows after accepted drafts decide tokens); sampled outputs follow
the processed target distribution conditionally on the drafts before them (chi-square,
gamma = 2), and a verifier that forgets the drafts in the counts fails the same test.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import xspec
from tests.spec.test_verify_stats import CHI2_CRIT_0001, N, assert_follows, chi_square
from xspec.engine.engine import Request
from xspec.errors import RequestError
from xspec.sampling import SamplingParams, logits_to_probs
from xspec.spec.processors import DraftProcessors, Processors, process_rows
from xspec.spec.verify import rejection_sample

VOCAB = 5
PROMPT = [0, 3]
ANCHOR = 1  # the one token generated so far
STOP = frozenset({4})

PROCESSORS = {
    "presence": SamplingParams(temperature=0.9, presence_penalty=1.5),
    "frequency": SamplingParams(temperature=0.9, frequency_penalty=1.2, presence_penalty=0.4),
    "repetition": SamplingParams(temperature=0.9, repetition_penalty=2.5),
    "bias_min_tokens": SamplingParams(
        temperature=0.9, logit_bias=((2, 1.5), (4, 2.0)), min_tokens=2, frequency_penalty=1.0
    ),
}


def critical(dof: int) -> float:
    """The upper 0.001 quantile of chi-square: the table, then Wilson-Hilferty beyond it
    (within 0.3% of scipy's at dof 64..500)."""
    if dof <= len(CHI2_CRIT_0001):
        return CHI2_CRIT_0001[dof - 1]
    a = 2 / (9 * dof)
    return dof * (1 - a + 3.0902 * math.sqrt(a)) ** 3


def reference(logits: torch.Tensor, out: list[int], params: SamplingParams) -> torch.Tensor:
    """The distribution without speculation, written out: ``logits [V]`` after the output
    ``out`` (the prompt is PROMPT) -> probs [V]."""
    x = logits.double().clone()
    for t, b in params.logit_bias:
        x[t] += b
    if len(out) < params.min_tokens:
        for t in STOP:
            x[t] = float("-inf")
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).double()
    for t in set(PROMPT) | set(out):
        if params.repetition_penalty != 1.0:
            r = params.repetition_penalty
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    x = x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()
    return torch.softmax(x / params.temperature, dim=-1).float()


def processed_tables(
    params: SamplingParams, tables: torch.Tensor, rows: Callable[..., torch.Tensor]
) -> torch.Tensor:
    """The target's processed distributions of the verify rows for every pair of drafts:
    ``tables [3, V, V]`` raw logits (row 0 after the anchor, row 1 after d_1, row 2 after
    d_2) -> ``[V, V, 3, V]`` probs indexed by (d_1, d_2)."""
    out = torch.empty(VOCAB, VOCAB, 3, VOCAB)
    for d1 in range(VOCAB):
        for d2 in range(VOCAB):
            raw = torch.stack([tables[0, ANCHOR], tables[1, d1], tables[2, d2]])  # [3, V]
            logits = rows(params, raw, torch.tensor([d1, d2]))
            out[d1, d2] = logits_to_probs(logits, [params] * 3)
    return out


def exact_rows(params: SamplingParams, raw: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The step's processing: one sequence's three rows after the drafts."""
    proc = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
    return process_rows(raw, [proc], [3], drafts[None], [[*PROMPT, ANCHOR]])


def forgetful_rows(params: SamplingParams, raw: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """A verifier that forgets the drafts: every row sees the committed history only."""
    proc = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
    no_drafts = torch.empty(3, 0, dtype=torch.long)
    return process_rows(raw, [proc] * 3, [1, 1, 1], no_drafts, [[*PROMPT, ANCHOR]] * 3)


def run_verify(params: SamplingParams, rows: Callable[..., torch.Tensor], seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    tables = 1.5 * torch.randn(3, VOCAB, VOCAB, generator=gen)  # raw target logits
    q1 = torch.softmax(torch.randn(VOCAB, generator=gen), -1)
    q2_table = torch.softmax(torch.randn(VOCAB, VOCAB, generator=gen), -1)
    d1 = torch.multinomial(q1, N, replacement=True, generator=gen)  # [N]
    d2 = torch.multinomial(q2_table[d1], 1, generator=gen)[:, 0]  # [N]
    p = processed_tables(params, tables, rows)[d1, d2]  # [N, 3, V]
    q = torch.stack([q1.expand(N, VOCAB), q2_table[d1]], dim=1)  # [N, 2, V]
    out = rejection_sample(p, torch.stack([d1, d2], 1), q, [gen] * N).output_tokens
    return out, tables


def conditional_stat(out: torch.Tensor, tables: torch.Tensor, params: SamplingParams) -> tuple:
    """Chi-square of x2 given x1 and of x3 given (x1, x2) against the reference."""
    stat, dof = 0.0, 0
    out1 = [ANCHOR]  # the committed output
    for t in range(VOCAB):
        rows = (out[:, 1] >= 0) & (out[:, 0] == t)
        if rows.sum() < 50:
            continue
        s, k = chi_square(out[rows, 1], reference(tables[1, t], [*out1, t], params))
        stat, dof = stat + s, dof + k
        for u in range(VOCAB):
            rows2 = rows & (out[:, 2] >= 0) & (out[:, 1] == u)
            if rows2.sum() < 50:
                continue
            s, k = chi_square(out[rows2, 2], reference(tables[2, u], [*out1, t, u], params))
            stat, dof = stat + s, dof + k
    return stat, dof


@pytest.mark.parametrize("name", list(PROCESSORS))
def test_sampled_rows_follow_the_processed_target(name: str) -> None:
    params = PROCESSORS[name]
    out, tables = run_verify(params, exact_rows, seed=list(PROCESSORS).index(name))
    assert_follows(out[:, 0], reference(tables[0, ANCHOR], [ANCHOR], params), f"{name}: x1")
    stat, dof = conditional_stat(out, tables, params)
    assert dof > 10 and stat < critical(dof), f"{name}: later positions chi2={stat:.1f} (dof {dof})"


def test_negative_control_a_verifier_that_forgets_the_drafts_fails() -> None:
    params = PROCESSORS["frequency"]
    out, tables = run_verify(params, forgetful_rows, seed=1)
    stat, dof = conditional_stat(out, tables, params)
    assert stat > 10 * critical(dof), f"negative control passed: chi2={stat:.1f} (dof {dof})"


def test_row_counts_include_the_drafts_before_each_row() -> None:
    """Row j of a verify block equals the row computed alone with the drafts 1..j
    committed (bit for bit), for every processor at once."""
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.7,
        logit_bias=((3, -2.0),),
        min_tokens=3,
    )
    raw = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    drafts = torch.tensor([2, 2, 4])
    proc = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
    block = process_rows(raw, [proc], [4], drafts[None], [[*PROMPT, ANCHOR]])
    for j in range(4):
        alone = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
        history = [*PROMPT, ANCHOR, *drafts[:j].tolist()]
        row = process_rows(
            raw[j : j + 1], [alone], [1], torch.empty(1, 0, dtype=torch.long), [history]
        )
        assert torch.equal(block[j], row[0]), j
    assert torch.isinf(block[:2, 4]).all() and torch.isfinite(block[2:, 4]).all()  # min_tokens


# -- end to end: greedy outputs equal spec=none, bit for bit ---------------------------------

E2E_PROMPTS = ["The quick brown fox", "def fibonacci(n):"]
E2E_NEW = 24
E2E_KW: dict[str, Any] = dict(
    frequency_penalty=0.7,
    presence_penalty=0.3,
    repetition_penalty=1.3,
    logit_bias={32: 3.0, 101: -5.0},
    min_tokens=6,
)
FP32 = {"model.dtype": "float32"}


def trained(spec: str, **overrides: Any) -> xspec.LLM:
    return xspec.LLM(model="dsv4_tiny", spec=spec, platform="cpu", overrides={**FP32, **overrides})


@pytest.fixture(scope="module")
def e2e_baseline() -> list[list[int]]:
    return [g.token_ids for g in trained("none").generate(E2E_PROMPTS, E2E_NEW, **E2E_KW)]


@pytest.mark.parametrize("spec", ["mtp", "dspark"])
def test_greedy_with_processors_equals_spec_none(spec: str, e2e_baseline: list[list[int]]) -> None:
    llm = trained(spec)
    gens = llm.generate(E2E_PROMPTS, E2E_NEW, **E2E_KW)
    assert [g.token_ids for g in gens] == e2e_baseline
    assert (
        sum(g.spec.num_accepted_tokens for g in gens) > 5
    )  # rows after accepted drafts decided tokens
    plain = llm.generate(E2E_PROMPTS, E2E_NEW)
    assert [g.token_ids for g in plain] != e2e_baseline  # the processors changed the output


@pytest.mark.slow
def test_greedy_with_processors_equals_spec_none_adaptive(e2e_baseline: list[list[int]]) -> None:
    llm = trained(
        "dspark",
        **{"spec.adaptive": True, "spec.adaptive.max_requests": 4, "spec.adaptive.profile_reps": 1},
    )
    assert [g.token_ids for g in llm.generate(E2E_PROMPTS, E2E_NEW, **E2E_KW)] == e2e_baseline


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_min_tokens_masks_the_stop_ids_until_reached(spec: str) -> None:
    llm = trained(spec)
    eos = min(llm.engine.stop_ids)
    bias = {eos: 100.0}  # EOS wherever it is allowed
    first = llm.generate(E2E_PROMPTS[:1], 16, logit_bias=bias)[0]
    assert first.token_ids == [eos] and first.finish_reason == "stop"
    gen = llm.generate(E2E_PROMPTS[:1], 16, logit_bias=bias, min_tokens=5)[0]
    assert len(gen.token_ids) == 6 and gen.token_ids[-1] == eos and eos not in gen.token_ids[:5]
    # a request's stop_token_ids are masked as well (vLLM's min_tokens)
    stop_id = 40
    prompt = llm.tokenizer.encode(E2E_PROMPTS[0])
    req = Request(prompt, 16, SamplingParams(logit_bias=((stop_id, 100.0),), min_tokens=4),
                  ignore_eos=True, stop_token_ids=frozenset({stop_id}))  # fmt: skip
    out = llm.engine.run([req], 1)[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == stop_id
    assert stop_id not in out.token_ids[:4]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a number in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 10]"),
        ({"logit_bias": {5: 101}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": [5]}, "logit_bias must be a mapping"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias names token ids outside the vocabulary"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0"),
        ({"min_tokens": 9}, "min_tokens (9) must be <= max_new_tokens (8)"),
        ({"logprobs": 21}, "logprobs must be null or an integer in [0, 20]"),
        ({"logprobs_mode": "logits"}, "logprobs_mode must be one of raw, processed"),
    ],
)
def test_bad_processor_arguments_are_request_errors(kwargs: dict, message: str) -> None:
    llm = _tiny_random()
    with pytest.raises(RequestError, match=re.escape(message)):
        llm.generate([[1, 2, 3]], 8, **kwargs)


_LLM: dict[str, xspec.LLM] = {}


def _tiny_random() -> xspec.LLM:
    if "llm" not in _LLM:
        _LLM["llm"] = xspec.LLM(model="dsv4_tiny_random", spec="none", platform="cpu")
    return _LLM["llm"]


def test_seeded_keeps_every_field() -> None:
    from xspec.engine.engine import seeded

    params = dataclasses.replace(PROCESSORS["bias_min_tokens"], seed=5, logprobs=3)
    assert seeded(params, 2) == dataclasses.replace(params, seed=7)


# -- the drafter proposes under the processors ------------------------------------------------

PENALTIES: dict[str, Any] = dict(
    presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
)


@pytest.mark.parametrize("spec", ["mtp", "dspark"])
def test_drafts_under_the_processors_are_accepted_more(spec: str) -> None:
    """Greedy, with penalties: drafts proposed under the request's processors are accepted
    more often than drafts proposed without them, and the outputs are the same."""
    llm = trained(spec)
    drafter = llm.engine.drafter
    assert drafter.process_drafts

    def run() -> tuple[list[list[int]], int]:
        gens = llm.generate(E2E_PROMPTS, 48, **PENALTIES)
        return [g.token_ids for g in gens], sum(g.spec.num_accepted_tokens for g in gens)

    tokens, accepted = run()
    drafter.process_drafts = False
    try:
        tokens_off, accepted_off = run()
    finally:
        drafter.process_drafts = True
    assert tokens == tokens_off
    assert accepted > accepted_off, (accepted, accepted_off)  # mtp 27 vs 22, dspark 58 vs 40


def test_draft_processors_count_the_drafts_before_each_position() -> None:
    """Position k of a proposal is processed as the verify row k of the same drafts (bit
    for bit); requests without processors keep their raw logits."""
    params = SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.7,
        logit_bias=((3, -2.0),),
        min_tokens=3,
    )
    raw = torch.randn(4, 2, VOCAB, generator=torch.Generator().manual_seed(4))  # [G, B, V]
    drafts = torch.tensor([[2, 0], [2, 1], [4, 4], [1, 1]])  # [G, B]
    history = [*PROMPT, ANCHOR]
    proc = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
    proc.catch_up(history)
    draft = DraftProcessors.of([proc, None])
    assert draft is not None and DraftProcessors.of([None, None]) is None
    rows = []
    for k in range(4):
        out = draft.logits(raw[k])
        assert torch.equal(out[1], raw[k, 1])
        rows.append(out[0])
        draft.push(drafts[k])
    verify = Processors(params, PROMPT, STOP, VOCAB, torch.device("cpu"))
    block = process_rows(raw[:, 0], [verify], [4], drafts[None, :3, 0], [history])
    assert torch.equal(torch.stack(rows), block)
    assert torch.equal(proc.counts, verify.counts)  # the request's own counts untouched
