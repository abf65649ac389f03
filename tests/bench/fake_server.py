"""A tiny OpenAI-compatible streaming server (stdlib only) for the benchmark client's
tests: known chunks with known delays, a usage chunk, optional failures; it records the
peak number of requests in flight. Its /tokenize and /detokenize (vLLM's shapes) split
text at spaces, one token a word, after a BOS (id 0)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    chunks: int = 4  # content chunks per response
    tokens_per_chunk: int = 1  # a speculative server commits several tokens a step
    delay_s: float = 0.005  # before each chunk
    usage: bool = True
    spec: dict[str, Any] | None = None  # merged into usage
    fail_every: int = 0  # the n-th, 2n-th ... request gets HTTP 500 (0: none)
    model: str = "fake-model"
    vocab: dict[str, int] = field(default_factory=dict)  # /tokenize's words
    # recorded
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakeServer:
    """``with FakeServer(Behaviour(...)) as s:`` serves on ``s.base_url`` (127.0.0.1)."""

    def __init__(self, behaviour: Behaviour) -> None:
        b = self.behaviour = behaviour

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                body = json.dumps({"object": "list", "data": [{"id": b.model}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self._post()  # the client may give up (its timeout)

            def _post(self) -> None:
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path in ("/tokenize", "/detokenize"):
                    return self._tokens(req)
                with b.lock:
                    b.bodies.append(req)
                    n = len(b.bodies)
                    b.in_flight += 1
                    b.peak = max(b.peak, b.in_flight)
                try:
                    if b.fail_every and n % b.fail_every == 0:
                        self.send_response(500)
                        self.send_header("Content-Type", "text/plain")
                        self.end_headers()
                        self.wfile.write(b"boom")
                        return
                    self._stream(req)
                finally:
                    with b.lock:  # before the last byte, so the client cannot be done first
                        b.in_flight -= 1
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()

            def _stream(self, req: dict[str, Any]) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                chat = "messages" in req
                for _ in range(b.chunks):
                    time.sleep(b.delay_s)
                    text = "tok " * b.tokens_per_chunk
                    choice = {"index": 0, "delta": {"content": text}} if chat else {
                        "index": 0, "text": text}  # fmt: skip
                    self._send({"choices": [choice], "usage": None})
                    self.wfile.write(b": keep-alive comment\n\n")
                if b.usage:
                    usage = {"prompt_tokens": 7, "completion_tokens": b.chunks * b.tokens_per_chunk}
                    self._send({"choices": [], "usage": usage | (b.spec or {})})

            def _tokens(self, req: dict[str, Any]) -> None:
                if self.path == "/tokenize":
                    words = req["prompt"].split()
                    with b.lock:
                        ids = [b.vocab.setdefault(w, len(b.vocab) + 1) for w in words]
                    bos = [0] if req.get("add_special_tokens", True) else []
                    out: dict[str, Any] = {"tokens": bos + ids, "count": len(bos + ids)}
                else:
                    names = {i: w for w, i in b.vocab.items()}
                    out = {"prompt": " ".join(names[i] for i in req["tokens"] if i)}
                body = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _send(self, obj: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=10)
