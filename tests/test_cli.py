"""The CLI: Hydra features work; user errors exit 2 with a short message and no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.clirun import CliResult, run_cli_in_process

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, cache: Path, cwd: Path | None = None) -> CliResult:
    """``python -m xspec`` in this process, in ``cwd`` (default: a fresh temp dir, where
    Hydra's outputs/ and multirun/ directories go), with ``XSPEC_CACHE_DIR=cache``."""
    if cwd is None:  # this module's scratch dir; called from elsewhere: the system's
        cwd = Path(tempfile.mkdtemp(dir=_SCRATCH[0] if _SCRATCH else None, prefix="xspec-cli-"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XSPEC_CACHE_DIR", str(cache))
        return run_cli_in_process(*args, cwd=cwd)


def run_cli_subprocess(*args: str, cache: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real entry point in a fresh interpreter (the exit-code contract end to end)."""
    env = {**os.environ, "XSPEC_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "xspec", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


_SCRATCH: list[Path] = []  # where run_cli's default working directories go


@pytest.fixture(scope="module", autouse=True)
def scratch(tmp_path_factory: pytest.TempPathFactory) -> None:
    _SCRATCH[:] = [tmp_path_factory.mktemp("cli")]


@pytest.fixture(scope="module")
def cache(xspec_cache: Path) -> Path:
    return xspec_cache  # the session's preset cache: presets are built once


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Damaged checkpoints (see tests/test_api.py) and a cache holding a truncated preset."""
    from tests.test_api import make_bad_dirs
    from xspec.models.qwen3.tiny import tiny_dir

    root = tmp_path_factory.mktemp("bad")
    out = make_bad_dirs(root)
    preset = root / "bad_cache" / "presets" / tiny_dir(False).name
    shutil.copytree(tiny_dir(False), preset)
    shard = preset / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    jsonl = root / "bad.jsonl"
    jsonl.write_text('{"prompt": "ok"}\n{"prompt": \n{"prompt": "a", "prompt_token_ids": [1]}\n')
    fifo = root / "fifo.json"  # reading it would wait forever for a writer
    os.mkfifo(fifo)
    deep = root / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    out |= {"bad_cache": root / "bad_cache", "bad_preset": preset, "bad_jsonl": jsonl}
    return out | {"fifo": fifo, "deep": deep}


RUN = ["model=qwen3_tiny", "spec=none", "platform=cpu", "workload.max_new_tokens=2"]
QWEN3 = ["model=qwen3", "spec=none", "platform=cpu", "workload.max_new_tokens=2"]
ADAPTIVE = ["model=qwen3_tiny", "spec=dspark", "spec.adaptive=true", "platform=cpu"]


# Every bad input reachable from the command line: (arguments, substrings of the message).
# "{name}" in an argument is a path from the ``bad`` fixture; "CACHE={name}" sets
# XSPEC_CACHE_DIR instead of passing an argument.
@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["model=nope"], ["model/nope", "qwen3_tiny", "dsv4_tiny_random"]),
        (["workload.max_new_tokens=many"], ["workload.max_new_tokens"]),
        (["+unknown.key=1"], ["unknown"]),
        (["model=dsv4_flash"], ["model.path"]),
        (["model=qwen3", "spec=none", "model.path=/does/not/exist"], ["/does/not/exist"]),
        (["platform=npu"], ["torch_npu"]),
        (["platform=cpu", "platform.native_sas=on"], ["native_sas"]),
        (["platform.batch_invariant=true", "model.dtype=bfloat16"], ["platform.batch_invariant=true holds for fp32"]),
        (["platform.batch_invariant=maybe"], ["platform.batch_invariant", "not a valid bool"]),
        (["workload.prompts=[]"], ["workload.prompts"]),
        (["workload.num_requests=0"], ["workload.num_requests must be >= 1 (got 0)"]),
        (["workload.concurrency=-1"], ["workload.concurrency must be >= 1 (got -1)"]),
        (["workload.num_requests=10000000000"], ["workload.num_requests must be <= 1,000,000"]),
        (["workload.warmup_requests=2000000"], ["workload.warmup_requests must be <= 1,000,000"]),
        ([*ADAPTIVE, "spec.adaptive.calibration={fifo}"], ["spec.adaptive.calibration", "{fifo} is not a regular file"]),
        ([*ADAPTIVE, "spec.adaptive.calibration={deep}"], ["{deep} nests JSON too deeply"]),
        ([*ADAPTIVE, "spec.adaptive.profile={fifo}"], ["spec.adaptive.profile", "not a regular file"]),
        (["workload=synthetic", "workload.input_len=0"], ["workload.input_len must be >= 1"]),
        (["workload.prompts_file=/no/such.jsonl"], ["/no/such.jsonl does not exist"]),
        (["workload.prompts_file={bad_jsonl}"], ["{bad_jsonl}:2: not valid JSON", "{bad_jsonl}:3: give exactly one"]),
        (["metrics.port=70000"], ["metrics.port must be in 0..65535"]),
        # wrong-typed overrides name the expected type / the allowed values
        (["model.dtype=float64"], ["model.dtype", "float32, bfloat16, float16"]),
        (["workload.num_requests=abc"], ["workload.num_requests", "Integer"]),
        (["workload.prompts=['a','']"], ["workload.prompts[1] is an empty string"]),
        (["--cfg", "job", "model.dtype=float64"], ["model.dtype", "float32"]),
        ([*RUN, "platform.device_index=99"], ["platform.device_index=99"]),
        ([*QWEN3, "model.path={no_tokenizer}"], ["tokenizer.json is missing", "model.tokenizer=byte"]),
        ([*QWEN3, "model.path={truncated}"], ["model-00001-of-00003.safetensors is truncated"]),
        ([*QWEN3, "model.path={nan}"], ["model.layers.1.mlp.up_proj.weight", "NaN or Inf"]),
        ([*QWEN3[1:], "model=dsv4_flash", "model.path={ok}"], ["this is a Qwen3 checkpoint", "model=qwen3"]),
        (["model=dsv4_tiny_random", "spec=mtp", "platform=cpu", "spec.draft_path={ok}"], ["this is a Qwen3 checkpoint"]),
        ([*RUN, "CACHE={bad_cache}"], ["is truncated", "delete {bad_preset}"]),
        ([*RUN, "CACHE={a_file}"], ["XSPEC_CACHE_DIR to a writable directory"]),
    ],
)  # fmt: skip
def test_user_errors_exit_2(
    args: list[str], needles: list[str], cache: Path, bad: dict[str, Path]
) -> None:
    args = [a.format(**bad) for a in args]
    needles = [n.format(**bad) for n in needles]
    cache = next((Path(a[6:]) for a in args if a.startswith("CACHE=")), cache)
    r = run_cli(*[a for a in args if not a.startswith("CACHE=")], cache=cache)
    assert r.returncode == 2, r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in r.stderr, r.stderr


def test_entry_point_exit_codes(tmp_path: Path, cache: Path) -> None:
    """The real ``python -m xspec`` (the cases above run in-process): a user error is one
    message and exit 2, with no traceback; ``--help`` exits 0."""
    r = run_cli_subprocess("model=nope", "workload.num_requests=0", cache=cache, cwd=tmp_path)
    assert r.returncode == 2, r.stderr + r.stdout
    assert r.stderr.startswith("xspec: error:") and "Traceback" not in r.stderr
    assert "model/nope" in r.stderr
    r = run_cli_subprocess("--help", cache=cache, cwd=tmp_path)
    assert r.returncode == 0 and "model" in r.stdout, r.stderr


def test_help_and_cfg(cache: Path) -> None:
    r = run_cli("--help", cache=cache)
    assert r.returncode == 0 and "model" in r.stdout and "spec" in r.stdout
    r = run_cli("--cfg", "job", "model=qwen3_tiny", cache=cache)
    assert r.returncode == 0 and "arch: qwen3" in r.stdout


def test_runs_and_reports_timings(tmp_path: Path, cache: Path) -> None:
    r = run_cli(
        "model=qwen3_tiny", "spec=none", "platform=auto", "workload.max_new_tokens=8",
        cache=cache, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "TTFT" in r.stdout and "TPOT" in r.stdout and "tok/s" in r.stdout
    assert "platform=cpu" in r.stdout  # auto picks the CPU here
    assert "model=qwen3_tiny (qwen3, preset tiny)" in r.stdout  # the option picked, then what
    # Hydra's convention: outputs/<date>/<time>/ under the working directory
    (results,) = tmp_path.glob("outputs/*/*/results.json")
    job = json.loads(results.read_text())
    assert job["spec"] == "none" and job["acceptance"] is None and job["output_tokens_mean"] == 8
    assert (results.parent / "summary.md").is_file()


def test_run_dir_is_overridable(tmp_path: Path, cache: Path) -> None:
    out = tmp_path / "mine"
    r = run_cli(*RUN, "workload.num_requests=1", f"hydra.run.dir={out}", cache=cache, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "results.json").read_text())["num_requests"] == 1
    assert not (tmp_path / "outputs").exists()


def test_each_invocation_in_one_process_keeps_its_own_jobs(tmp_path: Path, cache: Path) -> None:
    """``main`` keeps its jobs' results and summary directory for one invocation: a second
    run in the same process (the API, a notebook, these tests) summarises its own job, in
    its own directory."""
    for name in ("first", "second"):
        out = tmp_path / name
        r = run_cli(
            *RUN, "workload.num_requests=1", f"hydra.run.dir={out}", cache=cache, cwd=tmp_path
        )
        assert r.returncode == 0, r.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert [row["status"] for row in summary] == ["ok"], (name, summary)
        assert f"summary in {out}" in r.stdout


RESULT_KEYS = {
    "model", "spec", "platform", "gamma", "concurrency", "num_requests", "input_tokens_mean",
    "output_tokens_mean", "ttft_ms_mean", "tpot_ms_mean", "e2e_ms_mean", "output_tok_s",
    "mean_committed_per_step", "acceptance", "requests", "repeats",
}  # fmt: skip


def test_multirun_writes_results_summary_and_plot(tmp_path: Path, cache: Path) -> None:
    """The issue's check, smaller: two jobs, one results.json each, the combined table with
    speedups vs spec=none, summary files and the plot in the sweep directory."""
    r = run_cli(
        "-m", "model=qwen3_tiny", "spec=none,oracle", "workload.max_new_tokens=9",
        "workload.num_requests=2", "workload.concurrency=1", cache=cache, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("TTFT mean") == 2
    (sweep,) = tmp_path.glob("multirun/*/*")  # Hydra's multirun/<date>/<time>/<job_num>/
    jobs = [json.loads((sweep / str(k) / "results.json").read_text()) for k in (0, 1)]
    assert all(job.keys() >= RESULT_KEYS for job in jobs)
    none, oracle = jobs
    assert (none["spec"], oracle["spec"], oracle["gamma"]) == ("none", "oracle", 3)
    assert set(oracle["acceptance"]) >= {"aggregate", "per_position", "full_block", "zero_accept"}
    assert oracle["acceptance"]["aggregate"] == 1.0 and oracle["mean_committed_per_step"] > 1
    req = oracle["requests"][0]
    assert len(req["output_token_ids"]) == 9 and req["prompt_tokens"] > 0 and req["error"] is None
    assert {"ttft_ms", "tpot_ms", "e2e_ms"} <= req.keys()
    rows = json.loads((sweep / "summary.json").read_text())
    assert rows[0]["speedup_tpot"] == 1.0 and rows[1]["speedup_tpot"] > 0
    assert "speedup TPOT" in r.stdout and (sweep / "summary.md").read_text().strip() in r.stdout
    assert (sweep / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeats_report_medians_with_spread(tmp_path: Path, cache: Path) -> None:
    r = run_cli(
        "-m",
        "spec=none,oracle",
        "model=qwen3_tiny",
        "workload.repeats=3",
        "workload.max_new_tokens=3",
        "workload.num_requests=1",
        f"hydra.sweep.dir={tmp_path}",
        cache=cache,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("[repeat 3/3]") == 2
    assert "median ±half the min-max range over 3 repeat(s)" in r.stdout
    table = r.stdout.split("speedup tok/s |")[1].splitlines()[2:4]
    assert all(line.count("±") == 4 for line in table), table  # tok/s TTFT queue TPOT; ratios plain
    job = json.loads((tmp_path / "1" / "results.json").read_text())
    assert job["num_repeats"] == 3 and len(job["repeats"]) == 3 and len(job["requests"]) == 3
    median = sorted(run["tpot_ms_mean"] for run in job["repeats"])[1]
    assert job["tpot_ms_mean"] == median


def test_multirun_checks_every_job_before_running_any(cache: Path) -> None:
    """The second job cannot run (MTP needs a DeepSeek-V4 target): nothing runs, exit 2."""
    r = run_cli("-m", "spec=none,mtp", "model=qwen3_tiny", "platform=cpu", cache=cache)
    assert r.returncode == 2, r.stderr + r.stdout
    assert "Traceback" not in r.stderr
    assert "1 of 2 jobs cannot run" in r.stderr and "job spec=mtp model=qwen3_tiny" in r.stderr
    assert "needs a DeepSeek-V4 target" in r.stderr
    assert "TTFT" not in r.stdout  # the good first job did not run either


def test_bad_dsv4_checkpoint_exits_2(tmp_path: Path, cache: Path) -> None:
    import json
    import shutil

    from xspec.models.deepseek_v4.tiny import tiny_dir

    bad = tmp_path / "ckpt"
    shutil.copytree(tiny_dir(), bad)
    cfg = json.loads((bad / "config.json").read_text())
    del cfg["hidden_size"]
    cfg["compress_ratios"][2] = 16  # not a DeepSeek-V4 ratio
    (bad / "config.json").write_text(json.dumps(cfg))
    r = run_cli(
        "model=dsv4_flash", f"model.path={bad}", "model.tokenizer=byte", "platform=cpu", cache=cache
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "hidden_size" in r.stderr and "compress_ratios" in r.stderr and "config.json" in r.stderr
