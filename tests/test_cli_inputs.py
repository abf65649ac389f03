"""Bad CLI inputs found before any job runs, in-process: requests the model context
cannot hold, NaN / infinite floats and memory beyond any device, an output directory
that is a file or on a file system that takes none, a --config-dir file that is not
plain YAML, model.max_context beyond the checkpoint's trained context; and a run whose
every request failed reports n/a instead of dividing by zero."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from xspec.__main__ import _override_sets, check_jobs, main
from xspec.engine.engine import Generation
from xspec.errors import ConfigError
from xspec.run.report import format_timings, timings

# qwen3_tiny: max_position_embeddings 2048, byte tokenizer (one token per byte); spec=none
QWEN = ["model=qwen3_tiny", "spec=none", "platform=cpu"]


def problems_of(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        check_jobs([[*QWEN, *overrides]])
    return e.value.problems or [str(e.value)]


def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> str:
    """``python -m xspec ARGS`` in-process, for a user error: exit code 2, the stderr text."""
    monkeypatch.setattr(sys, "argv", ["xspec", *args])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("xspec: error:") and "Traceback" not in err
    return err


# -- 6: every request must fit the model context --------------------------------------


def test_synthetic_prompt_longer_than_the_context() -> None:
    (p,) = problems_of(
        "workload=synthetic", "workload.input_len=5000", "workload.output_len=4",
        "workload.num_requests=2",
    )  # fmt: skip
    assert "workload.input_len=5000 + workload.output_len=4 = 5004 tokens" in p
    assert "model context of 2048 tokens (the checkpoint's max_position_embeddings)" in p
    assert "keep workload.input_len + workload.output_len <= 2048" in p


def test_max_new_tokens_that_no_prompt_can_fit() -> None:
    (p,) = problems_of("workload.prompts=[abc,hello]", "workload.max_new_tokens=1000000000")
    assert p.startswith("workload.max_new_tokens=1000000000 is too large for the model context")
    assert "workload.prompts[0], workload.prompts[1]" in p
    assert "set workload.max_new_tokens <= 2043" in p  # 2048 - the longest prompt's 5 tokens


def test_max_context_names_the_long_prompt_and_the_budget() -> None:
    """model.max_context=100: a 150-token prompt cannot get even one token; a 90-token one
    fits, but not with max_new_tokens=64 (today both were dropped and the run exited 0)."""
    problems = problems_of(
        "model.max_context=100", f"workload.prompts=[{'x' * 150},{'y' * 90}]",
        "workload.max_new_tokens=64",
    )  # fmt: skip
    assert len(problems) == 2, problems
    assert "workload.prompts[0] is 150 tokens long" in problems[0]
    assert (
        "(model.max_context=100)" in problems[0]
        and "raise model.max_context (up to 2048)" in problems[0]
    )
    assert "workload.max_new_tokens=64 is too large" in problems[1]
    assert "set workload.max_new_tokens <= 10" in problems[1]


def test_unused_prompts_and_own_budgets_of_a_prompts_file(tmp_path: Path) -> None:
    """A file line's own max_new_tokens is named by file and line; lines beyond
    workload.num_requests are never sent, so they are not checked."""
    file = tmp_path / "p.jsonl"
    lines = [
        {"prompt_token_ids": [5] * 2000, "max_new_tokens": 100},
        {"prompt": "short"},
        {"prompt_token_ids": [5] * 3000},  # not sent: num_requests=2
    ]
    file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    (p,) = problems_of(f"workload.prompts_file={file}", "workload.num_requests=2")
    assert p.startswith(f"{file}:1 max_new_tokens=100 is too large") and "<= 48" in p


def test_cli_exits_2_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    err = cli(
        monkeypatch, capsys, *QWEN, "model.max_context=100", f"workload.prompts=[{'x' * 150}]"
    )
    assert "workload.prompts[0] is 150 tokens long" in err


def test_max_prefill_tokens_below_one_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    err = cli(monkeypatch, capsys, *QWEN, "engine.max_prefill_tokens=0")
    assert "engine.max_prefill_tokens must be >= 1" in err and "(got 0)" in err


def test_a_run_where_every_request_failed_reports_na() -> None:
    """No token, zero wall time: no ZeroDivisionError, the figures are n/a."""
    failed = [
        Generation([1] * 9, [], 0.0, 0.0, 0, error=f"request {i}: too long") for i in range(2)
    ]
    text = format_timings(failed)
    assert "requests=2 output_tokens=0" in text and "n/a" in text
    assert timings(failed).throughput is None


# -- 7: NaN / infinity in any float field ----------------------------------------------


@pytest.mark.parametrize(
    "override",
    [
        "engine.memory_budget=nan",
        "engine.memory_budget=inf",
        "parallel.timeout_s=nan",
        "parallel.timeout_s=-inf",
        "sampling.temperature=inf",
        "sampling.top_p=nan",
    ],
)
def test_nonfinite_floats_are_refused(override: str) -> None:
    key, value = override.split("=")
    for full in (True, False):  # a run, and --cfg job
        with pytest.raises(ConfigError) as e:
            check_jobs([[*QWEN, override]], full=full)
        assert e.value.problems == [
            f"{key} must be a finite number (got {float(value)}): NaN and infinity are not "
            "allowed; give a finite value or leave the key at its default"
        ]


def test_a_nan_job_stops_the_sweep_before_its_first_job() -> None:
    sets = _override_sets(["-m", *QWEN, "engine.memory_budget=0.5,nan"])
    with pytest.raises(ConfigError, match=r"1 of 2 jobs cannot run \(no job was started\)") as e:
        check_jobs(sets)
    assert "engine.memory_budget must be a finite number (got nan)" in str(e.value)


def test_memory_beyond_any_device_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """1e300 GiB is not even a finite number of bytes: one message, not an OverflowError."""
    err = cli(monkeypatch, capsys, *QWEN, "engine.device_memory_gib=1e300")
    assert "engine.device_memory_gib must be > 0 and at most 1048576 GiB (1 PiB)" in err


# -- 11: Hydra's output directory ------------------------------------------------------


def test_output_dir_that_is_a_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    file = tmp_path / "results.txt"
    file.write_text("not a directory")
    with pytest.raises(ConfigError) as e:
        check_jobs([[*QWEN, f"hydra.run.dir={file}"]])
    (p,) = e.value.problems or []
    assert p.startswith(f"hydra.run.dir={file}: {file} is an existing file")
    assert "pick a directory" in p
    err = cli(monkeypatch, capsys, "-m", *QWEN, "spec=none,oracle", f"hydra.sweep.dir={file}/sweep")
    assert f"hydra.sweep.dir={file}/sweep: {file}/sweep is under the file {file}" in err
    check_jobs([[*QWEN, f"hydra.run.dir={tmp_path}/new/run"]])  # a new directory is fine


# -- issue 53, 16: an output directory on a file system that takes none ----------------

# /proc takes no new entry, for root too (the tests run as root, which a directory
# without write permission would not stop)
NO_DIRS = Path("/proc/xspec-out")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux /proc")
def test_output_dir_where_no_directory_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    err = cli(monkeypatch, capsys, *QWEN, f"hydra.run.dir={NO_DIRS}/run")
    assert f"hydra.run.dir={NO_DIRS}/run: no directory can be made in /proc (" in err
    assert "pick a directory you can write" in err
    err = cli(monkeypatch, capsys, "-m", *QWEN, "spec=none,oracle", f"hydra.sweep.dir={NO_DIRS}")
    assert f"hydra.sweep.dir={NO_DIRS}: no directory can be made in /proc" in err
    # a writable place passes, and the check leaves nothing behind (nor makes the dir)
    check_jobs([[*QWEN, f"hydra.run.dir={tmp_path}/new/run"]], multirun=False)
    assert list(tmp_path.iterdir()) == []
    # the directory a run does not use is not tried: a single run's sweep dir
    check_jobs([[*QWEN, f"hydra.run.dir={tmp_path}/run", f"hydra.sweep.dir={NO_DIRS}"]])


# -- issue 53, 17: YAML and JSON a user points at --------------------------------------

MODEL_YAML = "defaults:\n  - /schema/model@_here_\narch: qwen3\npreset: tiny\n"


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (MODEL_YAML + "x: !!python/object:os.system\n  a: 1\n",
         "model/evil.yaml:5:4: not a valid config file: could not determine a constructor for the tag 'tag:yaml.org,2002:python/object:os.system'; config files hold plain values only (no Python tags)"),
        (MODEL_YAML + "x: !!python/name:os.system ''\n", "model/evil.yaml:5:4: not a valid config file: could not determine a constructor for the tag 'tag:yaml.org,2002:python/name:os.system'"),
        (MODEL_YAML + "x: [1\n", "model/evil.yaml:6:1: not a valid config file: expected ',' or ']'"),
        (b"\xff\xfe" + MODEL_YAML.encode(), "model/evil.yaml: not a valid config file: not UTF-8 text (invalid start byte at byte 0)"),
        (MODEL_YAML + "x: " + "[" * 300 + "]" * 300 + "\n", "model/evil.yaml: not a valid config file: nested 301 levels deep, too deep"),
    ],
)  # fmt: skip
def test_config_dir_file_that_is_not_plain_yaml(
    content: str | bytes,
    needle: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """One problem naming the file (and line), exit 2; never a ConstructorError traceback."""
    (tmp_path / "model").mkdir()
    file = tmp_path / "model" / "evil.yaml"
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content)
    err = cli(monkeypatch, capsys, "--config-dir", str(tmp_path), "model=evil", "spec=none")
    assert err.startswith("xspec: error: this run cannot be built:\n  - "), err
    assert len(err.strip().splitlines()) == 2 and f"{tmp_path}/{needle}" in err, err


def test_prompts_file_line_nested_too_deep(tmp_path: Path) -> None:
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    (p,) = problems_of(f"workload.prompts_file={file}")
    assert p == f"{file}:2: not a prompt line (JSON nested too deep)"


# -- issue 53, 18: model.max_context above what the checkpoint was trained for ---------


def test_max_context_above_the_trained_context(tmp_path: Path) -> None:
    """Refused before anything loads; a checkpoint whose YaRN rope_scaling reaches further
    is told how to declare it (its config.json's max_position_embeddings)."""
    from xspec.models.qwen3.tiny import tiny_dir

    (p,) = problems_of("model.max_context=4096")  # qwen3_tiny: trained for 2048
    assert p == (
        "model.max_context=4096 is above the checkpoint's trained context of 2048 tokens "
        "(config.json max_position_embeddings): positions past it were never trained and the "
        "output degrades without an error; set model.max_context <= 2048 or leave it null"
    )
    yarn = tmp_path / "yarn"
    shutil.copytree(tiny_dir(False), yarn)
    config = json.loads((yarn / "config.json").read_text())
    config["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 2048,
    }
    (yarn / "config.json").write_text(json.dumps(config))
    run = ["model=qwen3", f"model.path={yarn}", "model.tokenizer=byte", "spec=none", "platform=cpu"]
    with pytest.raises(ConfigError) as e:
        check_jobs([[*run, "model.max_context=8192"]])
    assert "Its rope_scaling (YaRN, factor 4 over 2048 tokens) reaches 8192 tokens: to use " in str(
        e.value
    )
    assert "set max_position_embeddings to 8192 in its config.json" in str(e.value)
    config["max_position_embeddings"] = 8192  # the opt-in
    (yarn / "config.json").write_text(json.dumps(config))
    check_jobs([[*run, "model.max_context=8192"]])


def test_dsv4_max_context_above_the_trained_context_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """DeepSeek-V4 accepted it and ran (Qwen3 refused it only once loading)."""
    err = cli(monkeypatch, capsys, "model=dsv4_tiny_random", "spec=none", "platform=cpu",
              "model.max_context=8192", "workload.num_requests=1", "workload.max_new_tokens=1")  # fmt: skip
    assert "model.max_context=8192 is above the checkpoint's trained context of 4096" in err
