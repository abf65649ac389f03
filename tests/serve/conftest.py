"""A live xspec server on 127.0.0.1 (a free port) in a thread of the test process, over
a model built like ``xspec.LLM``; tests talk to it with the real ``openai`` client."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

import xspec
from xspec.serve.__main__ import _bind
from xspec.serve.app import ServeContext, asgi_app, context, warm_up
from xspec.serve.http import uvicorn_config


@dataclass
class LiveServer:
    llm: xspec.LLM
    ctx: ServeContext
    url: str  # http://127.0.0.1:<port>
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def name(self) -> str:
        return self.ctx.model_name

    def openai(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.ctx.close()


def start_server(model: str, spec: str, overrides: dict[str, object] | None = None) -> LiveServer:
    llm = xspec.LLM(model=model, spec=spec, platform="cpu", overrides=overrides)
    built = llm._built
    warm_up(built.engine)
    ctx = context(llm.config, built, model)
    sock = _bind("127.0.0.1", 0)  # as the server binds
    server = uvicorn.Server(uvicorn_config(asgi_app(ctx), llm.config.server))
    ctx.loop.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    assert httpx.get(url + "/health").status_code == 200
    return LiveServer(llm, ctx, url, server, thread)


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest) -> Iterator[LiveServer]:
    """The module's server: ``request.param`` = (model, spec, overrides)."""
    model, spec, overrides = request.param
    live = start_server(model, spec, overrides)
    yield live
    live.stop()
