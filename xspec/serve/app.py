"""The FastAPI application: OpenAI's completions and chat endpoints over an
:class:`~xspec.engine.loop.EngineLoop`.

Each request is checked, turned into an engine :class:`~xspec.engine.engine.Request`
and submitted; the loop thread hands its deltas to an ``asyncio.Queue`` of the request's
handler (through the event loop's :class:`_Mailbox`: one wake-up per step), which
answers with one JSON body or a Server-Sent Events stream (``data: {chunk}`` per step
that added text, then ``data: [DONE]``).
A client that disconnects aborts its request (its memory returns to the pool at the next
step); a request running past ``server.request_timeout_s`` is aborted too.

Nothing slow runs on the event loop: a chat template renders in its own process
(:mod:`xspec.chat.renderer`, awaited from a worker thread), and a text prompt is
tokenized on a worker thread, after a prompt longer than the context can hold in bytes
(``max_context`` x the tokenizer's longest token) was refused without tokenizing it.

Status codes: 400 a request the engine cannot take (bad values, a prompt or
``max_tokens`` past the context, refused or unknown fields (:mod:`xspec.serve.protocol`),
an empty body, a chat template that refused the messages or ran past its limits), 404 an unknown model or path, 408 a request
that did not arrive within ``server.read_timeout_s`` (:mod:`xspec.serve.http`), 413 a body
over ``server.max_body_bytes``, 422 a body of the wrong shape (a field of the wrong type,
a missing field), 503 a full queue (with ``Retry-After``), too many connections or a
stopped engine, 504 the request timeout. Every error uses OpenAI's body
(:func:`~xspec.serve.protocol.error_body`), ``param`` naming the request's field at fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xspec.acceptance import SpecCounts
from xspec.build import Built
from xspec.chat import (
    ChatFormat,
    ChatTemplate,
    chat_prompt,
    encode_chat_prompt,
    jinja,
    load_chat_template,
)
from xspec.chat.reasoning import ReasoningStream, reasoning_opened, split_reasoning
from xspec.chat.renderer import RenderLimits, TemplateRenderer
from xspec.chat.tool_grammar import ToolPlan, plan_tools
from xspec.chat.tools import ToolCallStream
from xspec.config import RunConfig
from xspec.engine.engine import Delta, Engine, Generation, seeded
from xspec.engine.engine import Request as EngineRequest
from xspec.engine.loop import EngineLoop, LoopStopped, QueueFull
from xspec.errors import RequestError
from xspec.grammar import Grammar, GrammarCompiler, GrammarSpec
from xspec.run.exporter import RequestMetrics
from xspec.sampling import SamplingParams
from xspec.serve.logprobs import CompletionLogprobs, chat_logprobs
from xspec.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ErrorType,
    TokenizeRequest,
    _Sampling,
    error_body,
)
from xspec.serve.text import TextStream
from xspec.version import __version__

RETRY_AFTER_S = 1  # what a 503 for a full queue tells the client to wait
DISCONNECT_POLL_S = 0.5  # how often a plain (not streamed) request checks for its client
FREE_TEXT = r"(?s:.*)"  # the answer of a thinking request with a reasoning bound only
T = TypeVar("T")


@dataclass
class ServeContext:
    """What the handlers need: the loop, the tokenizer's two functions, the chat
    template, names and limits."""

    loop: EngineLoop
    encode: Callable[..., list[int]]  # (text, special=True): the tokenizer's
    decode: Callable[[list[int]], str]
    # (messages, template options, tools) -> prompt text
    chat_text: Callable[[list[dict[str, Any]], dict[str, Any], list[dict[str, Any]] | None], str]
    chat_encode: Callable[[str], list[int]]  # that text -> ids
    model_name: str
    spec: str
    max_context: int
    vocab_size: int
    max_token_bytes: int | None  # the tokenizer's bound (None: none, text is always tokenized)
    default_max_tokens: int
    max_body_bytes: int
    request_timeout_s: float
    metrics: RequestMetrics
    renderer: TemplateRenderer | None = None
    grammars: GrammarCompiler | None = None  # structured output: compiles request grammars
    template: ChatTemplate | None = None  # the chat template (its tool-call format)
    # chat templates render one at a time (one renderer process): their waits queue here,
    # not in the default pool that tokenizes
    render_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="xspec-chat")
    )

    def chat_ids(self, messages: list[dict[str, Any]], options: dict[str, Any]) -> list[int]:
        """The prompt ids of a chat request (blocking: the handlers call its two halves
        off the event loop)."""
        return self.chat_encode(self.chat_text(messages, options, None))

    @property
    def max_prompt_bytes(self) -> int | None:
        """Text longer than this (UTF-8 bytes) cannot fit the context in any tokenization."""
        return None if self.max_token_bytes is None else self.max_context * self.max_token_bytes

    def close(self) -> None:
        """Close the loop and stop the chat template's renderer."""
        self.loop.close()
        if self.renderer is not None:
            self.renderer.close()
        self.render_pool.shutdown(wait=False)


def warm_up(engine: Engine) -> None:
    """One short generation before serving (first-call costs: kernels, allocations);
    its counters are dropped. Under torchrun every rank runs it together."""
    engine.run([EngineRequest([1, 2, 3, 4], 4, SamplingParams(), ignore_eos=True)], 1)
    engine.reset_metrics()


def start_chat(
    cfg: RunConfig, checkpoint_dir: Path | None
) -> tuple[ChatTemplate, TemplateRenderer | None]:
    """The model's chat template, and for a Jinja one its renderer process, started and
    compiled here (a :class:`~xspec.errors.CheckpointError` when the template cannot be
    used). ``python -m xspec.serve`` calls it before loading the model."""
    template = load_chat_template(cfg.model, checkpoint_dir)
    if template.format is not ChatFormat.jinja:
        return template, None
    limits = RenderLimits(cfg.server.template_timeout_s, cfg.server.template_memory_mib)
    return template, TemplateRenderer(template, limits)


def context(
    cfg: RunConfig,
    built: Built,
    model_option: str,
    chat: tuple[ChatTemplate, TemplateRenderer | None] | None = None,
) -> ServeContext:
    """The handlers' context for a built run and its ``server`` config (the loop is
    created, not started). ``chat``: :func:`start_chat`'s result (None: started here)."""
    s = cfg.server
    loop = EngineLoop(
        built.engine,
        concurrency=s.concurrency,
        max_queue=s.max_queue,
        parallel=built.parallel,
        # an idle rank 0 still broadcasts this often: well inside parallel.timeout_s
        idle_tick_s=max(0.05, min(1.0, cfg.parallel.timeout_s / 10)),
    )
    metrics = RequestMetrics()
    metrics.follow(built.engine)
    template, renderer = chat or start_chat(cfg, built.target.checkpoint_dir)
    tokenizer, max_context = built.tokenizer, built.target.max_context
    max_token_bytes = tokenizer.max_token_bytes
    # a rendered prompt is cut where no tokenization could fit it in the context
    max_chars = jinja.MAX_ITEMS if max_token_bytes is None else max_context * max_token_bytes

    def chat_text(
        messages: list[dict[str, Any]], options: dict[str, Any], tools: list[dict[str, Any]] | None
    ) -> str:
        return chat_prompt(
            messages, template=template, options=options, renderer=renderer,
            max_chars=max_chars, tools=tools,
        )  # fmt: skip

    def chat_encode(text: str) -> list[int]:
        return encode_chat_prompt(text, template=template, tokenizer=tokenizer)

    return ServeContext(
        loop=loop,
        encode=tokenizer.encode,
        decode=tokenizer.decode,
        chat_text=chat_text,
        chat_encode=chat_encode,
        model_name=s.served_model_name or model_option,
        spec=cfg.spec.method,
        max_context=max_context,
        vocab_size=built.target.vocab_size,
        max_token_bytes=max_token_bytes,
        default_max_tokens=s.default_max_tokens,
        max_body_bytes=s.max_body_bytes,
        request_timeout_s=s.request_timeout_s,
        metrics=metrics,
        renderer=renderer,
        grammars=built.grammars,
        template=template,
    )


def asgi_app(ctx: ServeContext) -> BodyLimit:
    """The application uvicorn serves: the endpoints behind the body-size limit."""
    return BodyLimit(make_app(ctx), ctx.max_body_bytes)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: ErrorType, param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param


def _error(
    status: int, message: str, type_: ErrorType, param: str | None = None, **kw: Any
) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param=param, code=status), status, **kw)


class BodyLimit:
    """ASGI wrapper: a POST body is read whole (at most ``limit`` bytes, else 413 before
    the application sees it) and replayed to the application; later ``receive`` calls
    pass through (the handlers' disconnect checks)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers", [])).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(int(length), scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._too_large(size, scope, receive, send)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    async def _too_large(self, size: int, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body of {size} bytes exceeds server.max_body_bytes={self.limit}"
        response = _error(413, message, "invalid_request_error")
        await response(scope, receive, send)


def make_app(ctx: ServeContext) -> FastAPI:
    app = FastAPI(title="xspec", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if e.status == 503 else None
        return _error(e.status, str(e), e.type, e.param, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = e.errors()
        first = errors[0] if errors else {}
        # param: the request's top-level field (deeper parts name pydantic's union members)
        where = next((str(x) for x in first.get("loc", ()) if x != "body"), "")
        if first.get("type") == "json_invalid":
            return _error(
                400, f"the body is not valid JSON: {first.get('msg')}", "invalid_request_error"
            )
        if first.get("type") == "missing" and tuple(first.get("loc", ())) == ("body",):
            return _error(  # as OpenAI: 400, not a validation error
                400, 'the body is empty; send a JSON object such as {"model": ..., ...}',
                "invalid_request_error",
            )  # fmt: skip
        text = "; ".join(
            f"{'.'.join(str(x) for x in err.get('loc', ()) if x != 'body') or 'body'}: {err.get('msg')}"
            for err in errors[:5]
        )
        return _error(422, f"invalid request body: {text}", "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_: ErrorType = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error(e.status_code, str(e.detail), type_)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        if not ctx.loop.running:
            return _error(503, f"the engine is not running: {ctx.loop.failure}", "server_error")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(ctx)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        _known_model(ctx, model_id)
        return _model_card(ctx)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        if body.model is not None:
            _known_model(ctx, body.model)
        if problems := body.problems():
            raise ApiError(400, problems[0][1], "invalid_request_error", problems[0][0])
        if body.prompt is not None:
            text, special = body.prompt, body.add_special_tokens is not False
            ids = await _off_loop(
                None,
                "prompt",
                lambda: _tokens(ctx, text, lambda t: ctx.encode(t, special), "prompt"),
            )
        else:
            ids = await _chat_ids(ctx, body.messages or [], body.chat_template_kwargs)
        return {"count": len(ids), "max_model_len": ctx.max_context, "tokens": ids}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        """vLLM's shape, what lm-evaluation-harness's remote tokenizer
        (``tokenizer_backend=remote``) reads before it tokenizes through /tokenize and
        /detokenize. The special tokens have no text here (they are ids: the stop ids
        end an output server-side), so they are null."""
        return {
            "tokenizer_class": "xspec",
            "eos_token": None,
            "bos_token": None,
            "pad_token": None,
            "model_max_length": ctx.max_context,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        if body.model is not None:
            _known_model(ctx, body.model)
        if bad := [t for t in body.tokens if not 0 <= t < ctx.vocab_size]:
            raise ApiError(
                400, f"tokens: ids outside the vocabulary [0, {ctx.vocab_size}): {bad[:8]}",
                "invalid_request_error", "tokens",
            )  # fmt: skip
        tokens = body.tokens
        return {
            "prompt": await asyncio.get_running_loop().run_in_executor(None, ctx.decode, tokens)
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _checked(ctx, body)
        prompts = _as_400(body.prompts, "prompt")  # one choice per prompt
        for i, p in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise ApiError(
                    400, f"{where}: empty; give some text or token ids", "invalid_request_error",
                    "prompt",
                )  # fmt: skip
            if isinstance(p, list) and len(p) > ctx.max_context:  # before the engine reads them
                raise ApiError(
                    400, f"{where}: {len(p)} token ids, more than the model context of "
                    f"{ctx.max_context} tokens; shorten it", "invalid_request_error", "prompt",
                )  # fmt: skip

        def ids() -> list[list[int]]:
            return [
                list(p) if isinstance(p, list) else _tokens(ctx, p, ctx.encode, "prompt")
                for p in prompts
            ]

        grammar = await _grammar(ctx, body)
        prompt_ids = await _off_loop(None, "prompt", ids)
        echo = None
        if body.echo:  # each prompt's text as given (token ids: their decoding)
            echo = [p if isinstance(p, str) else ctx.decode(list(p)) for p in prompts]
        return await _serve(ctx, request, body, prompt_ids, chat=False, grammar=grammar, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _checked(ctx, body)
        field = "response_format" if body.response_format is not None else "structured_outputs"
        spec = _as_400(body.grammar_spec, field)
        plan = await _tool_plan(ctx, body)
        if plan is not None and plan.grammar is not None:
            if spec is not None:
                raise ApiError(
                    400, "tools (with tool_choice other than none) and response_format / "
                    "structured_outputs both constrain the reply; send one of them",
                    "invalid_request_error", "tools",
                )  # fmt: skip
            spec, field = plan.grammar, "tools"
        tools = plan.tools if plan is not None else None
        text, ids = await _chat_prompt(ctx, body.messages, body.chat_template_kwargs, tools)
        thinking = body.thinking()
        if thinking and (spec is not None or body.max_reasoning_chars is not None):
            # the grammar applies after the reasoning; a bound alone: free text after it
            answer = spec if spec is not None else GrammarSpec.regex(FREE_TEXT)
            opened = reasoning_opened(ctx.template, text)
            spec = answer.after_reasoning(opened=opened, max_chars=body.max_reasoning_chars)
        grammar = None if spec is None else await _compiled(ctx, spec, field)
        return await _serve(
            ctx, request, body, [ids], chat=True, grammar=grammar, tools=plan, thinking=thinking
        )

    return app


async def _tool_plan(ctx: ServeContext, body: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tools read once (:func:`~xspec.chat.tool_grammar.plan_tools`): the
    tools its prompt shows, its call grammar (with a thinking mode on, the chat handler
    puts the reasoning before it), its output parser; None: no tools."""
    if body.tools is None and body.tool_choice is None:
        return None
    template = ctx.template
    if template is None:
        raise ApiError(
            400, "tools: this server has no chat template", "invalid_request_error", "tools"
        )
    field = "tool_choice" if body.tools is not None and body.tool_choice is not None else "tools"
    return await _off_loop(
        None,
        field,
        lambda: plan_tools(template, body.tools, body.tool_choice, body.parallel_tool_calls),
    )


def _model_card(ctx: ServeContext) -> dict:
    return {
        "id": ctx.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "xspec",
        "max_model_len": ctx.max_context,
    }


def _known_model(ctx: ServeContext, name: str) -> None:
    if name != ctx.model_name:
        raise ApiError(
            404,
            f"model {name!r} does not exist; this server serves {ctx.model_name!r}",
            "not_found_error",
            "model",
        )


async def _chat_ids(
    ctx: ServeContext,
    messages: list[ChatMessage],
    options: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt ids of a chat's messages (rendered, then tokenized, off the event loop).
    OpenAI's ``developer`` role is its newer name for ``system``, and is rendered as one."""
    return (await _chat_prompt(ctx, messages, options, tools))[1]


async def _chat_prompt(
    ctx: ServeContext,
    messages: list[ChatMessage],
    options: dict[str, Any] | None,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, list[int]]:
    """:func:`_chat_ids` with the rendered text."""
    dumped = [m.model_dump(exclude_none=True) for m in messages]
    dumped = [m | {"role": "system"} if m.get("role") == "developer" else m for m in dumped]
    kwargs = options or {}
    text = await _off_loop(
        ctx.render_pool, "messages", lambda: ctx.chat_text(dumped, kwargs, tools)
    )
    ids = await _off_loop(
        None, "messages", lambda: _tokens(ctx, text, ctx.chat_encode, "the rendered chat")
    )
    return text, ids


def _checked(ctx: ServeContext, body: _Sampling) -> None:
    """The request's model and fields checked (404, 400: :meth:`_Sampling.problems`)."""
    _known_model(ctx, body.model)
    if problems := body.problems():
        text = "; ".join(why for _, why in problems)
        raise ApiError(400, text, "invalid_request_error", problems[0][0])
    _sampling(body)  # before the prompt is tokenized


def _as_400(fn: Callable[[], T], param: str) -> T:
    """``fn()``; its RequestError is a 400 naming the request's field ``param``."""
    try:
        return fn()
    except RequestError as e:
        raise ApiError(400, str(e), "invalid_request_error", param) from None


async def _off_loop(pool: ThreadPoolExecutor | None, param: str, fn: Callable[[], T]) -> T:
    """:func:`_as_400` on a worker thread of ``pool`` (None: asyncio's default), so the
    event loop serves the other requests meanwhile."""
    return await asyncio.get_running_loop().run_in_executor(pool, _as_400, fn, param)


def _tokens(
    ctx: ServeContext, text: str, encode: Callable[[str], list[int]], what: str
) -> list[int]:
    """``text``'s ids; refused before tokenizing when it has more bytes than the context
    can hold (a character is at least one byte: the length in characters decides the
    largest texts without encoding them)."""
    bound = ctx.max_prompt_bytes
    if bound is not None and (
        len(text) > bound or len(text.encode("utf-8", "surrogatepass")) > bound
    ):
        raise RequestError(
            f"{what} is longer than {bound} bytes of text, more than the model context of "
            f"{ctx.max_context} tokens can hold (a token of this tokenizer covers at most "
            f"{ctx.max_token_bytes} bytes); shorten it"
        )
    return encode(text)


async def _grammar(ctx: ServeContext, body: _Sampling) -> Grammar | None:
    """The request's compiled output grammar (None: free text), compiled off the event
    loop (a large schema takes a while; the compiled grammar is cached); a 400 names the
    field that asked for it."""
    field = "response_format" if body.response_format is not None else "structured_outputs"
    spec = _as_400(body.grammar_spec, field)
    return None if spec is None else await _compiled(ctx, spec, field)


async def _compiled(ctx: ServeContext, spec: GrammarSpec, field: str) -> Grammar:
    """``spec`` compiled off the event loop (a large schema takes a while; compiled
    grammars are cached); its errors are 400s naming ``field``."""
    grammars = ctx.grammars
    if grammars is None:
        raise ApiError(
            400, f"{field}: this server has no grammar compiler", "invalid_request_error", field
        )
    return await _off_loop(None, field, lambda: grammars.compile(spec))


def _engine_request(
    ctx: ServeContext,
    body: _Sampling,
    ids: list[int],
    grammar: Grammar | None = None,
    choice: int = 0,
) -> EngineRequest:
    """Choice ``choice`` of the prompt ``ids`` (it samples with ``seed + choice``). A
    score-only request generates one token, which the reply drops."""
    _, limit = body.limit()
    max_tokens = ctx.default_max_tokens if limit is None else limit
    if limit is None:  # the default shrinks to what the context leaves
        max_tokens = max(1, min(max_tokens, ctx.max_context - len(ids) - 8))
    params = _sampling(body)
    if body.score_only():
        max_tokens, params = 1, dataclasses.replace(params, min_tokens=0)
    stop = _as_400(body.stop_list, "stop")
    return EngineRequest(
        ids, max_tokens, seeded(params, choice), body.ignore_eos, stop=stop,
        stop_token_ids=frozenset(body.stop_token_ids or ()),
        include_stop_str=body.include_stop_str_in_output, grammar=grammar,
    )  # fmt: skip


def _sampling(body: _Sampling) -> SamplingParams:
    """The request's sampling parameters (400 naming the first bad one)."""
    params = body.sampling()
    if problems := [p.replace("sampling.", "", 1) for p in params.problems()]:
        raise ApiError(400, "; ".join(problems), "invalid_request_error", problems[0].split()[0])
    return params


def _refused(e: RequestError, body: _Sampling, chat: bool) -> ApiError:
    """The engine's refusal (ids outside the vocabulary, past the context or the memory
    plan) in the request's own words: its length field, not the engine's
    ``max_new_tokens``, and ``param`` on the field to change."""
    name, limit = body.limit()
    text = str(e).replace("request: ", "", 1).replace("max_new_tokens", name)
    prompt = "messages" if chat else "prompt"
    # past the context: the length field when the client set it (the default shrinks)
    param = name if limit is not None and name in text else prompt
    param = next((f for f in ("logit_bias", "min_tokens") if text.startswith(f)), param)
    return ApiError(400, text, "invalid_request_error", param)


async def _serve(
    ctx: ServeContext,
    request: Request,
    body: _Sampling,
    prompts: list[list[int]],
    *,
    chat: bool,
    grammar: Grammar | None = None,
    echo: list[str] | None = None,  # completions with echo: each prompt's text
    tools: ToolPlan | None = None,  # chat with tools: the reply's calls are parsed out
    thinking: bool = False,  # chat with a thinking mode on: the reasoning is split off
) -> Response:
    """Submit one engine request per choice (prompt ``i``'s ``n`` choices are ``i * n ..
    i * n + n - 1``, submitted as one engine group: the prompt is prefilled once) and
    answer with their choices, streamed or in one body."""
    n = body.n
    reqs = [_engine_request(ctx, body, ids, grammar, j) for ids in prompts for j in range(n)]
    echoes = None if echo is None else [e for e in echo for _ in range(n)]
    queue: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()
    mailbox = _mailbox(asyncio.get_running_loop())

    def poster(index: int) -> Callable[[Delta], None]:
        def on_delta(d: Delta) -> None:
            if body.stream or d.finished:  # a plain request waits for its last delta only
                mailbox.post(queue, (index, d))

        return on_delta

    rids: list[int] = []
    groups = [ctx.loop.new_group() if n > 1 else None for _ in prompts]
    try:
        for i, req in enumerate(reqs):
            rids.append(ctx.loop.submit(req, poster(i), groups[i // n]))
    except (RequestError, QueueFull, LoopStopped) as e:
        for rid in rids:  # all the choices or none
            ctx.loop.abort(rid)
        if isinstance(e, QueueFull):
            raise ApiError(503, f"the server is busy: {e}", "overloaded_error") from None
        if isinstance(e, LoopStopped):
            raise ApiError(503, f"the engine is not running: {e}", "server_error") from None
        raise _refused(e, body, chat) from None
    reply = _Reply(ctx, body, reqs, chat, rids, echo=echoes, tools=tools, thinking=thinking)
    if body.stream:
        return StreamingResponse(
            _sse(ctx, request, queue, reply),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        gens = await _wait(ctx, request, queue, reply)
    finally:
        for rid in rids:
            ctx.loop.abort(rid)  # no-op once it ended; a cancelled handler frees its slot
    if gens is None:  # the client left: nobody reads this
        return Response(status_code=499)
    return JSONResponse(reply.whole(gens))


class _Mailbox:
    """Deltas from the engine's thread to the request queues of one event loop, with
    one wake-up of the event loop per burst (a step hands over all its deltas at once)
    instead of one per delta: fewer self-pipe writes and GIL hand-offs while the engine
    steps."""

    def __init__(self, aio: asyncio.AbstractEventLoop) -> None:
        self._aio = weakref.ref(aio)  # not a strong one: the loop keys _MAILBOXES
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue[Any], Any]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """From any thread: ``item`` (a delta) goes to ``queue`` on the event loop's thread."""
        with self._lock:
            self._items.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        aio = self._aio()
        if aio is None:  # the event loop is gone: nobody reads these
            return
        try:
            aio.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # closed: later posts must try again (and fail alike)
            with self._lock:
                self._scheduled = False
            raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items, self._scheduled = self._items, [], False
        for queue, item in items:
            queue.put_nowait(item)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Mailbox] = (
    weakref.WeakKeyDictionary()
)


def _mailbox(aio: asyncio.AbstractEventLoop) -> _Mailbox:
    """The event loop's mailbox (made on its first request, on its own thread)."""
    box = _MAILBOXES.get(aio)
    if box is None:
        box = _MAILBOXES[aio] = _Mailbox(aio)
    return box


async def _wait(
    ctx: ServeContext,
    request: Request,
    queue: asyncio.Queue[tuple[int, Delta] | None],
    reply: _Reply,
) -> list[Generation] | None:
    """The finished generations, one per choice (None: the client disconnected first).
    Only the final delta of each is posted for a plain request; meanwhile the client is
    checked every :data:`DISCONNECT_POLL_S`."""
    deadline = time.monotonic() + ctx.request_timeout_s
    gens: dict[int, Generation] = {}
    while len(gens) < len(reply.reqs):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ApiError(
                504,
                f"the request ran past server.request_timeout_s={ctx.request_timeout_s:g}",
                "timeout",
            )
        try:
            item = await asyncio.wait_for(queue.get(), timeout=min(left, DISCONNECT_POLL_S))
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                return None
            continue
        if item is not None and item[1].finished:
            gen = gens[item[0]] = item[1].generation
            if gen.finish_reason == "error":  # the others are aborted by the caller
                reply.done(list(gens.values()))
                raise ApiError(500, gen.error or "the request failed", "server_error")
    out = [gens[i] for i in range(len(reply.reqs))]
    reply.done(out)
    return out


async def _sse(
    ctx: ServeContext,
    request: Request,
    queue: asyncio.Queue[tuple[int, Delta] | None],
    reply: _Reply,
) -> AsyncIterator[str]:
    """The SSE body; when the client goes away Starlette cancels it and ``finally``
    aborts the request. Each choice's chunks carry its ``index``; the usage chunk (summed
    over the choices) and ``[DONE]`` follow the last choice's end."""
    # One timer for the whole stream puts None (timed out) in the queue: no timeout
    # wrapper, task or timer per delta on this hot path.
    aio = asyncio.get_running_loop()
    timer = aio.call_later(ctx.request_timeout_s, queue.put_nowait, None)
    texts = [TextStream(ctx.decode, req.stop) for req in reply.reqs]
    gens: dict[int, Generation] = {}
    try:
        if reply.chat:
            for i in range(len(reply.reqs)):
                yield _data(reply.chunk(i, {"role": "assistant", "content": ""}, None))
        while len(gens) < len(reply.reqs):
            item = await queue.get()
            if item is None:
                yield _data(
                    error_body(
                        f"the request ran past server.request_timeout_s={ctx.request_timeout_s:g}",
                        "timeout",
                        code=504,
                    )
                )
                break
            i, d = item
            reply.live[i] = d.generation
            tokens = [] if reply.score_only else d.token_ids
            if d.finished:  # the final text, cut before a stop string its tokens completed
                gen = gens[i] = d.generation
                if gen.finish_reason == "error":
                    yield _data(error_body(gen.error or "failed", "server_error", code=500))
                    break
                piece = "" if reply.score_only else texts[i].finish(reply.final_text(i, gen))
                piece, lps = reply.streamed(i, d, tokens, piece)
                for c in reply.text_chunks(i, piece, reply.finish_reason(gen), lps):
                    yield _data(c)
                continue
            piece, lps = reply.streamed(i, d, tokens, texts[i].push(tokens))
            for c in reply.text_chunks(i, piece, None, lps):
                yield _data(c)
        reply.done(list(gens.values()))
        ended = all(gens.get(i) and gens[i].finish_reason != "error" for i in range(len(texts)))
        if ended and reply.include_usage:
            yield _data(reply.usage_chunk([gens[i] for i in range(len(texts))]))
        yield "data: [DONE]\n\n"
    finally:
        timer.cancel()
        for rid in reply.rids:
            ctx.loop.abort(rid)


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Reply:
    """The OpenAI response objects of one request: choice ``i`` is engine request
    ``reqs[i]``."""

    def __init__(
        self,
        ctx: ServeContext,
        body: _Sampling,
        reqs: list[EngineRequest],
        chat: bool,
        rids: list[int],
        *,
        echo: list[str] | None = None,  # completions with echo: each choice's prompt text
        tools: ToolPlan | None = None,  # chat with tools: calls parsed out of each reply
        thinking: bool = False,  # chat in a thinking mode: reasoning split off each reply
    ):
        self.ctx, self.reqs, self.chat, self.rids = ctx, reqs, chat, rids
        self.n = body.n  # choices per prompt: reqs[i * n : i * n + n] share prompt i
        self.tools, self.thinking = tools, thinking
        self._tool_streams: dict[int, ToolCallStream] = {}
        self._reasoning: dict[int, ReasoningStream] = {}
        self.echo, self.score_only = echo, body.score_only()
        self.logprobs = body.logprob_count() is not None
        self._streams: dict[int, CompletionLogprobs] = {}  # per choice: its text offsets
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        # vLLM's continuous_usage_stats: every chunk carries the usage so far
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.live: dict[int, Generation] = {}  # each choice's live record, once it moved

    def done(self, gens: list[Generation]) -> None:
        self.ctx.metrics.observe(gens, self.ctx.model_name, self.ctx.spec)

    def final_text(self, i: int, gen: Generation) -> str:
        """The engine's text when it cut one (a stop string or stop id), else the ids'."""
        req = self.reqs[i]
        cut = (req.stop or req.stop_token_ids) and gen.finish_reason == "stop"
        return gen.text if cut else self.ctx.decode(gen.token_ids)

    def finish_reason(self, gen: Generation) -> str:
        """OpenAI's ``stop`` / ``length``, and ``abort`` (as vLLM) for a request the
        server ended (shutdown); a score-only request's is ``length``."""
        if self.score_only:
            return "length"
        return gen.finish_reason if gen.finish_reason in ("length", "abort") else "stop"

    def usage(self, gens: list[Generation] | dict[int, Generation]) -> dict:
        """``gens``: every choice's, or (streamed) those that moved by choice index. The
        completion tokens summed over the choices, the prompt counted once per prompt
        (as OpenAI and vLLM count it for ``n`` choices: it is prefilled once)."""
        live = dict(enumerate(gens)) if isinstance(gens, list) else gens
        n = self.n
        prompt = sum(len(r.prompt_ids) for r in self.reqs[::n])
        completion = 0 if self.score_only else sum(len(g.token_ids) for g in live.values())
        # a prompt's cached tokens: its first choice's lookup (the others copy its states)
        cached = sum(
            max((live[i].cached_tokens for i in range(p, p + n) if i in live), default=0)
            for p in range(0, len(self.reqs), n)
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # prompt tokens restored from the prefix cache (OpenAI's field)
            "prompt_tokens_details": {"cached_tokens": cached},
            # per request, as vLLM's --per-request-spec-decode-metrics; counted as the
            # Prometheus counters count (xspec.acceptance)
            "spec_decode": sum((g.spec for g in live.values()), SpecCounts()).usage(),
        }

    def _head(self) -> dict:
        return {
            "id": self.id,
            "object": ("chat.completion" if self.chat else "text_completion"),
            "created": self.created,
            "model": self.ctx.model_name,
        }

    def whole(self, gens: list[Generation]) -> dict:
        if failed := [g for g in gens if g.finish_reason == "error"]:
            raise ApiError(500, failed[0].error or "the request failed", "server_error")
        choices = []
        for i, gen in enumerate(gens):
            text = "" if self.score_only else self.final_text(i, gen)
            reason = self.finish_reason(gen)
            if self.chat:
                lps = chat_logprobs(self.ctx.decode, gen.logprobs or []) if self.logprobs else None
                message: dict[str, Any] = {"role": "assistant", "content": text}
                if self.thinking:  # vLLM's reasoning parsers' field; no </think>: no content
                    split = split_reasoning(text)
                    message["reasoning_content"], message["content"] = (
                        split.reasoning,
                        split.content,
                    )
                    text = split.content or ""
                if self.tools is not None and (text or not self.thinking):
                    parsed = self.tools.parse(text)
                    message["content"] = parsed.content or None
                    if parsed.tool_calls:
                        message["tool_calls"] = [c.openai() for c in parsed.tool_calls]
                        reason = "tool_calls" if reason == "stop" else reason
                choices.append({
                    "index": i, "message": message, "logprobs": lps, "finish_reason": reason,
                })  # fmt: skip
            else:
                text = (self.echo[i] if self.echo else "") + text
                lp = self._completion_logprobs(i, gen)
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason})
        return {**self._head(), "choices": choices, "usage": self.usage(gens)}

    def _completion_logprobs(self, i: int, gen: Generation) -> dict | None:
        """A whole choice's legacy logprobs: the echoed prompt's, then the output's."""
        if not self.logprobs:
            return None
        out = CompletionLogprobs(self.ctx.decode)
        parts = []
        if self.echo is not None:
            prompt = gen.prompt_ids
            parts.append(out.block(prompt, gen.prompt_logprobs or [None] * len(prompt)))
        if not self.score_only:
            parts.append(out.block(gen.token_ids, gen.logprobs or []))
        return {k: [x for p in parts for x in p[k]] for k in parts[0]} if parts else None

    def streamed(
        self, i: int, delta: Delta, tokens: list[int], piece: str
    ) -> tuple[str, dict | None]:
        """Choice ``i``'s chunk text and logprobs for a delta's ``tokens``; its first
        chunk leads with the echoed prompt (and its logprobs)."""
        first = i not in self._streams
        if first:
            self._streams[i] = CompletionLogprobs(self.ctx.decode)
        if self.echo is not None and first:
            piece = self.echo[i] + piece
        if not self.logprobs:
            return piece, None
        entries = (delta.logprobs or [])[: len(tokens)]
        if self.chat:
            return piece, chat_logprobs(self.ctx.decode, entries) if entries else None
        blocks = []
        out, gen = self._streams[i], delta.generation
        if self.echo is not None and first:
            prompt = gen.prompt_ids
            blocks.append(out.block(prompt, gen.prompt_logprobs or [None] * len(prompt)))
        if tokens:
            blocks.append(out.block(tokens, entries))
        if not blocks:
            return piece, None
        return piece, {k: [x for b in blocks for x in b[k]] for k in blocks[0]}

    def chunk(self, i: int, piece: str | dict, reason: str | None, lps: dict | None = None) -> dict:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
            delta = piece if isinstance(piece, dict) else ({"content": piece} if piece else {})
            choice: dict = {"index": i, "delta": delta, "finish_reason": reason}
            if self.logprobs:
                choice["logprobs"] = lps
        else:
            choice = {"index": i, "text": piece, "logprobs": lps, "finish_reason": reason}
        if self.continuous_usage and self.live:
            return {**head, "choices": [choice], "usage": self.usage(self.live)}
        return {**head, "choices": [choice]}

    def text_chunks(self, i: int, piece: str, reason: str | None, lps: dict | None) -> list[dict]:
        """Choice ``i``'s chunks for a piece of its text (``reason``: its last piece):
        in a thinking mode the reasoning first (``delta.reasoning_content``, no part of
        ``</think>`` released), then the content, as calls when the request has tools."""
        content = piece
        out = []
        if self.thinking:
            split = self._reasoning.get(i)
            if split is None:
                split = self._reasoning[i] = ReasoningStream()
            reasoning, content = split.feed(piece)
            if reason is not None:
                held, _ = split.finish()
                reasoning += held
            if reasoning:
                out.append(self.chunk(i, {"reasoning_content": reasoning}, None))
        if self.tools is not None:
            return out + self.tool_chunks(i, content, reason, lps)
        if content or lps is not None or reason is not None:
            out.append(self.chunk(i, content, reason, lps))
        return out

    def tool_chunks(self, i: int, piece: str, reason: str | None, lps: dict | None) -> list[dict]:
        """Choice ``i``'s chunks for a piece of its reply when it has tools: content and
        complete calls as the stream parser releases them (no part of a tag as content),
        logprobs in a chunk of their own, and with ``reason`` (its last piece) the end,
        ``tool_calls`` when calls came."""
        assert self.tools is not None
        stream = self._tool_streams.get(i)
        if stream is None:
            stream = self._tool_streams[i] = self.tools.stream()
        deltas = stream.feed(piece) if piece else []
        if reason is not None:
            deltas += stream.finish()
        out = [self.chunk(i, d, None) for d in deltas]
        if lps is not None:
            out.append(self.chunk(i, {}, None, lps))
        if reason is not None:
            out.append(
                self.chunk(i, {}, "tool_calls" if stream.calls and reason == "stop" else reason)
            )
        return out

    def usage_chunk(self, gens: list[Generation]) -> dict:
        head = self._head()
        if self.chat:
            head["object"] = "chat.completion.chunk"
        return {**head, "choices": [], "usage": self.usage(gens)}
