"""The benchmark client end to end against a fake OpenAI-compatible server on 127.0.0.1:
counts, token totals, timing relations, concurrency cap, failures, datasets, compare."""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.bench.fake_server import Behaviour, FakeServer
from xspec.bench.__main__ import main

SPEC = {"spec_decode": {"num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 8}}


def _run(server: FakeServer, tmp_path: Path, *args: str, name: str = "r.json") -> dict[str, Any]:
    out = tmp_path / name
    argv = ["serve", "--base-url", server.base_url, "--result-file", str(out), "--timeout", "30"]
    assert main([*argv, *args]) == 0
    return json.loads(out.read_text())


def test_streaming_run_counts_and_timings(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    b = Behaviour(chunks=4)
    with FakeServer(b) as s:
        r = _run(s, tmp_path, "--num-prompts", "6", "--max-concurrency", "2",
                 "--input-len", "5", "--output-len", "4", "--goodput", "ttft:30000")  # fmt: skip
    assert (r["completed"], r["failed"], r["num_prompts"]) == (6, 0, 6)
    assert r["model_id"] == "fake-model"  # from GET /v1/models
    assert r["total_input_tokens"] == 6 * 7  # the server's usage.prompt_tokens
    assert r["total_output_tokens"] == 6 * 4 and r["output_lens"] == [4] * 6
    assert r["max_concurrency"] == 2 and r["max_concurrent_requests"] == 2
    assert b.peak <= 2  # the server never saw more than the cap in flight
    assert r["request_rate"] == "inf" and r["goodput"] == r["request_throughput"]
    assert all(len(itl) == 3 for itl in r["itls"])  # chunks - 1 gaps per request
    assert all(t > 0 for t in r["ttfts"])
    assert r["median_ttft_ms"] <= r["median_e2el_ms"] and r["p99_ttft_ms"] <= r["p99_e2el_ms"]
    assert r["mean_tpot_ms"] > 0 and r["p90_itl_ms"] > 0
    assert r["spec_acceptance_rate"] is None and r["spec_acceptance_length"] is None
    assert r["errors"] == [""] * 6
    body = b.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 4 and len(body["prompt"].split()) == 5 - 1  # tokens: BOS + 4
    assert "ignore_eos" not in body
    assert "Successful requests:" in capsys.readouterr().out
    for key in ("date", "backend", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "median_tpot_ms", "p99_itl_ms", "std_e2el_ms",
                "p50_ttft_ms", "input_lens"):  # fmt: skip
        assert key in r


def test_speculative_chunks_and_acceptance(tmp_path: Path) -> None:
    b = Behaviour(chunks=4, tokens_per_chunk=3, spec=SPEC)
    with FakeServer(b) as s:
        r = _run(s, tmp_path, "--num-prompts", "3", "--request-rate", "1000", "--seed", "1",
                 "--label", "mtp", "--ignore-eos", "--extra-body", '{"top_k": 1}')  # fmt: skip
    assert r["completed"] == 3 and r["total_output_tokens"] == 3 * 12  # tokens from usage
    assert all(len(itl) == 3 for itl in r["itls"])  # ITL stays per chunk
    assert r["spec_acceptance_length"] == 3.0 and r["spec_acceptance_rate"] == pytest.approx(2 / 3)
    assert r["label"] == "mtp" and r["request_rate"] == 1000.0
    # TPOT per token: (e2el - TTFT) / 11, below the per-chunk ITL
    assert r["mean_tpot_ms"] < r["mean_itl_ms"]
    assert b.bodies[0]["ignore_eos"] is True and b.bodies[0]["top_k"] == 1


def test_without_usage_tokens_are_chunks(tmp_path: Path) -> None:
    with FakeServer(Behaviour(chunks=5, tokens_per_chunk=2, usage=False)) as s:
        r = _run(s, tmp_path, "--num-prompts", "2", "--model", "m", "--input-len", "9")
    assert r["output_lens"] == [5, 5] and r["input_lens"] == [9, 9]  # /tokenize's count
    assert r["model_id"] == "m"


def test_chat_endpoint(tmp_path: Path) -> None:
    b = Behaviour(chunks=3)
    with FakeServer(b) as s:
        r = _run(s, tmp_path, "--num-prompts", "2", "--endpoint", "chat")
    assert r["completed"] == 2 and r["backend"] == "openai-chat"
    assert r["endpoint"] == "/v1/chat/completions"
    assert b.bodies[0]["messages"][0]["role"] == "user" and "prompt" not in b.bodies[0]


def test_failed_requests_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with FakeServer(Behaviour(fail_every=3)) as s:
        r = _run(s, tmp_path, "--num-prompts", "6", "--max-concurrency", "1")
    assert (r["completed"], r["failed"]) == (4, 2)
    assert [e.startswith("HTTP 500: boom") for e in r["errors"]].count(True) == 2
    assert r["total_output_tokens"] == 4 * 4
    assert "first error: HTTP 500: boom" in capsys.readouterr().out


def test_all_failed_exits_1(tmp_path: Path) -> None:
    with FakeServer(Behaviour(delay_s=2.0)) as s:
        argv = ["serve", "--base-url", s.base_url, "--num-prompts", "2", "--timeout", "0.2",
                "--result-file", str(tmp_path / "r.json")]  # fmt: skip
        assert main(argv) == 1
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["failed"] == 2 and r["errors"] == ["timed out after 0.2 s"] * 2
    assert r["mean_ttft_ms"] is None and r["output_throughput"] == 0


def test_jsonl_dataset(tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "a b c", "max_tokens": 3},
        {"prompt": "d e", "output_len": 2},
        {"prompt": "f"},
    ]
    data.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    b = Behaviour(usage=False)
    with FakeServer(b) as s:
        r = _run(s, tmp_path, "--dataset", str(data), "--max-concurrency", "1")
        assert r["num_prompts"] == 3 and r["input_lens"] == [3, 2, 1]
        assert [x["max_tokens"] for x in b.bodies] == [3, 2, 128]
        r = _run(
            s, tmp_path, "--dataset", str(data), "--num-prompts", "4", "--max-concurrency", "1"
        )
        assert r["input_lens"] == [3, 2, 1, 3]  # the file repeats


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"prompt": "ok"}\nnot json\n', "p.jsonl:2: not JSON"),
        ('{"text": "no prompt"}\n', 'p.jsonl:1: expected an object with a string "prompt"'),
        ('{"prompt": "x", "max_tokens": 0}\n', "p.jsonl:1: max_tokens/output_len must be"),
        ("\n", "no prompts"),
    ],
)
def test_bad_dataset_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, text: str, message: str
) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text(text)
    # no server is needed: the dataset is read first
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(data)]) == 2
    assert message in capsys.readouterr().err


def test_missing_dataset_and_bad_options_exit_2(tmp_path: Path) -> None:
    missing = str(tmp_path / "none.jsonl")
    assert main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", missing]) == 2
    for bad in (["--goodput", "latency:5"], ["--request-rate", "0"], ["--max-concurrency", "0"]):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--base-url", "http://127.0.0.1:9", *bad])
        assert e.value.code == 2


def test_compare_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def result(name: str, label: str | None, tput: float, tpot: float, acc: float | None) -> Path:
        p = tmp_path / f"{name}.json"
        keys = {"request_throughput": 1.0, "output_throughput": tput, "median_ttft_ms": 10.0,
                "p99_ttft_ms": 20.0, "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot,
                "median_itl_ms": tpot, "p99_itl_ms": None, "spec_acceptance_length": acc}  # fmt: skip
        p.write_text(json.dumps({"label": label, **keys}))
        return p

    paths = [result("a", "none", 100.0, 20.0, None), result("b", None, 250.0, 8.0, 3.5)]
    assert main(["compare", *map(str, paths)]) == 0
    rows = capsys.readouterr().out.strip().splitlines()
    assert rows[0].startswith("| run | req/s | out tok/s | TTFT p50 ms")
    assert (
        rows[2]
        == "| none | 1.00 | 100.0 | 10.0 | 20.0 | 20.00 | 40.00 | 20.00 | - | - | 1.00x | 1.00x |"
    )
    assert (
        rows[3]
        == "| b | 1.00 | 250.0 | 10.0 | 20.0 | 8.00 | 16.00 | 8.00 | - | 3.50 | 2.50x | 0.40x |"
    )
    (tmp_path / "bad.json").write_text("{}")
    assert main(["compare", str(paths[0]), str(tmp_path / "bad.json")]) == 2


# a directory, a path under a file, /proc (no new file there, for root too), a device
@pytest.mark.parametrize(
    ("target", "needle"),
    [
        ("{tmp}", "--result-file {tmp} is a directory; name a file, e.g. {tmp}/result.json"),
        ("{tmp}/f/r.json", "--result-file {tmp}/f/r.json is under the file {tmp}/f"),
        ("/proc/xspec/r.json", "--result-file /proc/xspec/r.json: no file can be written in /proc ("),
        ("/dev/null", "--result-file /dev/null is not a regular file"),
    ],
)  # fmt: skip
def test_an_unwritable_result_file_is_refused_before_any_request(
    tmp_path: Path, capsys: pytest.CaptureFixture, target: str, needle: str
) -> None:
    (tmp_path / "f").write_text("a file")
    target, needle = target.format(tmp=tmp_path), needle.format(tmp=tmp_path)
    b = Behaviour()
    with FakeServer(b) as s:
        argv = ["serve", "--base-url", s.base_url, "--num-prompts", "2", "--result-file", target]
        assert main(argv) == 2
    assert b.bodies == []  # refused before the benchmark, not after it
    assert needle in capsys.readouterr().err


def test_a_result_file_that_cannot_be_written_at_the_end_exits_1(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk that fills during the run: the report is printed, the previous result file
    is left whole (atomic write), exit 1."""
    out = tmp_path / "r.json"
    out.write_text('{"previous": true}\n')
    real_replace = os.replace

    def full(src: str, dst: str) -> None:
        if Path(dst) == out:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with FakeServer(Behaviour()) as s:
        argv = ["serve", "--base-url", s.base_url, "--num-prompts", "2", "--result-file", str(out)]
        assert main(argv) == 1
    captured = capsys.readouterr()
    assert "Successful requests:" in captured.out
    assert f"error: cannot write {out}: No space left on device" in captured.err
    assert out.read_text() == '{"previous": true}\n' and os.listdir(tmp_path) == ["r.json"]


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"prompt": "\xff"}\n', "--dataset {path}: not UTF-8 text (invalid start byte at byte 12)"),
        (b"[" * 100_000 + b"]" * 100_000 + b"\n", "{path}:1: not JSON this client reads (nested too deep)"),
        (None, "--dataset {path}: not a regular file"),  # a FIFO: reading it would block forever
    ],
)  # fmt: skip
def test_a_dataset_that_is_not_jsonl_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, content: bytes | None, needle: str
) -> None:
    data = tmp_path / "p.jsonl"
    if content is not None:
        data.write_bytes(content)
        assert main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(data)]) == 2
        assert needle.format(path=data) in capsys.readouterr().err
        return
    os.mkfifo(data)
    # a writer that opens and closes it: a client that reads the FIFO gets EOF (and fails
    # the assertion below) instead of blocking this test forever
    writer = threading.Thread(target=lambda: os.close(os.open(data, os.O_WRONLY)))
    writer.start()
    try:
        assert main(["serve", "--base-url", "http://127.0.0.1:9", "--dataset", str(data)]) == 2
        assert needle.format(path=data) in capsys.readouterr().err
    finally:  # the client never opened it: open it here so the writer's open returns
        fd = os.open(data, os.O_RDONLY | os.O_NONBLOCK)
        writer.join()
        os.close(fd)


def test_compare_refuses_a_result_that_is_not_json(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe")
    assert main(["compare", str(bad)]) == 2
    assert f"result file {bad}: not UTF-8 text" in capsys.readouterr().err
    bad.write_text("[" * 100_000)
    assert main(["compare", str(bad)]) == 2
    assert f"{bad}: not JSON this client reads (nested too deep)" in capsys.readouterr().err
