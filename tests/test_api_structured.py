"""``xspec.LLM.generate(response_format=...)`` on the default model (dsv4_tiny, DSpark):
every output of the schemas of :mod:`tests.schema_cases` parses and validates
(``jsonschema``), greedy and at T=0.8; at T=0.8 streamed too, with the same texts (the
same seeds)."""

from __future__ import annotations

import pytest

import xspec
from tests.schema_cases import SCHEMAS, check, response_format

PROMPTS = ["def parse_record(line):\n", "class Config:\n"]
MAX_NEW = 256  # the outputs here take 10 to 90 tokens


@pytest.fixture(scope="module")
def llm() -> xspec.LLM:
    return xspec.LLM()  # the defaults: what `python -m xspec` runs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_generate_outputs_parse_and_validate(llm: xspec.LLM, name: str) -> None:
    fmt = response_format(name)
    for temperature in (0.0, 0.8):
        outs = llm.generate(PROMPTS, MAX_NEW, temperature=temperature, seed=5, response_format=fmt)
        for out in outs:
            check(name, out.text)
            assert out.finish_reason == "stop", (name, temperature, out.text)
        if temperature == 0.0:
            continue  # streamed: the sampled run (seeded, so the same outputs)
        streamed = {i: "" for i in range(len(PROMPTS))}
        for delta in llm.generate(
            PROMPTS, MAX_NEW, temperature=temperature, seed=5, response_format=fmt, stream=True
        ):
            if delta.finished:
                streamed[int(delta.rid)] = delta.generation.text
        assert list(streamed.values()) == [o.text for o in outs], (name, temperature)


def test_a_cut_by_max_new_tokens_finishes_with_length(llm: xspec.LLM) -> None:
    fmt = response_format("nested")
    whole = llm.generate(PROMPTS[0], MAX_NEW, response_format=fmt)[0]
    cut = llm.generate(PROMPTS[0], 6, response_format=fmt)[0]
    assert cut.finish_reason == "length" and whole.text.startswith(cut.text) and cut.text
