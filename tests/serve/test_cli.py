"""``python -m xspec.serve`` as a user runs it (one process): it serves the openai client
(the engine steps on the main thread, HTTP in a thread of its own), SIGTERM / SIGINT end it
with exit 0 even with a stream open, and a taken port is a user error (exit 2) before
anything loads."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["model=dsv4_tiny_random", "spec=mtp", "platform=cpu"]


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "xspec.serve", *MODEL, *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def url_of(proc: subprocess.Popen) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("xspec.serve:"):
            return line.rsplit(" at ", 1)[1].strip()
    raise AssertionError(f"the server did not start (exit {proc.wait()})")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_then_a_signal_ends_it_with_exit_0(sig: signal.Signals) -> None:
    """A request in flight when the signal comes gets ``server.shutdown_grace_s``, then
    ends as aborted: its stream closes properly (last chunk, ``[DONE]``), never cut."""
    proc = serve("server.port=0", "server.shutdown_grace_s=1")
    try:
        base = url_of(proc)
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        done = client.completions.create(
            model="dsv4_tiny_random", prompt=[5, 17, 42], max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert done.usage is not None and done.usage.completion_tokens == 6
        stream = client.completions.create(
            model="dsv4_tiny_random", prompt=[5, 17, 42], max_tokens=4000, temperature=0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = iter(stream)
        assert next(chunks).choices
        t0 = time.monotonic()
        proc.send_signal(sig)
        last = list(chunks)[-1]  # raises if the connection is cut
        assert last.choices[0].finish_reason == "abort"
        assert 0.5 < time.monotonic() - t0 < 30  # the grace, then the abort
        assert proc.wait(60) == 0
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.stdout is not None
    with proc.stdout:
        rest = proc.stdout.read()
    assert "Traceback" not in rest and "ERROR" not in rest, rest


def test_bad_server_settings_exit_2() -> None:
    proc = serve("server.shutdown_grace_s=-1", "server.port=70000")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert "server.shutdown_grace_s must be in 0..3600" in out
    assert "server.port must be in 0..65535" in out and "Traceback" not in out


def test_a_taken_port_exits_2_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = serve(f"server.port={port}")
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2, out
    assert f"server.port={port}" in out and "already in use" in out
    assert "Traceback" not in out
    assert time.monotonic() - t0 < 60


@pytest.fixture(scope="module")
def nan_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 tiny checkpoint with a tokenizer and a NaN weight: loading it fails, so a
    problem reported instead of that one was found before loading."""
    from tests.test_api import make_bad_dirs

    return make_bad_dirs(tmp_path_factory.mktemp("bad"))["nan"]


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("syntax", r"chat_template.jinja does not parse"),
        ("config", r"cannot read .*tokenizer_config.json"),
        ("link", r"chat_template.jinja is a link to .*outside the checkpoint directory"),
    ],
)
def test_a_bad_chat_template_exits_2_before_loading(
    nan_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture, case: str, words: str
) -> None:
    """Before: a traceback and exit 1, after the model had loaded."""
    import re
    import shutil

    from xspec.serve.__main__ import main

    ckpt = tmp_path / "ckpt"
    shutil.copytree(nan_checkpoint, ckpt)
    if case == "syntax":
        (ckpt / "chat_template.jinja").write_text("{% for m in messages %}")
    elif case == "config":
        (ckpt / "tokenizer_config.json").write_text("{not json")
    else:
        (tmp_path / "elsewhere.jinja").write_text("{{ messages }}")
        (ckpt / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.jinja")
    code = main(["model=qwen3", f"model.path={ckpt}", "spec=none", "platform=cpu",
                 "server.port=0"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("xspec.serve: error: ") and err.count("\n") == 1, err
    assert re.search(words, err) and "NaN" not in err, err
