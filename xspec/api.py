"""The Python API: the same composed config as the CLI, a small generate/score surface.

    import xspec
    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu",
                    overrides={"model.dtype": "float32"})
    out = llm.generate(["Hello"], max_new_tokens=16)
    out[0].token_ids, out[0].text, out[0].ttft_s, out[0].tpot_s
    logits = llm.score([1, 2, 3])          # [T, vocab] target logits

Token-id prompts are used exactly as given (no BOS added); text prompts go through the
model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from xspec.build import Built, build
from xspec.compose import compose_run, overrides_from
from xspec.config import RunConfig
from xspec.engine.engine import Generation, Request, seeded
from xspec.errors import RequestError
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import ForwardBatch
from xspec.sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """A built run: target model, drafter and platform, ready to generate."""

    def __init__(
        self,
        model: str | None = None,
        spec: str | None = None,
        platform: str | None = None,
        overrides: Mapping[str, Any] | Iterable[str] | None = None,
    ) -> None:
        self.config: RunConfig = compose_run(overrides_from(model, spec, platform, overrides))
        self._built: Built = build(self.config)

    @property
    def tokenizer(self) -> Any:
        return self._built.tokenizer

    @property
    def metrics(self) -> SpecDecodeMetrics:
        """Spec-decode counters accumulated over every ``generate`` call."""
        return self._built.engine.metrics

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = 0,
        ignore_eos: bool = False,
        concurrency: int | None = None,
    ) -> list[Generation]:
        """One :class:`Generation` per prompt, in order. Request ``i`` samples with
        seed ``seed + i`` (reproducible; ``seed=None`` for fresh randomness)."""
        items = _as_prompt_list(prompts)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        requests = [
            Request(self._ids(p, i), max_new_tokens, seeded(params, i), ignore_eos)
            for i, p in enumerate(items)
        ]
        outs = self._built.engine.run(requests, concurrency or len(requests))
        for g in outs:
            g.text = self.tokenizer.decode(g.token_ids)
        return outs

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Target logits ``[T, vocab]`` (float32) for one sequence, from a fresh state."""
        target = self._built.target
        ids = self._ids(token_ids, 0)
        if len(ids) > target.max_context:
            raise RequestError(
                f"sequence of {len(ids)} tokens exceeds the model context {target.max_context}"
            )
        batch = ForwardBatch(torch.tensor(ids, dtype=torch.long), [len(ids)], [target.new_state()])
        return target.forward(batch).logits

    def _ids(self, prompt: Prompt, index: int) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError(f"request {index}: empty prompt")
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        vocab = self._built.target.vocab_size
        if not ids:
            raise RequestError(f"request {index}: empty prompt")
        if bad := [t for t in ids if not 0 <= t < vocab]:
            raise RequestError(
                f"request {index}: token ids outside the vocabulary [0, {vocab}): {bad[:8]}"
            )
        return ids


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a string or a list of ids) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if len(prompts) > 0 and all(isinstance(t, int) for t in prompts):
        return [cast(Sequence[int], prompts)]
    return [cast(Prompt, p) for p in prompts]
