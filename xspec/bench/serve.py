"""Open-loop load against an OpenAI-compatible server (``python -m xspec.bench serve``).

Requests arrive on a schedule fixed in advance (Poisson, or all at once), whatever the
server's speed: a slow server sees requests pile up, as it would in production.
``max_concurrency`` caps the requests in flight; a request that arrives while the cap is
reached waits in the client, and its latencies count from the moment it is sent (as in
``vllm bench serve``).

Each request streams (``"stream": true``, ``stream_options.include_usage``); the client
reads the SSE ``data:`` lines until ``[DONE]``. A content chunk is one carrying text; a
speculative server may put several tokens in one chunk, so token counts come from the
final ``usage`` (``completion_tokens``), and inter-chunk gaps (ITL) stay per chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from xspec.bench.dataset import BenchRequest, LocalTokens, synthetic
from xspec.bench.stats import RequestOutcome, SpecCounts, summarize
from xspec.errors import UserError

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# where a server may put per-request speculative counts inside ``usage``
SPEC_KEYS = ("spec_decode", "speculative_decoding", "spec_decoding")


@dataclass(frozen=True)
class ServeConfig:
    base_url: str
    endpoint: str = "completions"  # a key of ENDPOINTS
    model: str | None = None  # None: the first id of GET /v1/models
    request_rate: float = float("inf")  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1: Poisson
    max_concurrency: int | None = None
    seed: int = 0
    timeout: float = 600.0  # seconds, one request from send to its last byte
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = (50, 90, 99)
    label: str | None = None


def arrival_schedule(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of ``n`` requests: the first at 0, then gaps
    drawn from a gamma distribution of mean ``1/rate`` and shape ``burstiness``
    (exponential, i.e. Poisson arrivals, at 1; below 1 burstier). ``rate`` inf: all at 0."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        if burstiness == 1.0:
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def spec_counts(usage: dict[str, Any]) -> SpecCounts | None:
    """Speculative counts from a response's ``usage``, in the shapes servers use:
    ``{num_drafts, num_draft_tokens, num_accepted_tokens}`` nested under one of
    :data:`SPEC_KEYS` or flat in ``usage``; or SGLang's ``spec_verify_ct`` (verify steps,
    each committing its accepted tokens + 1). ``None`` when absent."""
    src = next((usage[k] for k in SPEC_KEYS if isinstance(usage.get(k), dict)), usage)
    drafts, tokens, accepted = (
        src.get(k) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    )
    if isinstance(drafts, int) and isinstance(tokens, int) and isinstance(accepted, int):
        return SpecCounts(drafts, tokens, accepted)
    steps, out = usage.get("spec_verify_ct"), usage.get("completion_tokens")
    if isinstance(steps, int) and isinstance(out, int) and steps > 0:
        return SpecCounts(steps, None, max(out - steps, 0))
    return None


def request_body(cfg: ServeConfig, model: str, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # a vLLM/SGLang extension: exactly max_tokens tokens
    return body | cfg.extra_body


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if "delta" in c:  # chat: content, or a reasoning model's reasoning text
        d = c["delta"] or {}
        reasoning = d.get("reasoning_content") or d.get("reasoning") or ""
        return (d.get("content") or "") + reasoning
    return c.get("text") or ""


async def _lines(r: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The body's lines (without their ends) as they arrive, of any length."""
    buf = b""
    async for data in r.content.iter_any():
        buf += data
        *lines, buf = buf.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buf:
        yield buf


async def measure(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], req: BenchRequest
) -> RequestOutcome:
    """Send one streaming request and time its chunks (perf_counter seconds)."""
    out = RequestOutcome(prompt_len=req.prompt_len)
    usage: dict[str, Any] = {}
    chunks = 0
    sent = last = time.perf_counter()
    async with session.post(url, json=body) as r:
        if r.status != 200:
            text = (await r.read()).decode("utf-8", "replace").strip()
            out.error = f"HTTP {r.status}: {text[:300]}"
            return out
        async for line in _lines(r):
            if not line.startswith(b"data:"):
                continue  # blank separators, ": keep-alive" comments, event: lines
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out.error = f"server error in stream: {json.dumps(chunk['error'])[:300]}"
                return out
            now = time.perf_counter()
            if _chunk_text(chunk):
                if chunks == 0:
                    out.ttft = now - sent
                else:
                    out.itl.append(now - last)
                last = now
                chunks += 1
            usage = chunk.get("usage") or usage  # the last usage seen is the total
    if chunks == 0:
        out.error = "the stream carried no output text"
        return out
    out.e2el = last - sent
    completion = usage.get("completion_tokens")
    out.output_tokens = completion if isinstance(completion, int) else chunks
    prompt = usage.get("prompt_tokens")
    out.prompt_len = prompt if isinstance(prompt, int) else req.prompt_len
    out.spec = spec_counts(usage)
    out.success = True
    return out


async def first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(f"{base_url}/v1/models") as r:
            r.raise_for_status()
            return str((await r.json(content_type=None))["data"][0]["id"])
    except (
        aiohttp.ClientError,
        asyncio.TimeoutError,
        ValueError,
        KeyError,
        IndexError,
        TypeError,
    ) as e:
        raise UserError(
            f"{base_url}/v1/models did not name a model ({type(e).__name__}: {e}); pass --model"
        ) from None


class ServerTokens:
    """The server's own tokenizer, through vLLM's ``POST /tokenize`` and ``/detokenize``
    (xspec's and vLLM's servers have them)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str) -> None:
        self.session, self.base, self.model = session, base_url, model

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.base + path
        try:
            async with self.session.post(url, json={"model": self.model, **body}) as r:
                if r.status != 200:
                    text = (await r.read()).decode("utf-8", "replace")[:200]
                    raise UserError(
                        f"--input-len counts tokens, and {url} answered HTTP {r.status} "
                        f"({text}); pass --tokenizer PATH (the model's tokenizer.json)"
                    )
                return dict(await r.json(content_type=None))
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise UserError(f"{url}: {type(e).__name__}: {e}; pass --tokenizer PATH") from None

    async def encode(self, text: str, special: bool) -> list[int]:
        return list((await self._post("/tokenize", {"prompt": text,
                                                    "add_special_tokens": special}))["tokens"])  # fmt: skip

    async def decode(self, ids: list[int]) -> str:
        return str((await self._post("/detokenize", {"tokens": ids}))["prompt"])


async def synthetic_requests(
    cfg: ServeConfig, n: int, input_len: int, output_len: int, tokenizer: Path | None
) -> list[BenchRequest]:
    """:func:`~xspec.bench.dataset.synthetic` prompts counted with ``tokenizer`` (a
    ``tokenizer.json``), else with the server's ``/tokenize``."""
    if tokenizer is not None:
        return await synthetic(n, input_len, output_len, cfg.seed, LocalTokens(tokenizer))
    base = cfg.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        model = cfg.model or await first_model(session, base)
        return await synthetic(
            n, input_len, output_len, cfg.seed, ServerTokens(session, base, model)
        )


async def run_benchmark(cfg: ServeConfig, requests: list[BenchRequest]) -> dict[str, Any]:
    """Send ``requests`` on their arrival schedule; the result dict (keys of
    ``vllm bench serve --save-result`` and the speculative acceptance)."""
    base = cfg.base_url.rstrip("/")
    url = base + ENDPOINTS[cfg.endpoint]
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    cap = cfg.max_concurrency
    gate = asyncio.Semaphore(cap) if cap else None
    in_flight = peak = 0
    # aiohttp, as vllm bench serve: the load generator shares the machine with the
    # server it measures, and it reads a streamed chunk with about a third of the CPU
    # time httpx takes
    connector = aiohttp.TCPConnector(limit=cap or 0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, headers=headers
    ) as client:
        model = cfg.model or await first_model(client, base)

        async def one(req: BenchRequest) -> RequestOutcome:
            nonlocal in_flight, peak
            async with gate or contextlib.nullcontext():
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    body = request_body(cfg, model, req)
                    return await asyncio.wait_for(measure(client, url, body, req), cfg.timeout)
                except asyncio.TimeoutError:
                    return RequestOutcome(req.prompt_len, error=f"timed out after {cfg.timeout} s")
                except Exception as e:  # a failed request is a figure, not a crash
                    return RequestOutcome(req.prompt_len, error=f"{type(e).__name__}: {e}")
                finally:
                    in_flight -= 1

        schedule = arrival_schedule(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        start = time.perf_counter()
        tasks = []
        for at, req in zip(schedule, requests):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        outcomes = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start

    rate = cfg.request_rate
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "endpoint_type": "openai-chat" if cfg.endpoint == "chat" else "openai",
        "label": cfg.label,
        "base_url": base,
        "endpoint": ENDPOINTS[cfg.endpoint],
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": rate if rate < float("inf") else "inf",
        "burstiness": cfg.burstiness,
        "max_concurrency": cap,
        "seed": cfg.seed,
        "goodput_slos_ms": cfg.goodput_slos_ms or None,
        "max_concurrent_requests": peak,
    }
    result.update(summarize(outcomes, duration, cfg.goodput_slos_ms, cfg.percentiles))
    return result
