"""``python -m xspec.serve model=... spec=... platform=... server.port=8000 ...``

The same Hydra groups and checks as ``python -m xspec`` (a user error prints one message
and exits with code 2 before anything loads), then the model is built, warmed up with one
short generation, and served until interrupted (Ctrl-C / SIGTERM: the open requests end,
exit 0). Under ``torchrun`` every rank runs this; rank 0 alone binds the port and the
others follow its engine loop (:mod:`xspec.engine.loop`). A dead or hung rank stops the
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
from collections.abc import Iterator
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from xspec.__main__ import overrides_of
    from xspec.compose import compose_run, normalise_override
    from xspec.errors import ConfigError, UserError

    args = [normalise_override(a) for a in overrides_of(sys.argv[1:] if argv is None else argv)]
    try:
        cfg = compose_run(args)
        from xspec.build import build, check

        if problems := check(cfg):
            raise ConfigError("this server cannot be built:", problems=problems)
        sock = _bind(cfg.server.host, cfg.server.port) if _rank() == 0 else None
        built = build(cfg)
    except UserError as e:
        print(f"xspec.serve: error: {e}", file=sys.stderr)
        return e.exit_code
    return serve(cfg, built, sock, model_option=_model_option(args, cfg))


def serve(cfg: Any, built: Any, sock: socket.socket | None, model_option: str) -> int:
    """Warm up, then serve on ``sock`` (rank 0) or follow rank 0's loop (the others)."""
    import uvicorn

    from xspec.parallel.runtime import PEER_FAILURE_EXIT, PeerFailure
    from xspec.serve.app import asgi_app, context, warm_up

    _Server = _server_class()

    try:
        warm_up(built.engine)
        ctx = context(cfg, built, model_option)
        if sock is None:  # a rank other than 0
            ctx.loop.follow()
            return 0
    except PeerFailure as e:
        print(f"xspec.serve: error: {e}", file=sys.stderr, flush=True)
        os._exit(PEER_FAILURE_EXIT)
    server = _Server(
        uvicorn.Config(
            asgi_app(ctx), log_level="warning", access_log=False, timeout_graceful_shutdown=5
        )
    )
    loop = ctx.loop
    loop.start()
    threading.Thread(target=_stop_when_loop_dies, args=(loop, server), daemon=True).start()
    host, port = sock.getsockname()[:2]
    print(
        f"xspec.serve: {ctx.model_name} (spec={cfg.spec.method}, platform={built.platform.name})"
        f" at http://{host}:{port}/v1",
        flush=True,
    )
    try:
        server.run(sockets=[sock])
    finally:
        loop.close()
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
        """uvicorn's server, except that SIGINT / SIGTERM only stop serving (uvicorn
        re-raises them afterwards, which would skip closing the engine loop that the
        other ranks follow)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            previous = {s: signal.signal(s, self.handle_exit) for s in sigs}
            try:
                yield
            finally:
                for s, handler in previous.items():
                    signal.signal(s, handler)

    return Server


def _stop_when_loop_dies(loop: Any, server: Any) -> None:
    """The loop failed (a dead rank, a bug): answer 503 a moment, then stop serving."""
    import time

    loop.join()
    if loop.failure is not None:
        time.sleep(1.0)  # the open requests' error replies go out
        server.should_exit = True


def _rank() -> int:
    from xspec.parallel.topology import launch

    return launch().rank


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads (a taken port is a user
    error found in a second, not after minutes of loading)."""
    from xspec.errors import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
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
