"""Speculation stays exact across the end of the reasoning: with a grammar that applies
after ``</think>`` (thinking mode), greedy outputs under ``spec=mtp`` and ``spec=dspark``
equal ``spec=none``'s, with forced tokens (``</think>`` proposed by the grammar when the
reasoning bound is reached) and without them (the drafter proposes, the masked target
verifies). The bounds put ``</think>`` at several places in the drafts' windows."""

from __future__ import annotations

import json

import pytest

import xspec
from xspec.engine.engine import Engine, Request
from xspec.grammar import GrammarCompiler, GrammarSpec
from xspec.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
BOUNDS = (0, 3, 5, 8, 13)  # reasoning characters before </think> is forced
PROMPTS = ("def parse(", "import os\n")


def _outputs(spec: str, forced: bool) -> tuple[list[list[int]], int, xspec.LLM]:
    """Greedy outputs of each prompt under the schema after a reasoning of each bound,
    and the tokens the run drafted."""
    llm = xspec.LLM(model="dsv4_tiny", spec=spec, platform="cpu")
    b = llm.built
    compiler = GrammarCompiler(b.tokenizer, b.target.vocab_size, forced_tokens=forced)
    engine = Engine(b.target, b.drafter, b.capture, stop_ids=b.tokenizer.stop_ids)
    base = GrammarSpec.json_schema(SCHEMA)
    reqs = [
        Request(b.tokenizer.encode(p), 48, SamplingParams(), grammar=compiler.compile(g))
        for g in (base.after_reasoning(max_chars=k) for k in BOUNDS)
        for p in PROMPTS
    ]
    gens = engine.run(reqs, concurrency=len(reqs))
    assert all(g.error is None for g in gens)
    drafted = sum(g.spec.num_draft_tokens for g in gens)
    return [g.token_ids for g in gens], drafted, llm


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "drafted"])
def test_greedy_speculation_across_the_end_of_the_reasoning(forced: bool) -> None:
    baseline, _, llm = _outputs("none", forced)
    tok = llm.built.tokenizer
    for i, ids in enumerate(baseline):
        text = tok.decode([t for t in ids if t not in tok.stop_ids])
        reasoning, found, answer = text.partition("</think>")
        bound = BOUNDS[i // len(PROMPTS)]
        assert found and len(reasoning) <= bound, text  # the tiny model thinks to the bound
        if ids[-1] in tok.stop_ids:
            assert list(json.loads(answer)) == ["name", "n"], text
        else:
            assert answer.startswith('{"name": "'), text
    for spec in ("mtp", "dspark"):
        outs, drafted, _ = _outputs(spec, forced)
        assert outs == baseline, spec
        assert drafted > 0, spec
