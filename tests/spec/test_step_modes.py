"""Greedy speculative output equals the baseline whatever runs the steps: the reference
torch ops (``platform.kernels=reference``), the CPU platform's native fused kernels (the
default), and compiled steps (``platform.compile=on``, ``slow``: it compiles)."""

from __future__ import annotations

import pytest

import xspec
from xspec.platforms import native
from xspec.train import corpus

NEW_TOKENS = 24
MODES = {
    "reference": {"platform.kernels": "reference"},
    "native": {},
    "compiled": {"platform.compile": "on"},
}


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    return corpus.prompts(corpus.source_files(split="heldout"), 3, seed=5, max_chars=200)


def generate(spec: str, mode: str, prompts: list[str]) -> tuple[xspec.LLM, list[list[int]]]:
    llm = xspec.LLM(model="dsv4_tiny", spec=spec, platform="cpu", overrides=MODES[mode])
    out = llm.generate(prompts, max_new_tokens=NEW_TOKENS, ignore_eos=True, concurrency=2)
    return llm, [g.token_ids for g in out]


@pytest.mark.parametrize(
    "mode", ["reference", "native", pytest.param("compiled", marks=pytest.mark.slow)]
)
def test_greedy_speculation_equals_the_baseline(prompts, mode) -> None:
    llm, baseline = generate("none", mode, prompts)
    options = llm._built.platform.step_options()
    assert (options.compile is not None) == (mode == "compiled")
    if mode == "reference":
        assert options.ops.mhc_pre is None
    elif native.compiler() is not None:  # the fused kernels build wherever there is a cc
        assert options.ops.mhc_pre is not None
    for spec in ("mtp", "dspark"):
        spec_llm, out = generate(spec, mode, prompts)
        assert out == baseline, f"{spec} with {mode} steps"
        assert spec_llm.metrics.report().num_accepted_tokens > 0


def test_native_kernels_do_not_change_the_greedy_text(prompts) -> None:
    """fp32 rounding differences of the fused kernels (~1e-6) flip no greedy choice of
    the trained model on these prompts."""
    assert generate("none", "native", prompts)[1] == generate("none", "reference", prompts)[1]
