"""The OpenAI request bodies xspec serves, as pydantic models, and the error body.

Fields follow OpenAI's API reference (``/v1/completions``, ``/v1/chat/completions``) with
vLLM's extensions that load generators send (``top_k``, ``ignore_eos``). A field xspec
cannot honour (``n > 1``, ``logprobs``, ``best_of``, ``echo``, tools, ``response_format``,
``logit_bias``, the penalties, ``min_tokens``, ``min_p``) is refused with a 400 naming it
rather than ignored: a client must not believe it got what it asked for; its neutral value
(0, empty, ``{"type": "text"}``) changes nothing and is accepted. Unknown extra fields are
ignored, as OpenAI's server does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from xspec.errors import RequestError


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # vLLM extension; 0 or -1 = off
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension (benchmarks decode to max_tokens)
    logprobs: Any = None
    user: str | None = None
    # refused unless unset (null) or neutral: xspec samples without them
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM extension
    min_p: float | None = None  # vLLM extension
    min_tokens: int | None = None  # vLLM extension

    def limit(self) -> tuple[str, int | None]:
        """The output length limit the request set, and the field it set it in."""
        return "max_tokens", self.max_tokens

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for each field set to something xspec cannot honour."""
        out = []
        if self.n != 1:
            out.append(("n", f"n={self.n}: xspec generates one choice per request (n=1)"))
        if self.logprobs not in (None, False):
            out.append(("logprobs", "logprobs: not supported; leave it unset"))
        kind = (self.response_format or {"type": "text"}).get("type")
        if kind != "text":
            out.append(("response_format", f"response_format type {kind!r}: structured output "
                        'is not supported; leave it unset or {"type": "text"}'))  # fmt: skip
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias: not supported; leave it unset or empty"))
        for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0),
                              ("repetition_penalty", 1), ("min_p", 0), ("min_tokens", 0)):  # fmt: skip
            value = getattr(self, name)
            if value not in (None, neutral):
                out.append((name, f"{name}={value}: not supported; leave it unset or {neutral}"))
        return out

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
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo:
            out.append(("echo", "echo: not supported"))
        if self.best_of not in (None, 1):
            out.append(("best_of", f"best_of={self.best_of}: not supported"))
        if self.suffix:
            out.append(("suffix", "suffix: not supported"))
        return out

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request (a batch of prompts is refused)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise RequestError(
                    f"prompt: a list of {len(p)} prompts; xspec takes one prompt per request "
                    "(send them as separate requests)"
                )
            return p[0]
        return p  # type: ignore[return-value]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension (enable_thinking)

    def limit(self) -> tuple[str, int | None]:
        if self.max_completion_tokens is not None:  # OpenAI's newer name wins
            return "max_completion_tokens", self.max_completion_tokens
        return super().limit()

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.tools:
            out.append(("tools", "tools: tool calling is not supported"))
        return out


ErrorType = Literal[
    "invalid_request_error", "not_found_error", "server_error", "overloaded_error", "timeout"
]


def error_body(message: str, type_: ErrorType, *, param: str | None = None, code: int) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
