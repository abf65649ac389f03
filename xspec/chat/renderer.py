"""A Jinja chat template rendered in a process of its own, under a time and a memory limit.

Python cannot stop a running thread, so a template that loops for minutes or grows a
string to gigabytes can only be bounded from outside. :class:`TemplateRenderer` starts a
small child process (``python -m xspec.chat.renderer``: a fresh interpreter that imports
jinja2 and :mod:`xspec.chat`, never the model nor the server's main module; about 25 MB)
that compiles the template once and then renders the requests sent over a socket pair, one
at a time:

* time: a render that has not answered within ``timeout_s`` is killed with its process,
  which is started again; ``RLIMIT_CPU`` also ends a child whose parent is gone;
* memory: the child's address space is capped (``RLIMIT_AS``, ``memory_mib``): an
  allocation past it fails in the child (the request gets an error), not in the server;
  the child is then replaced (its heap may stay fragmented);
* output: at most ``max_chars`` characters, given with each request.

A render that hits a limit is a :class:`~xspec.errors.RequestError` for that request.
The child runs at a lower CPU priority (nice 10), so on a busy machine it does not take
cycles from the engine. Requests and replies cross the pipe as JSON bytes, never pickle:
the child runs a stranger's code and nothing it sends back can execute in the server.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.errors import CheckpointError, RequestError

if TYPE_CHECKING:
    from xspec.chat import ChatTemplate

NICE = 10  # the renderer's CPU priority below the server's (an idle engine loses nothing)
START_TIMEOUT_S = 60.0  # a fresh child imports jinja2 and compiles (under 1 s when idle)


@dataclass(frozen=True)
class RenderLimits:
    timeout_s: float = 2.0  # one render's wall-clock limit (server.template_timeout_s)
    memory_mib: int = 512  # the child's address space, 0 = unlimited (server.template_memory_mib)


class TemplateRenderer:
    """``template`` (format jinja) rendered in a child process under ``limits``.
    Construction starts the child and waits until it has compiled the template: a
    template that cannot compile there is a :class:`~xspec.errors.CheckpointError`.
    Thread-safe: renders run one at a time."""

    def __init__(self, template: ChatTemplate, limits: RenderLimits) -> None:
        self.template, self.limits = template, limits
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._ready = False
        with self._lock:
            problem = self._child_ready()
        if problem is not None:
            raise CheckpointError(f"the chat template {template.source} cannot be used: {problem}")

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        options: dict[str, Any],
        max_chars: int,
    ) -> str:
        """The prompt text for checked messages and options (:mod:`xspec.chat`)."""
        request = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                   "options": options, "max_chars": max_chars}  # fmt: skip
        payload = json.dumps(request).encode()
        where = f"the chat template ({self.template.source})"
        with self._lock:
            if (problem := self._child_ready()) is not None:
                raise RequestError(f"{where} has no renderer: {problem}")
            assert self._conn is not None
            try:
                self._conn.send_bytes(payload)
                if not self._conn.poll(self.limits.timeout_s):
                    self._restart()
                    raise RequestError(
                        f"{where} ran past its time limit of {self.limits.timeout_s:g} s "
                        "(server.template_timeout_s) on these messages"
                    )
                reply = json.loads(self._conn.recv_bytes(6 * max_chars + 4096))
            except (EOFError, OSError, ValueError):  # it died: RLIMIT_CPU, a signal, a crash
                how = self._how_it_ended()
                self._restart()
                raise RequestError(
                    f"{where} ended its renderer ({how}) on these messages"
                ) from None
            if reply.get("restart"):  # it ran out of memory: a fresh child for the next one
                self._restart()
        if "error" in reply:
            raise RequestError(str(reply["error"]))
        return str(reply["text"])

    def close(self) -> None:
        """Stop the child (idempotent)."""
        with self._lock:
            self._stop()

    # -- the child's lifetime (under self._lock) -------------------------------------------

    def _start(self) -> None:
        import multiprocessing

        parent, child = multiprocessing.Pipe()  # a socket pair with message framing
        env = dict(os.environ)  # the child imports this xspec, wherever it came from
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "xspec.chat.renderer", str(child.fileno())],
            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL, env=env,
        )  # fmt: skip
        with contextlib.suppress(OSError):  # lower priority from its start (it renices too)
            os.setpriority(
                os.PRIO_PROCESS, self._proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + NICE
            )
        child.close()
        t = self.template
        setup = {"text": t.text, "source": t.source, "special_tokens": dict(t.special_tokens),
                 "limits": asdict(self.limits)}  # fmt: skip
        parent.send_bytes(json.dumps(setup).encode())
        self._conn, self._ready = parent, False

    def _child_ready(self) -> str | None:
        """None once a child has compiled the template (started here if none); else why
        it could not (the child is then stopped, and the next call starts another)."""
        if self._proc is None:
            self._start()
        if self._ready:
            return None
        assert self._conn is not None
        problem: str | None = f"it did not start within {START_TIMEOUT_S:g} s"
        try:
            if self._conn.poll(START_TIMEOUT_S):
                problem = json.loads(self._conn.recv_bytes(1 << 20)).get("error")
        except (EOFError, OSError, ValueError):
            problem = f"its process ended while starting ({self._how_it_ended()})"
        if problem is None:
            self._ready = True
        else:
            self._stop()
        return problem

    def _how_it_ended(self) -> str:
        try:
            code = self._proc.wait(5) if self._proc is not None else None
        except subprocess.TimeoutExpired:
            return "its pipe broke"
        if code is not None and code < 0:
            return f"killed by signal {-code}" + (
                " at its CPU limit" if -code == signal.SIGXCPU else ""
            )
        return f"exit code {code}"

    def _restart(self) -> None:
        """Kill the child and start a new one at once (it gets ready while idle)."""
        self._stop()
        self._start()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(5)
        if self._conn is not None:
            self._conn.close()
        self._proc, self._conn, self._ready = None, None, False


# -- the child ---------------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """The child: bound itself, compile, then answer render requests until the pipe closes."""
    import resource

    from xspec.chat import jinja

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle
    with contextlib.suppress(OSError):  # the server may already have lowered it
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), NICE))
    setup = json.loads(conn.recv_bytes())
    text, source, special_tokens = setup["text"], setup["source"], setup["special_tokens"]
    limits = RenderLimits(**setup["limits"])
    try:
        if limits.memory_mib:
            cap = limits.memory_mib << 20
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
        jinja.compile_template(text)
    except MemoryError:
        return _send(conn, {"error": f"compiling it needs more than {limits.memory_mib} MiB "
                                     "(server.template_memory_mib)"})  # fmt: skip
    except Exception as e:  # a syntax error (load_chat_template checked it), an rlimit refused
        return _send(conn, {"error": f"{type(e).__name__}: {e}"})
    _send(conn, {"ready": True})
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:  # the server has gone
            return
        _limit_cpu(resource, 2 * limits.timeout_s + 1)
        try:
            out = jinja.render(text, source, special_tokens, request["messages"],
                               request["add_generation_prompt"], request["options"],
                               request["max_chars"])  # fmt: skip
        except jinja.OutOfMemory as e:
            _send(conn, {"error": f"{e} (the renderer's limit: server.template_memory_mib="
                                  f"{limits.memory_mib})", "restart": True})  # fmt: skip
        except RequestError as e:
            _send(conn, {"error": str(e)})
        else:
            _send(conn, {"text": out})


def _limit_cpu(resource: Any, seconds: float) -> None:
    """SIGXCPU (which ends the process) once this render has used ``seconds`` of CPU: the
    server kills a slow render sooner; this ends one whose server is gone."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = int(usage.ru_utime + usage.ru_stime + seconds) + 1
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _send(conn: Connection, reply: dict[str, Any]) -> None:
    conn.send_bytes(json.dumps(reply).encode())


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
