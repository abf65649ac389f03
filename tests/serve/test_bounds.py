"""One request, one client or one file cannot stall the server for the others (issue 53):
a checkpoint's chat template that loops or grows a string (it renders in a bounded process
of its own), a prompt of megabytes (refused by its byte length before tokenizing; the rest
is tokenized off the event loop), half-sent requests (408 after ``server.read_timeout_s``)
and a flood of connections (503 past ``server.max_connections``); and responses are not
held back by Nagle's algorithm. Each time a normal request in flight beside the bad one
completes within twice its solo time (both measured in the same run)."""

from __future__ import annotations

import shutil
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import xspec
from tests.serve.conftest import LiveServer, start_server
from tests.test_chat import HOSTILE

READ_TIMEOUT_S, MAX_CONNECTIONS = 1.0, 120


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """dsv4_tiny (its Hugging Face tokenizer) from a copy whose chat_template.jinja loops
    or grows a string for certain messages."""
    ckpt = tmp_path_factory.mktemp("hostile") / "dsv4_tiny"
    shutil.copytree(Path(xspec.__file__).parent / "assets" / "dsv4_tiny", ckpt)
    (ckpt / "chat_template.jinja").write_text(HOSTILE)
    server = start_server(
        "dsv4_tiny", "none",
        {"model.path": str(ckpt), "model.dtype": "float32", "server.template_timeout_s": 1,
         "server.template_memory_mib": 128, "server.read_timeout_s": READ_TIMEOUT_S,
         "server.max_connections": MAX_CONNECTIONS},
    )  # fmt: skip
    yield server
    server.stop()


def normal(live: LiveServer, timeout: float = 120, then: Callable[[], None] | None = None) -> float:
    """Seconds a streamed greedy completion of 16 tokens takes; ``then`` runs (in a
    thread) once its first chunk has arrived."""
    body = {"model": live.name, "prompt": "def f(x):", "max_tokens": 16, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    t0 = time.perf_counter()
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=timeout) as r:
        lines = (x for x in r.iter_lines() if x.startswith("data: "))
        next(lines)
        if then is not None:
            threading.Thread(target=then, daemon=True).start()
        assert list(lines)[-1] == "data: [DONE]"
    return time.perf_counter() - t0


def beside(live: LiveServer, bad: Callable[[], Any]) -> Any:
    """``bad()``'s result, run while a normal request is in flight; that request takes
    at most twice its solo time (the median of two runs just before and one just after:
    the machine's load drifts)."""
    before = [normal(live) for _ in range(2)]
    box: list[Any] = []
    took = normal(live, timeout=20 * max(before) + 10, then=lambda: box.append(bad()))
    for _ in range(1200):  # bad() may outlast the normal request
        if box:
            break
        time.sleep(0.05)
    solo = statistics.median([*before, normal(live)])
    assert took < 2 * solo, f"a normal request took {took:.2f} s beside it, {solo:.2f} s alone"
    return box[0]


def chat(live: LiveServer, content: str) -> httpx.Response:
    body = {"model": live.name, "messages": [{"role": "user", "content": content}],
            "max_tokens": 2}  # fmt: skip
    return httpx.post(live.url + "/v1/chat/completions", json=body, timeout=60)


def test_a_chat_template_past_its_limits_fails_its_request_alone(live: LiveServer) -> None:
    """Before: the template rendered on the event loop, unbounded (nested range loops
    stalled /health and every stream; doubling a string grew the server by gigabytes)."""
    assert chat(live, "hi").status_code == 200
    loop, grow = beside(live, lambda: (chat(live, "loop"), chat(live, "grow")))
    for r in (loop, grow):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages", r.text
    assert "time limit of 1 s (server.template_timeout_s)" in loop.json()["error"]["message"]
    # its memory limit, or on a busy machine (the renderer runs at nice 10) its time limit
    assert "template_memory_mib=128" in grow.text or "template_timeout_s" in grow.text, grow.text
    assert chat(live, "hi").status_code == 200  # a fresh renderer
    for name in ("chat_text", "chat_encode"):
        threads = on_threads(live, name, lambda: chat(live, "hi"))
        assert threads and live.thread not in threads  # the event loop's thread


def test_a_huge_prompt_is_refused_by_its_length_off_the_event_loop(live: LiveServer) -> None:
    """Before: 3.9 MB of text were tokenized on the event loop (seconds) to be refused.
    Now text longer than the context can hold in bytes is refused untokenized, and the
    rest is tokenized on a worker thread."""
    bound = live.ctx.max_prompt_bytes
    assert bound is not None and bound < 3_900_000

    def post(text: str) -> httpx.Response:
        body = {"model": live.name, "prompt": text, "max_tokens": 2}
        return httpx.post(live.url + "/v1/completions", json=body, timeout=120)

    huge = beside(live, lambda: post("hello world " * 325_000))  # 3.9 MB
    err = huge.json()["error"]
    assert huge.status_code == 400 and f"longer than {bound} bytes" in err["message"], huge.text
    assert err["param"] == "prompt"
    threads = on_threads(live, "encode", lambda: post("hello world " * 2000))  # ~5k tokens
    assert threads and live.thread not in threads  # the event loop's thread


def on_threads(live: LiveServer, name: str, call: Callable[[], httpx.Response]) -> set:
    """The threads ``live.ctx.<name>`` ran on while ``call()`` was served."""
    seen, fn = set(), getattr(live.ctx, name)

    def recording(*args: Any) -> Any:
        seen.add(threading.current_thread())
        return fn(*args)

    setattr(live.ctx, name, recording)
    try:
        assert call().status_code in (200, 400)
    finally:
        setattr(live.ctx, name, fn)
    return seen


def test_responses_are_not_held_back_by_nagle(live: LiveServer) -> None:
    """Before: the listening socket was made with protocol 0, so asyncio never set
    TCP_NODELAY and every response on a kept-alive connection waited ~40 ms (the
    client's delayed ACK): 3 ms on a fresh connection, 42 ms on the next ones."""
    url = live.url + "/v1/models"
    kept, fresh = [], []
    with httpx.Client() as one, httpx.Client() as each:
        assert one.get(url).status_code == 200  # opens the connection the others reuse
        accepted = [
            c.transport.get_extra_info("socket") for c in live.server.server_state.connections
        ]
        assert accepted and all(
            s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in accepted
        )
        for _ in range(15):  # interleaved: both see the same machine
            for client, times, headers in ((one, kept, {}), (each, fresh, {"connection": "close"})):
                t0 = time.perf_counter()
                assert client.get(url, headers=headers).status_code == 200
                times.append(time.perf_counter() - t0)
    # a request on a kept-alive connection is no slower than one on a new connection
    assert statistics.median(kept) < 2 * statistics.median(fresh), (kept, fresh)


def _connect(live: LiveServer, data: bytes) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", int(live.url.rsplit(":", 1)[1])))
    s.sendall(data)
    return s


def _replies(socks: list[socket.socket]) -> list[bytes]:
    """All the server sends on each until it closes it (b"": it did not close it within
    ten times server.read_timeout_s, all together)."""
    deadline, out = time.monotonic() + 10 * READ_TIMEOUT_S + 10, []
    for s in socks:
        data = b""
        try:
            while True:
                s.settimeout(max(0.01, deadline - time.monotonic()))
                if not (chunk := s.recv(65536)):
                    break
                data += chunk
        except TimeoutError:
            data = b""
        finally:
            s.close()
        out.append(data)
    return out


def test_half_sent_requests_are_dropped(live: LiveServer) -> None:
    """Before: a connection that sent half a header (or half a body) was held for ever;
    enough of them exhausted the file descriptors."""
    head = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    half_body = head + b'content-length: 100\r\n\r\n{"model": '

    def slow_clients() -> list[bytes]:
        socks = [_connect(live, head if k % 2 else half_body) for k in range(40)]
        socks.append(_connect(live, b""))  # nothing at all
        return _replies(socks)

    replies = beside(live, slow_clients)
    assert all(r.startswith(b"HTTP/1.1 408 ") and b"read_timeout_s" in r for r in replies)
    ok = httpx.post(live.url + "/v1/completions", json={"model": live.name, "prompt": "a",
                                                        "max_tokens": 2})  # fmt: skip
    assert ok.status_code == 200


def test_connections_past_the_cap_get_503(live: LiveServer) -> None:
    socks = [_connect(live, b"") for _ in range(MAX_CONNECTIONS + 10)]
    replies = _replies(socks)
    busy = [r for r in replies if r.startswith(b"HTTP/1.1 503 ")]
    assert len(busy) >= 10 and all(b"max_connections" in r for r in busy)
    assert all(r.startswith((b"HTTP/1.1 503 ", b"HTTP/1.1 408 ")) for r in replies)
    assert httpx.get(live.url + "/health").status_code == 200
