"""The engine: stop ids (one or several), also inside a multi-token speculative step."""

from __future__ import annotations

import pytest

import xspec
from xspec.build import stop_ids_of
from xspec.engine.engine import Engine, Request
from xspec.errors import ConfigError
from xspec.sampling import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100))]


def test_stop_ids_of_accepts_ints_lists_and_none() -> None:
    assert stop_ids_of(None) == frozenset()
    assert stop_ids_of(7) == frozenset({7})
    assert stop_ids_of([151645, 151643], 151643, None) == frozenset({151645, 151643})
    assert stop_ids_of(frozenset({1}), (2,)) == frozenset({1, 2})
    with pytest.raises(ConfigError, match="stop / eos token id"):
        stop_ids_of("eos")


@pytest.mark.parametrize("spec", ["none", "oracle"])
def test_any_stop_id_ends_a_request(spec: str) -> None:
    """Two stop ids taken from the free-running outputs: each request ends at the first
    of either (the stop token included), also when it sits mid-block in an oracle step
    that accepted past it. ignore_eos keeps going."""
    llm = xspec.LLM(model="qwen3_tiny", spec=spec, platform="cpu")  # oracle: gamma 3
    built = llm._built
    free = [g.token_ids for g in llm.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)]
    stops = frozenset({free[0][5], free[1][2]})
    engine = Engine(built.target, built.drafter, built.capture, stop_ids=stops)
    gens = engine.run([Request(p, 12, SamplingParams()) for p in PROMPTS], concurrency=2)
    for g, tokens in zip(gens, free):
        end = next(i for i, t in enumerate(tokens) if t in stops) + 1
        assert g.token_ids == tokens[:end]
    kept = engine.run([Request(PROMPTS[0], 12, SamplingParams(), ignore_eos=True)], 1)
    assert kept[0].token_ids == free[0]
