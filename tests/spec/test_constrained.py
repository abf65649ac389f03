"""Speculation under a grammar is exact: greedy outputs equal ``spec=none``'s with the same
grammar for every drafter, sampled outputs follow the masked target (chi-square, with a
negative control that must fail), and forced tokens are drafted without the drafter."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

import xspec
from tests.spec.test_verify_stats import assert_follows
from xspec.engine.engine import Request
from xspec.grammar import Constraint, GrammarCompiler, GrammarSpec
from xspec.sampling import SamplingParams, logits_to_probs, sample
from xspec.spec.constrained import (
    ConstrainedDrafts,
    DraftGuide,
    advance,
    constrain_drafts,
    guided_logits,
)
from xspec.spec.verify import rejection_sample
from xspec.tokenizer import ByteTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"(def|class) [a-z_]{1,12}\((self)?\):"


# ---- the walk, against the masked target distribution ---------------------------------

V = 300  # byte ids 0..255, stop id 299


def _pair_distribution(p: torch.Tensor, first: list[int], second: list[int]) -> torch.Tensor:
    """[len(first) * len(second)]: t1 ~ p[0] | first, t2 ~ p[1] | second, independent."""
    a = p[0, first] / p[0, first].sum()
    b = p[1, second] / p[1, second].sum()
    return (a[:, None] * b[None, :]).flatten()


def _sample_pairs(mode: str, n: int = 6000) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` outputs of two tokens under ``[ab][cd]``, decoded speculatively with gamma 2,
    drafts from q (mostly on tokens the grammar forbids) verified against the masked
    target rows. ``mode``: ``after`` (drawn from q, walked afterwards: kept or redrawn
    from q restricted to the allowed set), ``inside`` (a guided drafter: each position
    drawn from q masked by the grammar at the path so far), ``unmasked``
    (``spec.mask_drafts=false``: drawn from q, verified as drawn); ``after!`` and
    ``inside!`` hand the verifier the drafter's q instead of the one each draft was
    drawn from (the negative controls)."""
    gen = torch.Generator().manual_seed(7)
    p = torch.rand(3, V, generator=gen) ** 4
    p[:, 97:101] += torch.tensor([0.5, 1.5, 2.0, 0.7])  # a b c d
    p = p / p.sum(dim=1, keepdim=True)
    q = torch.rand(3, V, generator=gen)
    q[:, 97:101] = torch.tensor([3.0, 0.2, 0.1, 4.0])
    q = q / q.sum(dim=1, keepdim=True)
    tok = ByteTokenizer(V, None, [V - 1])
    grammar = GrammarCompiler(tok, V).compile(GrammarSpec.regex("[ab][cd]"))
    cells = []
    for _ in range(n):
        c, out = grammar.constraint(), []
        while len(out) < 2:
            pos = len(out)
            if mode.startswith("inside"):
                walked = _guided_walk(c, q[pos:], 2 - pos, gen)
            else:
                drafts = [
                    int(torch.multinomial(q[pos + j], 1, generator=gen)) for j in range(2 - pos)
                ]
                walked = constrain_drafts(
                    c, drafts, q[pos : pos + len(drafts)], 2 - pos, gen, redraw=mode != "unmasked"
                )
            k = len(walked.tokens)
            rows = p[pos : pos + k + 1] * walked.masks
            rows = rows / rows.sum(dim=1, keepdim=True)
            assert walked.probs is not None
            probs = q[pos : pos + k] if mode.endswith("!") else walked.probs
            result = rejection_sample(
                rows[None], torch.tensor([walked.tokens]).reshape(1, k), probs[None], [gen], [k]
            )
            committed = [t for t in result.output_tokens[0].tolist() if t >= 0]
            c.commit(committed)
            out += committed
        cells.append((out[0] - 97) * 2 + (out[1] - 99))
    return torch.tensor(cells), _pair_distribution(p, [97, 98], [99, 100])


def _guided_walk(
    c: Constraint, q: torch.Tensor, cap: int, gen: torch.Generator
) -> ConstrainedDrafts:
    """What a drafter with a guide does: per position, q's logits masked by the grammar
    at the path so far, sampled with the request's processing, pushed."""
    guide, params, probs = DraftGuide(c, cap), [SamplingParams(temperature=1.0)], []
    for j in range(cap):
        row = logits_to_probs(guided_logits([guide], q[j : j + 1].log()), params)  # [1, V]
        advance([guide], sample(row, [gen]))
        probs.append(row[0])
    return guide.finish(cap, torch.stack(probs))


@pytest.mark.parametrize(
    "mode", ["after", "inside", pytest.param("unmasked", marks=pytest.mark.slow)]
)
def test_constrained_speculation_follows_the_masked_target(mode: str) -> None:
    cells, expected = _sample_pairs(mode)
    assert_follows(cells, expected, f"two tokens under [ab][cd], drafts {mode}")


@pytest.mark.parametrize("mode", ["after!", "inside!"])
def test_negative_control_unrestricted_q_is_not_exact(mode: str) -> None:
    cells, expected = _sample_pairs(mode)
    with pytest.raises(AssertionError, match="chi2="):
        assert_follows(cells, expected, "unrestricted q")


def test_forced_tokens_come_first_and_the_grammar_ends_where_it_was() -> None:
    tok = ByteTokenizer(V, None, [V - 1])
    c = GrammarCompiler(tok, V).compile(GrammarSpec.regex("x=[0-9]+;")).constraint()
    drafts = tok.encode("zz7")  # the drafter's guesses: wrong, wrong, then a digit
    walked = constrain_drafts(c, drafts, None, 4, None)
    assert walked.forced == 2 and walked.tokens == tok.encode("x=7")
    assert walked.probs is None and walked.masks.shape == (4, V)
    assert torch.equal(c.allowed(), walked.masks[0]) and c.forced(4) == tok.encode("x=")
    short = constrain_drafts(c, drafts, None, 1, None)  # the cap bounds forced runs too
    assert short.tokens == tok.encode("x") and short.masks.shape == (2, V)


def _guided(c: Constraint, cap: int, steps: int) -> DraftGuide:
    """A greedy drafter that prefers "z", then "7", everywhere: ``steps`` positions under
    a guide of ``c`` capped at ``cap``."""
    tok = ByteTokenizer(V, None, [V - 1])
    guide = DraftGuide(c, cap)
    logits = torch.zeros(1, V)
    logits[0, tok.encode("z")] = 5.0
    logits[0, tok.encode("7")] = 1.0
    for _ in range(steps):
        advance([guide], guided_logits([guide], logits).argmax(-1))
    return guide


def test_a_guide_masks_each_position_and_appends_forced_tokens() -> None:
    tok = ByteTokenizer(V, None, [V - 1])
    c = GrammarCompiler(tok, V).compile(GrammarSpec.regex("ab[0-9]cd")).constraint()
    start = c.allowed()
    guide = _guided(c, cap=5, steps=4)
    assert guide.tokens == tok.encode("ab7c")  # the forced run, then the allowed 7, then c
    walked = guide.finish(3, None)  # the policy verifies 3: the forced tail follows
    assert walked.tokens == tok.encode("ab7cd") and walked.forced_at == [
        True,
        True,
        False,
        True,
        True,
    ]
    assert walked.probs is None and walked.masks.shape == (6, V)
    assert torch.equal(c.allowed(), start) and c.forced(5) == tok.encode("ab")  # rolled back
    short = _guided(c, cap=5, steps=1).finish(1, None)
    assert short.tokens == tok.encode("ab") and short.forced == 2  # stops where digits start
    capped = _guided(c, cap=2, steps=4).finish(4, None)
    assert capped.tokens == tok.encode("ab") and torch.equal(c.allowed(), start)


# ---- through the engine: greedy output equals spec=none's with the same grammar ----------

PROMPTS = ("def parse(", "import os\n", "Person:")
# (model, spec, overrides): every drafter, DSpark with the adaptive depth policy too
DRAFTERS = [
    ("dsv4_tiny", "mtp", {"spec.num_speculative_tokens": 3}),  # chained MTP drafts
    ("dsv4_tiny", "dspark", {}),
    ("dsv4_tiny", "dspark", {"spec.adaptive": True}),
    ("qwen3_tiny", "dspark", {}),
    ("qwen3_tiny", "dflash", {}),
]
DRAFTER_IDS = ["mtp", "dspark", "dspark-adaptive", "qwen3-dspark", "qwen3-dflash"]


def _built(model: str, spec: str, overrides: dict[str, Any]) -> Any:
    return xspec.LLM(model=model, spec=spec, platform="cpu", overrides=overrides).built


def _run(built: Any, specs: list[GrammarSpec], max_new: int = 32) -> list[Any]:
    """Greedy generations of the three prompts under each grammar, by the run's engine
    (its own depth policy), compiled with the run's settings (``spec.forced_tokens``)."""
    prompts = [built.tokenizer.encode(t) for t in PROMPTS]
    grammars = [built.grammars.compile(s) for s in specs]
    reqs = [Request(p, max_new, SamplingParams(), grammar=g) for g in grammars for p in prompts]
    gens = built.engine.run(reqs, len(reqs))
    assert all(g.error is None for g in gens)
    return gens


_BASELINES: dict[str, tuple[list[list[int]], Any]] = {}


def _baseline(model: str) -> tuple[list[list[int]], Any]:
    """``spec=none``'s greedy outputs under both grammars, and the tokenizer (per model)."""
    if model not in _BASELINES:
        b = _built(model, "none", {})
        grammars = [GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(REGEX)]
        _BASELINES[model] = ([g.token_ids for g in _run(b, grammars)], b.tokenizer)
    return _BASELINES[model]


@pytest.mark.parametrize("model", ["dsv4_tiny", "qwen3_tiny"])
def test_constrained_spec_none_output_parses(model: str) -> None:
    baseline, tok = _baseline(model)
    for i, ids in enumerate(baseline):
        finished = ids[-1] in tok.stop_ids
        text = tok.decode([t for t in ids if t not in tok.stop_ids])
        if i < 3:
            assert text.startswith('{"name": "'), text  # compact JSON, keys in order
            if finished:
                obj = json.loads(text)
                assert list(obj) == ["name", "age", "tags"] and 0 <= obj["age"] <= 150
        else:
            assert re.match(r"(def|class) ", text), text
            if finished:
                assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "no-forced"])
@pytest.mark.parametrize("mask", [True, False], ids=["masked", "unmasked"])
@pytest.mark.parametrize(("model", "spec", "extra"), DRAFTERS, ids=DRAFTER_IDS)
def test_greedy_constrained_speculation_equals_spec_none(
    model: str, spec: str, extra: dict[str, Any], mask: bool, forced: bool
) -> None:
    """Every drafter, with draft masking and forced tokens on and off: greedy outputs
    under a JSON schema and a regex equal ``spec=none``'s, and it drafted."""
    knobs = {"spec.mask_drafts": mask, "spec.forced_tokens": forced}
    b = _built(model, spec, {**extra, **knobs})
    assert b.drafter.mask_drafts is mask
    gens = _run(b, [GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(REGEX)])
    assert [g.token_ids for g in gens] == _baseline(model)[0]
    assert sum(g.spec.num_draft_tokens for g in gens) > 0


Seen = list[tuple[bool, bool]]  # per guided draft: (the grammar allows it, it had a choice)


def _instrument(drafter: Any, seen: Seen) -> None:
    """Wrap ``drafter.propose``: for every draft of a guided request (as far as its guide
    took them), record whether the grammar allows it at its place, checked against the
    constraint's own path masks (:meth:`Constraint.path_masks`), and whether more than
    one token was allowed there (the drafter chose it)."""
    propose = drafter.propose

    def recorded(states: Any, requests: Any, num_tokens: int) -> Any:
        caps = [None if r.guide is None else r.guide.cap for r in requests]
        proposal = propose(states, requests, num_tokens)
        for b, (r, cap) in enumerate(zip(requests, caps)):
            if r.guide is None:
                continue
            c = r.guide.constraint
            drafts = proposal.tokens[b, : min(num_tokens, cap)].tolist()
            ends = [j for j, t in enumerate(drafts) if t in c.stop_ids]
            drafts = drafts[: ends[0] + 1] if ends else drafts  # a stop token ends a path
            assert r.guide.tokens == drafts
            pushed = [t for t in drafts if t not in c.stop_ids]
            c.pop(len(pushed))  # back to the committed state, to check from there
            masks = c.path_masks(drafts)
            for t in pushed:
                c.push(t)
            seen.extend((bool(masks[j, t]), int(masks[j].sum()) > 1) for j, t in enumerate(drafts))
        return proposal

    drafter.propose = recorded


@pytest.mark.parametrize(("model", "spec", "extra"), DRAFTERS, ids=DRAFTER_IDS)
def test_masked_drafts_are_allowed_and_accepted_more(
    model: str, spec: str, extra: dict[str, Any]
) -> None:
    """With draft masking every proposal the drafter makes is one the grammar allows at
    its place, and greedy decoding under a JSON schema commits more tokens per step than
    with the drafts proposed unmasked (forced tokens on in both: the drafter's own
    drafts make the difference; dsv4_tiny: greedy, deterministic, MTP 3.07 vs 2.24,
    DSpark 4.18 vs 2.79)."""
    tokens_per_step = {}
    for mask in (True, False):
        overrides = {**extra, "spec.mask_drafts": mask}
        b = _built(model, spec, overrides)
        assert b.drafter.masks_inside
        seen: Seen = []
        _instrument(b.drafter, seen)
        gens = _run(b, [GrammarSpec.json_schema(SCHEMA)])
        if mask:
            assert seen and all(ok for ok, _ in seen)
            assert sum(chose for _, chose in seen) > 10  # not only forced tokens
        else:
            assert not seen  # unmasked: no guide reaches the drafter
        steps = sum(g.num_steps for g in gens)
        tokens_per_step[mask] = sum(len(g.token_ids) for g in gens) / steps
    if model == "dsv4_tiny":  # trained drafts (qwen3_tiny's DFlash gains nothing greedy)
        assert tokens_per_step[True] > tokens_per_step[False], tokens_per_step
