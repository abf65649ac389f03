"""``python -m xspec.serve model=... spec=... platform=... server.port=8000 ...``

The same Hydra groups and checks as ``python -m xspec`` (a user error prints one message
and exits with code 2 before anything loads), then the model is built, warmed up with one
short generation, and served until interrupted (Ctrl-C / SIGTERM: no new requests, those
in flight get ``server.shutdown_grace_s`` to finish and then end as aborted, exit 0).
Under ``torchrun`` every rank runs this; rank 0 alone binds the port and the others
follow its engine loop (:mod:`xspec.engine.loop`). A dead or hung rank stops the
loop: open requests end with an error, new ones get 503, and the server exits with code
3 (:data:`~xspec.parallel.runtime.PEER_FAILURE_EXIT`) within ``parallel.timeout_s``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from xspec.__main__ import overrides_of
    from xspec.compose import compose_run, normalise_override
    from xspec.errors import ConfigError, UserError

    args = [normalise_override(a) for a in overrides_of(sys.argv[1:] if argv is None else argv)]
    sock, chat = None, None
    try:
        cfg = compose_run(args)
        from xspec.build import build, check

        if problems := check(cfg):
            raise ConfigError("this server cannot be built:", problems=problems)
        if _rank() == 0:  # the one that serves HTTP
            from xspec.serve.app import start_chat

            # the chat template and tokenizer_config.json checked, and a Jinja template's
            # renderer process started, before the model loads (model.path: the directory)
            chat = start_chat(cfg, None)
        sock = _bind(cfg.server.host, cfg.server.port) if _rank() == 0 else None
        built = build(cfg)
    except UserError as e:
        if sock is not None:  # what was opened before the error
            sock.close()
        if chat is not None and chat[1] is not None:
            chat[1].close()
        print(f"xspec.serve: error: {e}", file=sys.stderr)
        return e.exit_code
    code = serve(cfg, built, sock, model_option=_model_option(args, cfg), chat=chat)
    if code == 0 and "torch.distributed" in sys.modules:  # a torchrun server's clean exit
        from xspec.parallel.runtime import shutdown

        # leave the process group while the interpreter is whole, as the batch CLI does:
        # gloo's worker threads left to the interpreter's teardown can abort the process
        # ("terminate called without an active exception", pytorch/pytorch#190489)
        shutdown()
    return code


def serve(
    cfg: Any, built: Any, sock: socket.socket | None, model_option: str, chat: Any = None
) -> int:
    """Warm up, then serve on ``sock`` (rank 0) or follow rank 0's loop (the others).
    ``chat``: :func:`~xspec.serve.app.start_chat`'s result (None: started with the context)."""
    from xspec.parallel.runtime import PEER_FAILURE_EXIT, PeerFailure
    from xspec.serve.app import asgi_app, context, warm_up
    from xspec.serve.http import uvicorn_config

    _Server = _server_class()

    try:
        warm_up(built.engine)
        ctx = context(cfg, built, model_option, chat)
        if sock is None:  # a rank other than 0
            ctx.loop.follow()
            return 0
    except PeerFailure as e:
        print(f"xspec.serve: error: {e}", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT)
    grace = cfg.server.shutdown_grace_s
    server = _Server(
        uvicorn_config(
            asgi_app(ctx),
            cfg.server,
            timeout_graceful_shutdown=grace + 5,  # the aborted requests' last chunks go out
        )
    )
    loop = ctx.loop

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            loop.stop()  # serving has ended (a signal, or the loop failed): the loop follows

    # the engine steps on this (the main) thread, where the model was built; HTTP gets a
    # thread of its own (xspec.engine.loop, "Which thread": 2.2x on the CPU)
    http_thread = threading.Thread(target=http, name="xspec-http", daemon=True)
    stopping = threading.Event()

    def on_signal(sig: int, frame: Any) -> None:
        """Stop taking requests; those in flight get ``shutdown_grace_s`` to finish, then
        end as aborted (each stream with its last chunk and ``[DONE]``), also while the
        engine is inside a long step: the timer's thread ends them, the step's results
        are dropped, and the loop leaves once that step returns. A second Ctrl-C cuts
        the open connections at once (uvicorn's force exit)."""
        server.handle_exit(sig, frame)
        if not stopping.is_set():
            stopping.set()
            timer = threading.Timer(grace, lambda: loop.stop(end_open=True))
            timer.daemon = True
            timer.start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    http_thread.start()
    host, port = sock.getsockname()[:2]
    print(
        f"xspec.serve: {ctx.model_name} (spec={cfg.spec.method}, platform={built.platform.name})"
        f" at http://{host}:{port}/v1",
        flush=True,
    )
    loop.run()  # until http() stops it, or a failure
    if loop.failure is not None:
        time.sleep(1.0)  # the open requests' error replies go out
        server.should_exit = True
    http_thread.join(30)
    if loop.failure is not None:
        print(
            f"xspec.serve: error: the engine stopped: {loop.failure}", file=sys.stderr, flush=True
        )
        if "PeerFailure" in loop.failure:
            sys.stdout.flush()
            os._exit(PEER_FAILURE_EXIT)  # never wait on the dead peer again
        return 1
    return 0


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server in a thread that is not the main one: the main thread (the
        engine's) installs the signal handlers, which call :meth:`handle_exit`."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server


def _rank() -> int:
    from xspec.parallel.topology import launch

    return launch().rank


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a taken port is a user
    error found in a second, not after minutes of loading). Made with ``IPPROTO_TCP``:
    asyncio sets ``TCP_NODELAY`` only on connections whose socket names TCP (protocol 0
    does not), and without it a response's second write waits ~40 ms for a delayed ACK."""
    from xspec.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "already in use" if e.errno == errno.EADDRINUSE else f"unavailable ({e.strerror})"
        raise ConfigError(
            f"server.port={port}: cannot listen on {host}:{port}, the address is {reason}; "
            "pick another server.port (0 = any free port) or server.host"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _model_option(args: list[str], cfg: Any) -> str:
    """The served name's default: the ``model=<option>`` given, else conf/config.yaml's."""
    from omegaconf import OmegaConf

    from xspec.config import config_dir

    for a in args:
        if a.startswith("model="):
            return a.split("=", 1)[1]
    for entry in OmegaConf.load(config_dir() / "config.yaml").defaults:
        if not isinstance(entry, str) and "model" in entry:
            return str(entry["model"])
    return str(cfg.model.arch)


if __name__ == "__main__":
    sys.exit(main())
