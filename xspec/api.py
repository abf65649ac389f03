"""The Python API: the same composed config as the CLI, a small generate/score surface.

    import xspec
    llm = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu",
                    overrides={"model.dtype": "float32"})
    out = llm.generate(["Hello"], max_new_tokens=16)
    out[0].token_ids, out[0].text, out[0].ttft_s, out[0].tpot_s
    for delta in llm.generate(["Hello", "def f"], max_new_tokens=16, stream=True):
        delta.rid, delta.token_ids, delta.finished   # tokens as each step commits them
    logits = llm.score([1, 2, 3])          # [T, vocab] target logits
    xspec.LLM(..., depth_policy=FixedDepth())  # how deep each request drafts (xspec.spec.policy)

A prompt is a ``str`` (encoded with the model's tokenizer) or a sequence of int token ids
(used exactly as given, no BOS added); ``generate`` takes one prompt or a list of prompts.
Every bad argument raises a :class:`~xspec.errors.UserError` subclass (RequestError for
generation arguments, ConfigError for the configuration), never a bare TypeError.

An exception out of ``generate`` (a KeyboardInterrupt mid-run) aborts what was in flight:
the next call runs as usual. A new call also ends a stream still open (one left by an
exception in the loop that read it); reading on from that stream raises RequestError.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal, cast, overload

import torch

from xspec.build import Built, build
from xspec.compose import compose_run, overrides_from
from xspec.config import RunConfig
from xspec.engine.engine import Delta, Engine, Generation, Request, seeded
from xspec.errors import RequestError
from xspec.grammar import request_spec
from xspec.metrics import SpecDecodeMetrics
from xspec.models.base import ForwardBatch
from xspec.sampling import SamplingParams, as_logit_bias
from xspec.spec.policy import DepthPolicy

Prompt = str | Sequence[int]


class LLM:
    """A built run: target model, drafter and platform, ready to generate."""

    def __init__(
        self,
        model: str | None = None,
        spec: str | None = None,
        platform: str | None = None,
        overrides: Mapping[str, Any] | Iterable[str] | None = None,
        *,
        depth_policy: DepthPolicy | None = None,
    ) -> None:
        """``depth_policy``: how many tokens each request drafts and verifies each step
        (:mod:`xspec.spec.policy`), instead of the one the config selects (fixed gamma,
        or ``spec.adaptive`` / ``spec.gamma_schedule``'s)."""
        self.config: RunConfig = compose_run(overrides_from(model, spec, platform, overrides))
        self._built: Built = build(self.config, depth_policy=depth_policy)
        self._open_stream: object | None = None  # the token of the stream in flight

    @property
    def tokenizer(self) -> Any:
        return self._built.tokenizer

    @property
    def engine(self) -> Engine:
        """The streaming engine every ``generate`` drives (``add`` / ``step`` / ``abort``;
        its depth ``policy``, its ``metrics``)."""
        return self._built.engine

    @property
    def built(self) -> Built:
        """The wired run (:class:`xspec.build.Built`): target, drafter, capture points,
        platform, engine and step-cost profile, for tools and benchmarks that drive the
        pieces directly (the decode step, one forward)."""
        return self._built

    @property
    def metrics(self) -> SpecDecodeMetrics:
        """Spec-decode counters accumulated over every ``generate`` call."""
        return self._built.engine.metrics

    def reset_metrics(self) -> SpecDecodeMetrics:
        """Start the spec-decode counters afresh (e.g. between the settings a benchmark
        compares); returns the ones accumulated so far."""
        return self._built.engine.reset_metrics()

    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int | None = ...,
        ignore_eos: bool = ...,
        concurrency: int | None = ...,
        stop: Sequence[str] | None = ...,
        stream: Literal[False] = ...,
        response_format: dict[str, Any] | None = ...,
        structured_outputs: dict[str, Any] | None = ...,
        *,
        presence_penalty: float = ...,
        frequency_penalty: float = ...,
        repetition_penalty: float = ...,
        logit_bias: Mapping[int, float] | None = ...,
        min_tokens: int = ...,
        logprobs: int | None = ...,
        prompt_logprobs: int | None = ...,
        logprobs_mode: str = ...,
        n: int = ...,
    ) -> list[Generation]: ...

    @overload
    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_new_tokens: int = ...,
        temperature: float = ...,
        top_k: int = ...,
        top_p: float = ...,
        seed: int | None = ...,
        ignore_eos: bool = ...,
        concurrency: int | None = ...,
        stop: Sequence[str] | None = ...,
        *,
        stream: Literal[True],
        response_format: dict[str, Any] | None = ...,
        structured_outputs: dict[str, Any] | None = ...,
        presence_penalty: float = ...,
        frequency_penalty: float = ...,
        repetition_penalty: float = ...,
        logit_bias: Mapping[int, float] | None = ...,
        min_tokens: int = ...,
        logprobs: int | None = ...,
        prompt_logprobs: int | None = ...,
        logprobs_mode: str = ...,
        n: int = ...,
    ) -> Iterator[Delta]: ...

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
        stop: Sequence[str] | None = None,
        stream: bool = False,
        response_format: dict[str, Any] | None = None,
        structured_outputs: dict[str, Any] | None = None,
        *,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        logit_bias: Mapping[int, float] | None = None,
        min_tokens: int = 0,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        logprobs_mode: str = "raw",
        n: int = 1,
    ) -> list[Generation] | Iterator[Delta]:
        """One :class:`Generation` per prompt, in order; with ``n > 1``, ``n`` per prompt
        (prompt ``i``'s choices at ``i * n .. i * n + n - 1``), its prompt prefilled once
        and its states copied to the other choices (docs/sampling.md). Request ``k`` of
        that list samples with seed ``seed + k`` (reproducible; ``seed=None`` for fresh
        randomness). ``stop``:
        strings that end an output (``text`` stops before the first one). A request
        that can never fit (model context, memory plan) comes back with ``error`` set
        and no tokens; the others run.

        ``stream=True``: an iterator of :class:`~xspec.engine.engine.Delta` instead, as
        the engine commits tokens (``delta.rid`` is the request's index in that list; the last delta
        of each prompt has ``finished`` set and its final ``generation``, text
        included). The arguments are checked before the first delta; leaving the loop
        early aborts what is still running, and so does the next ``generate`` call (the
        stream then raises RequestError if read on).

        Structured output (docs/structured_output.md): ``response_format`` as OpenAI's
        (``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or
        ``{"type": "json_object"}``) or ``structured_outputs`` as vLLM's (one of ``json``,
        ``regex``, ``choice``, ``grammar``): every prompt's output follows it.

        Logits processors, exact under speculation (docs/sampling.md): OpenAI's
        ``presence_penalty`` / ``frequency_penalty`` in [-2, 2] (output tokens), vLLM's
        ``repetition_penalty`` in (0, 10] (prompt and output tokens), ``logit_bias``
        ``{token id: bias in [-100, 100]}``, ``min_tokens`` (the stop ids are masked
        until that many tokens are generated). ``logprobs=k`` fills
        ``Generation.logprobs`` (one :class:`~xspec.sampling.TokenLogprob` per generated
        token with its top ``k`` <= 20 alternatives), ``prompt_logprobs=k``
        ``Generation.prompt_logprobs`` (the first prompt token's is None); with
        ``logprobs_mode="raw"`` (the default, as vLLM's) they are the model's own,
        ``"processed"`` those of the distribution the request samples from."""
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
            logit_bias=_logit_bias(logit_bias),
            min_tokens=min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logprobs_mode=logprobs_mode,
        )
        n = _integer("n", n, minimum=1)
        requests = self._requests(prompts, max_new_tokens, params, ignore_eos, stop, n)
        groups = [k // n if n > 1 else None for k in range(len(requests))]  # a prompt's choices
        spec = request_spec(response_format, structured_outputs)
        if spec is not None:
            grammars = self._built.grammars
            assert grammars is not None  # build() makes one for every run
            grammar = grammars.compile(spec)
            requests = [dataclasses.replace(r, grammar=grammar) for r in requests]
        if concurrency is not None:
            concurrency = _integer("concurrency", concurrency, minimum=1)
        if not isinstance(stream, bool):
            raise RequestError(f"stream must be True or False (got {stream!r})")
        engine = self._built.engine
        if stream:
            for i, r in enumerate(requests):
                engine.check(r, f"request {i}")
            return self._stream(requests, concurrency or len(requests), groups)
        self._end_open_stream()
        outs = engine.run(requests, concurrency or len(requests), groups)
        for g, r in zip(outs, requests):
            self._set_text(r, g)
        return outs

    def _stream(
        self, requests: list[Request], concurrency: int, groups: list[int | None]
    ) -> Iterator[Delta]:
        engine = self._built.engine
        self._end_open_stream()
        engine.reset_clock()
        engine.concurrency = concurrency
        self._open_stream = token = object()
        try:
            for i, (r, g) in enumerate(zip(requests, groups)):
                engine.add(i, r, arrived_at=0.0, group=g)
            for delta in engine.drain():
                if delta.finished:
                    self._set_text(requests[int(cast(int, delta.rid))], delta.generation)
                yield delta
                if self._open_stream is not token:
                    raise RequestError(
                        "this stream was ended by a later generate() call on the same LLM "
                        "(one call at a time: finish or close a stream before the next)"
                    )
        finally:  # the caller left early (or a step raised): nothing stays in flight
            if self._open_stream is token:  # else a later call owns the engine now
                self._open_stream = None
                engine.discard()

    def _end_open_stream(self) -> None:
        """End the stream still open, if any (an exception in the loop that read it left
        its generator suspended): its requests are aborted, so this call can run."""
        if self._open_stream is not None:
            self._open_stream = None
            self._built.engine.discard()

    def _set_text(self, req: Request, gen: Generation) -> None:
        if not req.stop:  # with stop strings the engine already cut the text
            gen.text = self.tokenizer.decode(gen.token_ids)

    def _requests(
        self,
        prompts: Prompt | Sequence[Prompt],
        max_new_tokens: int,
        params: SamplingParams,
        ignore_eos: bool,
        stop: Sequence[str] | None,
        n: int = 1,
    ) -> list[Request]:
        """The checked requests of one ``generate`` call (every bad argument raises):
        ``n`` per prompt, request ``k`` seeded ``seed + k``."""
        items = _as_prompt_list(prompts)
        max_new_tokens = _integer("max_new_tokens", max_new_tokens, minimum=1)
        if not isinstance(ignore_eos, bool):
            raise RequestError(f"ignore_eos must be True or False (got {ignore_eos!r})")
        if problems := params.problems():
            raise RequestError("invalid sampling arguments:", problems=problems)
        if isinstance(stop, str) or (
            stop is not None
            and (not isinstance(stop, Sequence) or not all(isinstance(x, str) and x for x in stop))
        ):
            raise RequestError(f"stop must be a list of non-empty strings (got {stop!r})")
        stops = list(stop or [])
        ids = [self._ids(p, i) for i, p in enumerate(items)]
        return [
            Request(ids[k // n], max_new_tokens, seeded(params, k), ignore_eos, stop=stops)
            for k in range(len(items) * n)
        ]

    def score(self, token_ids: Prompt) -> torch.Tensor:
        """Target logits ``[T, vocab]`` (float32) for one sequence (ids, or text through the
        tokenizer), from a fresh state."""
        target = self._built.target
        _refuse_bytes(token_ids, "score")
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.tolist()
        if not isinstance(token_ids, str) and not _is_id_sequence(token_ids):
            raise RequestError(
                f"score takes one sequence of int token ids (or a string), got "
                f"{_describe(token_ids)}; score several sequences one call each"
            )
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
        ids = [_token(t, index) for t in prompt]
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
    _refuse_bytes(prompts, "prompts")
    if isinstance(prompts, torch.Tensor):
        prompts = prompts.tolist()
    if not isinstance(prompts, Sequence):
        raise RequestError(
            f"prompts must be a string, a list of int token ids, or a list of those; got "
            f"{_describe(prompts)}"
        )
    if len(prompts) > 0 and all(_is_number(t) for t in prompts):
        return [cast(Sequence[int], prompts)]  # one token-id prompt (each id checked later)
    out: list[Prompt] = []
    for i, p in enumerate(prompts):
        _refuse_bytes(p, f"request {i}")
        if isinstance(p, torch.Tensor):
            p = p.tolist()
        if not isinstance(p, str) and not _is_id_sequence(p):
            raise RequestError(
                f"request {i}: a prompt is a string or a list of int token ids; got {_describe(p)}"
            )
        out.append(cast(Prompt, p))
    return out


def _logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if bias is not None and not isinstance(bias, Mapping):
        raise RequestError(
            f"logit_bias must be a mapping {{token id: bias}} (got {_describe(bias)})"
        )
    return as_logit_bias(bias)


def _refuse_bytes(x: Any, where: str) -> None:
    """bytes (and bytearray, memoryview) are sequences of ints: without this check
    ``b"def f"`` would be taken as five token ids."""
    if isinstance(x, bytes | bytearray | memoryview):
        raise RequestError(
            f"{where}: got {_describe(x)}; a prompt is text (str) or a list of int token "
            "ids, not bytes: decode it first (e.g. data.decode('utf-8')), or pass "
            "list(data) if its byte values really are token ids"
        )


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Number) or (isinstance(x, torch.Tensor) and x.dim() == 0)


def _is_id_sequence(x: Any) -> bool:
    """A flat sequence of numbers (ids are checked one by one in ``_token``)."""
    return isinstance(x, Sequence) and not isinstance(x, str) and all(_is_number(t) for t in x)


def _token(t: Any, index: int) -> int:
    """An int token id: ints (numpy / torch integer scalars too), never floats or bools."""
    if isinstance(t, torch.Tensor):
        t = t.item()
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        raise RequestError(
            f"request {index}: token ids must be integers, got {t!r} ({type(t).__name__}); "
            "floats are not rounded"
        )
    return int(t)


def _integer(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise RequestError(f"{name} must be an integer >= {minimum} (got {value!r})")
    return int(value)


def _describe(x: Any) -> str:
    text = repr(x)
    return f"{type(x).__name__} {text if len(text) <= 40 else text[:37] + '...'}"
