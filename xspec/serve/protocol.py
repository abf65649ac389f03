"""The OpenAI request bodies xspec serves, as pydantic models, the policy for the fields
it does not serve, and the error body.

Fields follow OpenAI's API reference (``/v1/completions``, ``/v1/chat/completions``) with
the vLLM extensions clients send (``top_k``, ``ignore_eos``). Every field of a body is one
of three kinds:

* **served**: a declared field of the model below, range-checked (a value out of range is a
  400 naming the field);
* **refused by name** (:data:`REFUSED`): a field of OpenAI's or vLLM's API that xspec does
  not honour. A value that changes nothing (``null``, or the field's neutral value:
  ``best_of: 1``, ``min_p: 0``) is accepted; any other is a 400 naming the field, so a
  client never believes it got what it asked for;
* **ignored by name** (:data:`IGNORED`): fields that do not change the output (``user``,
  ``metadata``, scheduling hints), accepted as OpenAI and vLLM accept them.

Any other field is refused with a 400 naming it, as OpenAI's server does ("Unrecognized
request argument"): a misspelt ``max_token`` must not run with the default length. (vLLM
ignores unknown fields with a log warning; a client that sends a vendor field xspec lacks
gets its name in the 400 and can drop it.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from xspec.errors import RequestError
from xspec.grammar import MAX_REASONING_CHARS, GrammarSpec, request_spec
from xspec.sampling import MAX_LOGPROBS, SamplingParams, as_logit_bias


@dataclass(frozen=True)
class Refused:
    """A field xspec does not honour: the values that change nothing (``null`` always
    does), and what the 400 tells the client."""

    neutral: tuple[Any, ...] = ()
    why: str = "not supported"


# Fields of both endpoints xspec does not honour: a field the server starts to honour
# becomes a declared field of _Sampling (or of one endpoint's request) and leaves this
# table.
_REFUSED_BOTH: dict[str, Refused] = {
    "min_p": Refused((0,)),  # vLLM
    "best_of": Refused((1,)),
    # vLLM's extensions
    "bad_words": Refused(([],)),
    "allowed_token_ids": Refused(()),
    "prompt_logprobs": Refused(()),
    "truncate_prompt_tokens": Refused(()),
    "use_beam_search": Refused((False,)),
    "length_penalty": Refused((1,)),
    "skip_special_tokens": Refused((True,)),
    "spaces_between_special_tokens": Refused((True,)),
    "return_tokens_as_token_ids": Refused((False,)),
    "logits_processors": Refused(([],)),
    "guided_whitespace_pattern": Refused(
        (), "the JSON layout is fixed (docs/structured_output.md)"
    ),
    "prompt_embeds": Refused(()),
}
REFUSED: dict[str, dict[str, Refused]] = {
    "completions": {
        **_REFUSED_BOTH,
        "suffix": Refused(("",)),
        "add_special_tokens": Refused((True,)),  # vLLM
    },
    "chat": {
        **_REFUSED_BOTH,
        "functions": Refused(([],), "function calling is not supported"),
        "function_call": Refused(("none", "auto"), "function calling is not supported"),
        "prediction": Refused(()),
        "audio": Refused(()),
        "modalities": Refused((["text"],)),
        "web_search_options": Refused(()),
        "reasoning_effort": Refused((), "use chat_template_kwargs instead"),
        # vLLM's extensions
        "echo": Refused((False,)),
        "add_generation_prompt": Refused((True,)),
        "continue_final_message": Refused((False,)),
        "add_special_tokens": Refused((False,)),
        "documents": Refused(()),
        "chat_template": Refused((), "the server renders the model's own chat template"),
    },
}
# Fields that do not change what is generated, accepted and ignored (as OpenAI and vLLM
# do): who is asking, storage and tracing tags, scheduling hints.
IGNORED = frozenset({
    "user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
    "priority", "request_id", "cache_salt", "kv_transfer_params",
    "vllm_xargs", "mm_processor_kwargs",
    "guided_decoding_backend",  # one grammar engine here (llguidance): the output is the same
})  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    """``a == b`` without Python's ``0 == False`` and ``1 == True`` (a JSON number is not a
    boolean); ints and floats compare as numbers."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and a == b


def _shown(value: Any) -> str:
    return "true" if value is True else "false" if value is False else repr(value)


def extra_problems(extra: dict[str, Any], refused: dict[str, Refused]) -> list[tuple[str, str]]:
    """(field, message) for each field of ``extra`` (the body's undeclared fields) that
    :data:`REFUSED` refuses at its value, or that xspec does not know."""
    out = []
    for name, value in extra.items():
        if name in IGNORED:
            continue
        rule = refused.get(name)
        if rule is None:
            out.append((name, f"unrecognized request field {name!r}: this server does not "
                        "know it and does not ignore what it does not know; remove it "
                        "(docs/serving.md lists the fields)"))  # fmt: skip
        elif value is not None and not any(_same(value, n) for n in rule.neutral):
            unset = " or ".join(["unset (null)", *(_shown(n) for n in rule.neutral)])
            out.append((name, f"{name}={_shown(value)}: {rule.why}; leave it {unset}"))
    return out


MAX_STOP_IDS = 64  # stop_token_ids a request may give
MAX_PROMPTS = 64  # prompts one completions request may batch
MAX_N = 16  # choices per prompt


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: the usage so far in every chunk


class _Sampling(BaseModel):
    """The fields both endpoints serve; undeclared ones are kept (``model_extra``) for
    :meth:`problems` to judge."""

    model_config = ConfigDict(extra="allow")
    kind: ClassVar[str] = "completions"  # its table in REFUSED

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension (benchmarks decode to max_tokens)
    # vLLM extensions: more ids that end the output (also under ignore_eos), and the
    # stop string or stop id's text kept at the output's end
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured output (docs/structured_output.md): OpenAI's response_format, vLLM's
    # structured_outputs, and vLLM's older guided_* spellings of the latter
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # the sampling surface (docs/sampling.md), exact under speculation
    n: int = 1  # choices per prompt, 1..MAX_N: choice j samples with seed + j
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    logit_bias: dict[str, Any] | None = None
    min_tokens: int | None = None  # vLLM extension
    logprobs_mode: str = "raw"  # xspec extension: "raw" (vLLM's default) or "processed"

    def logprob_count(self) -> int | None:
        """Alternatives per generated token the request asks for (None: no logprobs)."""
        return None

    def sampling(self) -> SamplingParams:
        """The request's :class:`~xspec.sampling.SamplingParams` (not yet checked)."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=as_logit_bias(self.logit_bias),
            min_tokens=self.min_tokens or 0,
            logprobs=self.logprob_count(),
            logprobs_mode=self.logprobs_mode,
        )

    def score_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt's logprobs, nothing generated."""
        return False

    def limit(self) -> tuple[str, int | None]:
        """The output length limit the request set, and the field it set it in."""
        return "max_tokens", self.max_tokens

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for each field the server refuses: out of range, refused
        by name at its value, or unknown. The sampling values are checked when the
        engine request is made (:class:`~xspec.sampling.SamplingParams`)."""
        out = []
        name, limit = self.limit()
        if limit is not None and limit < 1 and not self.score_only():
            out.append((name, f"{name} must be >= 1 (got {limit})"))
        if isinstance(self.n, bool) or not 1 <= self.n <= MAX_N:
            out.append(("n", f"n must be an integer in [1, {MAX_N}] (got {self.n})"))
        if (k := self.logprob_count()) is not None and not 0 <= k <= MAX_LOGPROBS:
            field = "logprobs" if self.kind == "completions" else "top_logprobs"
            out.append((field, f"{field} must be in [0, {MAX_LOGPROBS}] (got {k})"))
        if self.stream_options is not None and not self.stream:
            out.append(("stream_options", "stream_options is only allowed with stream: true"))
        ids = self.stop_token_ids or []
        if len(ids) > MAX_STOP_IDS or any(i < 0 for i in ids):
            out.append(("stop_token_ids", f"stop_token_ids: at most {MAX_STOP_IDS} token ids, "
                        f"each >= 0 (got {len(ids)}, min {min(ids)})"))  # fmt: skip
        return out + extra_problems(self.model_extra or {}, REFUSED[self.kind])

    def grammar_spec(self) -> GrammarSpec | None:
        """The request's output constraint (None: free text); RequestError names the
        field. ``guided_json`` and friends are vLLM's older names of ``structured_outputs``'
        keys, one of either."""
        guided = {
            key: value
            for key, value in (
                ("json", self.guided_json),
                ("regex", self.guided_regex),
                ("choice", self.guided_choice),
                ("grammar", self.guided_grammar),
            )
            if value is not None
        }
        structured = self.structured_outputs
        if guided:
            if structured is not None:
                raise RequestError("set structured_outputs or the guided_* fields, not both")
            structured = guided
        return request_spec(self.response_format, structured)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if any(not s for s in stops):
            raise RequestError("stop: empty strings cannot end an output; remove them")
        return stops


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text or token ids (one prompt)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    # the legacy logprobs: top-k alternatives per token (0: the chosen token's only)
    logprobs: StrictInt | None = None
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's)

    def logprob_count(self) -> int | None:
        return self.logprobs

    def score_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def sampling(self) -> SamplingParams:
        params = super().sampling()
        if self.echo and self.logprobs is not None:  # the prompt's logprobs too
            return dataclasses.replace(params, prompt_logprobs=self.logprobs)
        return params

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts, one choice each: a text, token ids, or a list of either
        (as lm-evaluation-harness batches them)."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        if len(p) > MAX_PROMPTS:
            raise RequestError(
                f"prompt: a list of {len(p)} prompts; at most {MAX_PROMPTS} a request, send "
                "the others in more requests"
            )
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    kind: ClassVar[str] = "chat"

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    # tool calling (docs/chat.md): OpenAI function specs, auto / required / none / a name
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: int | None = None  # alternatives per token, with logprobs: true
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (enable_thinking)
    # xspec extension: with a thinking mode on, at most this many characters of reasoning
    # before </think> is forced (docs/chat.md)
    max_reasoning_chars: StrictInt | None = None

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def thinking(self) -> bool:
        """A thinking mode is on (DeepSeek-V4's ``thinking``, Qwen3's ``enable_thinking``)."""
        options = self.chat_template_kwargs or {}
        return any(options.get(k) is True for k in ("thinking", "enable_thinking"))

    def problems(self) -> list[tuple[str, str]]:
        out = super().problems()
        if self.top_logprobs is not None and not self.logprobs:
            out.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if (bound := self.max_reasoning_chars) is not None:
            if not 0 <= bound <= MAX_REASONING_CHARS:
                out.append(("max_reasoning_chars", "max_reasoning_chars must be in "
                            f"[0, {MAX_REASONING_CHARS}] (got {bound})"))  # fmt: skip
            elif not self.thinking():
                out.append(("max_reasoning_chars", "max_reasoning_chars bounds the reasoning "
                            "of a thinking mode; set chat_template_kwargs thinking (or "
                            "enable_thinking) to true, or leave it out"))  # fmt: skip
        return out

    def limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().limit()


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): a ``prompt`` (with the tokenizer's special
    tokens unless ``add_special_tokens`` is false) or chat ``messages`` (the ids
    ``/v1/chat/completions`` would generate from)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def problems(self) -> list[tuple[str, str]]:
        if (self.prompt is None) == (self.messages is None):
            return [("prompt", "give either prompt (a text) or messages (a chat)")]
        if self.return_token_strs:
            return [("return_token_strs", "return_token_strs: not supported; leave it false")]
        if self.messages is not None:
            if not self.add_generation_prompt:
                return [("add_generation_prompt", "add_generation_prompt: only true is "
                         "supported (the chat endpoint's prompt)")]  # fmt: skip
            if self.add_special_tokens is not None:
                return [("add_special_tokens", "add_special_tokens: the chat's ids are the "
                         "chat endpoint's; leave it unset")]  # fmt: skip
        return []


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): ``tokens`` -> ``{"prompt": text}``."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


ErrorType = Literal[
    "invalid_request_error", "not_found_error", "server_error", "overloaded_error", "timeout"
]


def error_body(message: str, type_: ErrorType, *, param: str | None = None, code: int) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
