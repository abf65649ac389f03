"""Speculation stays exact across the end of the reasoning: with a grammar that applies
after ``</think>`` (thinking mode), greedy outputs under ``spec=mtp`` and ``spec=dspark``
(fixed and adaptive depth; Qwen3, which writes ``<think>`` itself, with DSpark) equal
``spec=none``'s, with forced tokens (``</think>`` proposed by the grammar when the
reasoning bound is reached) and without them (the drafter proposes, the masked target
verifies). The bounds put ``</think>`` at several places in the drafts' windows."""

from __future__ import annotations

import json

import pytest

import xspec
from xspec.engine.engine import Request
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
ADAPTIVE = {"spec.adaptive": True}


def _outputs(
    model: str, spec: str, forced: bool, overrides: dict | None = None
) -> tuple[list[list[int]], int, xspec.LLM]:
    """Greedy outputs of each prompt under the schema after a reasoning of each bound
    (opened by the prompt for DeepSeek-V4, written by the model for Qwen3), and the tokens
    the run drafted."""
    llm = xspec.LLM(model=model, spec=spec, platform="cpu", overrides=overrides)
    b = llm.built
    compiler = GrammarCompiler(b.tokenizer, b.target.vocab_size, forced_tokens=forced)
    base, opened = GrammarSpec.json_schema(SCHEMA), model.startswith("dsv4")
    reqs = [
        Request(b.tokenizer.encode(p), 48, SamplingParams(), grammar=compiler.compile(g))
        for g in (base.after_reasoning(opened=opened, max_chars=k) for k in BOUNDS)
        for p in PROMPTS
    ]
    gens = b.engine.run(reqs, concurrency=len(reqs))
    assert all(g.error is None for g in gens)
    drafted = sum(g.spec.num_draft_tokens for g in gens)
    return [g.token_ids for g in gens], drafted, llm


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "drafted"])
@pytest.mark.parametrize(
    ("model", "specs"),
    [
        ("dsv4_tiny", [("mtp", None), ("dspark", None), ("dspark", ADAPTIVE)]),
        ("qwen3_tiny", [("dspark", None)]),
    ],
)
def test_greedy_speculation_across_the_end_of_the_reasoning(
    model: str, specs: list, forced: bool
) -> None:
    baseline, _, llm = _outputs(model, "none", forced)
    tok = llm.built.tokenizer
    for i, ids in enumerate(baseline):
        text = tok.decode([t for t in ids if t not in tok.stop_ids])
        reasoning, found, answer = text.partition("</think>")
        bound = BOUNDS[i // len(PROMPTS)]
        reasoning = reasoning.removeprefix("<think>")
        assert found and len(reasoning) <= bound, text  # the tiny models think to the bound
        answer = answer.lstrip("\n")
        if ids[-1] in tok.stop_ids:
            assert list(json.loads(answer)) == ["name", "n"], text
        else:  # cut by the token budget
            head = '{"name": "'
            assert answer.startswith(head) or head.startswith(answer), text
    for spec, overrides in specs:
        outs, drafted, _ = _outputs(model, spec, forced, overrides)
        assert outs == baseline, (spec, overrides)
        assert drafted > 0, (spec, overrides)
