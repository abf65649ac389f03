"""The HTTP connections uvicorn serves: bounded in number and in how long a request may
take to arrive.

uvicorn's h11 protocol has no limit of its own on a request that arrives slowly: its
keep-alive timer runs only between two requests, and a connection that sends half a
header (or half a body) is held for ever, so a client can hold connections until the
process runs out of file descriptors. :class:`BoundedH11` adds two limits:

* ``server.read_timeout_s``: a request's head and body must have arrived within this long
  of the connection opening or of its previous response ending; otherwise the server
  answers 408 and closes the connection (a handler waiting for the body sees a disconnect);
* ``server.max_connections``: a connection past this many open ones is answered 503
  (``Retry-After: 1``) and closed at once.

uvicorn's own ``timeout_keep_alive`` (5 s) still closes an idle kept-alive connection.
``TCP_NODELAY`` is set by asyncio on every accepted TCP connection, provided the listening
socket was made with ``IPPROTO_TCP`` (``xspec.serve.__main__._bind``): without it each
response's second write waits for the client's delayed ACK (~40 ms).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from xspec.config import ServerConfig
from xspec.serve.protocol import ErrorType, error_body


def _raw_response(status: str, message: str, type_: ErrorType, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response with OpenAI's error body, closing the connection."""
    code = int(status.split()[0])
    body = json.dumps(error_body(message, type_, code=code)).encode()
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class BoundedH11(H11Protocol):
    """uvicorn's h11 protocol with a read deadline per request and a connection cap
    (class attributes: :func:`uvicorn_config` subclasses it with the server's values)."""

    read_timeout_s = 30.0
    max_connections = 1024

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:
            message = (
                f"the server has server.max_connections={self.max_connections} connections "
                "open; retry later"
            )
            transport.write(
                _raw_response("503 Service Unavailable", message, "overloaded_error",
                              "retry-after: 1\r\n")
            )  # fmt: skip
            transport.close()
            return
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and not cycle.more_body:
            self._disarm()  # the request has arrived whole

    def on_response_complete(self) -> None:
        self._arm()  # before the next request (a pipelined one may arrive in super())
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        message = (
            f"the request did not arrive whole within server.read_timeout_s="
            f"{self.read_timeout_s:g}; send the head and body without pausing"
        )
        self.transport.write(_raw_response("408 Request Timeout", message, "timeout"))
        self.transport.close()  # a handler reading the body sees a disconnect


def uvicorn_config(app: Any, server: ServerConfig, **kw: Any) -> uvicorn.Config:
    """uvicorn's config for ``app`` under the ``server`` limits (``kw``: more of uvicorn's
    settings, e.g. ``timeout_graceful_shutdown``)."""

    class Protocol(BoundedH11):
        read_timeout_s = server.read_timeout_s
        max_connections = server.max_connections

    return uvicorn.Config(app, http=Protocol, log_level="warning", access_log=False, **kw)
