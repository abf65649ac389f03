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
from xspec.engine.engine import Engine, Request
from xspec.grammar import GrammarCompiler, GrammarSpec
from xspec.sampling import SamplingParams
from xspec.spec.constrained import constrain_drafts
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


def _sample_pairs(restrict_q: bool, n: int = 6000) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` outputs of two tokens under ``[ab][cd]``, decoded speculatively with gamma 2:
    drafts from q (mostly on tokens the grammar forbids), walked through the grammar,
    verified against the masked target rows. ``restrict_q=False`` hands the verifier
    the drafter's q instead of q restricted to the allowed set (the negative control)."""
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
            drafts = [int(torch.multinomial(q[pos + j], 1, generator=gen)) for j in range(2 - pos)]
            walked = constrain_drafts(c, drafts, q[pos : pos + len(drafts)], 2 - pos, gen)
            k = len(walked.tokens)
            rows = p[pos : pos + k + 1] * walked.masks
            rows = rows / rows.sum(dim=1, keepdim=True)
            probs = walked.probs if restrict_q else q[pos : pos + k]
            result = rejection_sample(
                rows[None], torch.tensor([walked.tokens]).reshape(1, k), probs[None], [gen], [k]
            )
            committed = [t for t in result.output_tokens[0].tolist() if t >= 0]
            c.commit(committed)
            out += committed
        cells.append((out[0] - 97) * 2 + (out[1] - 99))
    return torch.tensor(cells), _pair_distribution(p, [97, 98], [99, 100])


def test_constrained_speculation_follows_the_masked_target() -> None:
    cells, expected = _sample_pairs(restrict_q=True)
    assert_follows(cells, expected, "two tokens under [ab][cd]")


def test_negative_control_unrestricted_q_is_not_exact() -> None:
    cells, expected = _sample_pairs(restrict_q=False)
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


# ---- through the engine: greedy output equals spec=none's with the same grammar ----------


def _engine_outputs(model: str, spec: str, specs: list[GrammarSpec]) -> tuple[list[list[int]], Any]:
    """Greedy outputs of three prompts under each grammar, and the run's tokenizer."""
    b = xspec.LLM(model=model, spec=spec, platform="cpu").built
    compiler = GrammarCompiler(b.tokenizer, b.target.vocab_size)
    engine = Engine(b.target, b.drafter, b.capture, stop_ids=b.tokenizer.stop_ids)
    prompts = [b.tokenizer.encode(t) for t in ("def parse(", "import os\n", "Person:")]
    reqs = [
        Request(p, 32, SamplingParams(), grammar=compiler.compile(s))
        for s in specs
        for p in prompts
    ]
    gens = engine.run(reqs, concurrency=len(reqs))
    assert all(g.error is None for g in gens)
    return [g.token_ids for g in gens], b.tokenizer


@pytest.mark.parametrize(
    ("model", "specs"),
    [("dsv4_tiny", ["none", "mtp", "dspark"]), ("qwen3_tiny", ["none", "dspark", "dflash"])],
)
def test_greedy_constrained_speculation_equals_spec_none(model: str, specs: list[str]) -> None:
    grammars = [GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(REGEX)]
    outs = {s: _engine_outputs(model, s, grammars)[0] for s in specs[1:]}
    baseline, tok = _engine_outputs(model, "none", grammars)
    for s in specs[1:]:
        assert outs[s] == baseline, s
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


def test_greedy_constrained_adaptive_speculation_equals_spec_none() -> None:
    """The adaptive depth policy (the engine's own, spec.adaptive=true) under a grammar:
    greedy outputs equal spec=none's, and it drafted."""
    grammars = [GrammarSpec.regex(REGEX)]
    baseline, _ = _engine_outputs("dsv4_tiny", "none", grammars)
    b = xspec.LLM(
        model="dsv4_tiny", spec="dspark", platform="cpu", overrides={"spec.adaptive": True}
    ).built
    prompts = [b.tokenizer.encode(t) for t in ("def parse(", "import os\n", "Person:")]
    assert b.grammars is not None
    grammar = b.grammars.compile(grammars[0])
    gens = b.engine.run([Request(p, 32, SamplingParams(), grammar=grammar) for p in prompts], 3)
    assert [g.token_ids for g in gens] == baseline
    assert sum(g.spec.num_draft_tokens for g in gens) > 0
