"""Workloads: JSONL prompts files (errors name file and line), synthetic prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xspec.config import WorkloadConfig, WorkloadKind
from xspec.errors import ConfigError
from xspec.run.workloads import load_workload, read_prompts_file, workload_problems
from xspec.sampling import SamplingParams
from xspec.tokenizer import ByteTokenizer, plain_token_ids

TOK = ByteTokenizer(vocab_size=300, bos_id=0, stop_ids=[1])
PARAMS = SamplingParams(seed=5)


def write(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_prompts_file_text_and_token_ids_with_own_budget(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"prompt": "hi"}),
        json.dumps({"prompt_token_ids": [7, 8, 9], "max_new_tokens": 3}),
    )
    w = WorkloadConfig(prompts_file=path, num_requests=3, max_new_tokens=11)
    work = load_workload(w, TOK, 300, PARAMS)
    assert [r.prompt_ids for r in work.requests] == [TOK.encode("hi"), [7, 8, 9], TOK.encode("hi")]
    assert [r.max_new_tokens for r in work.requests] == [11, 3, 11]  # the line's own budget wins
    assert [r.params.seed for r in work.requests] == [5, 6, 7]
    assert work.texts == ["hi", "<3 token ids>", "hi"]


def test_every_bad_line_is_reported_with_file_and_line_number(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        json.dumps({"prompt": "fine"}),
        '{"prompt": "unterminated',
        json.dumps({"prompt": "a", "prompt_token_ids": [1]}),
        json.dumps({"prompt_token_ids": [1, -2]}),
        json.dumps({"prompt": "x", "max_new_tokens": 0}),
        "",
        json.dumps({"text": "x"}),
        json.dumps(["x"]),
    )
    with pytest.raises(ConfigError) as e:
        read_prompts_file(path)
    problems = e.value.problems
    assert [p.split(": ", 1)[0] for p in problems] == [f"{path}:{n}" for n in range(2, 9)]
    assert "not valid JSON" in problems[0] and "exactly one of" in problems[1]
    assert "non-negative" in problems[2] and '"max_new_tokens"' in problems[3]
    assert "unknown key" in problems[5] and "JSON object" in problems[6]
    # the CLI's up-front check sees the same problems
    assert workload_problems(WorkloadConfig(prompts_file=path)) == problems


def test_missing_and_empty_prompts_files(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.jsonl")
    assert "does not exist" in workload_problems(WorkloadConfig(prompts_file=missing))[0]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "has no prompts" in workload_problems(WorkloadConfig(prompts_file=str(empty)))[0]
    assert "workload.prompts is empty" in workload_problems(WorkloadConfig())[0]


def test_synthetic_lengths_seeding_and_id_range() -> None:
    w = WorkloadConfig(kind=WorkloadKind.synthetic, input_len=40, output_len=6, num_requests=5)
    a = load_workload(w, TOK, 300, PARAMS).requests
    assert len(a) == 5
    assert all(len(r.prompt_ids) == 40 and r.max_new_tokens == 6 and r.ignore_eos for r in a)
    allowed = set(plain_token_ids(TOK, 300))
    assert allowed == set(range(TOK.offset, TOK.offset + 256))  # decodable, no bos/stop ids
    assert all(set(r.prompt_ids) <= allowed for r in a)
    assert [r.prompt_ids for r in load_workload(w, TOK, 300, PARAMS).requests] == [
        r.prompt_ids for r in a
    ]  # same seed, same prompts
    w.seed = 1
    assert load_workload(w, TOK, 300, PARAMS).requests[0].prompt_ids != a[0].prompt_ids
    assert len({tuple(r.prompt_ids) for r in a}) == 5


def test_synthetic_run_generates_exact_lengths() -> None:
    import xspec
    from xspec.config import SamplingConfig
    from xspec.run.report import run_workload

    built = xspec.LLM(model="qwen3_tiny", spec="none", platform="cpu")._built
    w = WorkloadConfig(
        kind=WorkloadKind.synthetic, input_len=9, output_len=4, num_requests=3, concurrency=2,
        warmup_requests=0, print_outputs=False,
    )  # fmt: skip
    import io

    (gens,) = run_workload(built, w, SamplingConfig(), io.StringIO())
    assert [(len(g.prompt_ids), len(g.token_ids)) for g in gens] == [(9, 4)] * 3


def test_requests_the_context_cannot_hold_are_refused_at_load(tmp_path: Path) -> None:
    """After the build, the loaded model's limit, gamma and tokenizer decide: a prompt that
    cannot get one token, a budget too large for a prompt, a request the memory plan cannot
    hold are one ConfigError before the run (the engine would drop them one by one)."""
    from xspec.run.workloads import ContextFit

    fit = ContextFit(40, 2, TOK.encode, "model.max_context=40", raise_to=100)
    w = WorkloadConfig(prompts=["x" * 38, "y" * 20, "z" * 5], max_new_tokens=30, num_requests=3)
    with pytest.raises(ConfigError) as e:
        load_workload(w, TOK, 300, PARAMS, fit)
    assert e.value.problems == [
        "workload.prompts[0] is 38 tokens long: with 1 new token + 2 draft rows it already "
        "exceeds the model context of 40 tokens (model.max_context=40); shorten it to at most "
        "37 tokens or raise model.max_context (up to 100)",
        "workload.max_new_tokens=30 is too large for the model context of 40 tokens "
        "(model.max_context=40) with workload.prompts[1] (longest: 20 prompt tokens + 30 new + "
        "2 draft rows = 52); set workload.max_new_tokens <= 18, shorten the prompt or raise "
        "model.max_context (up to 100)",
    ]  # prompts[2] fits: 5 + 30 + 2 <= 40
    w.num_requests = 1  # only the prompts actually sent are checked
    w.prompts = ["z" * 5, "x" * 38]
    assert len(load_workload(w, TOK, 300, PARAMS, fit).requests) == 1

    def memory(prompt_len: int, max_new_tokens: int) -> str | None:
        return "needs 9 bytes but the plan has 8" if prompt_len > 3 else None

    synthetic = WorkloadConfig(kind=WorkloadKind.synthetic, input_len=4, output_len=2)
    with pytest.raises(ConfigError) as e:
        load_workload(synthetic, TOK, 300, PARAMS, ContextFit(40, 2, None, memory=memory))
    assert e.value.problems == [
        "workload.input_len=4 (4 prompt tokens + workload.output_len=2): needs 9 bytes but "
        "the plan has 8"
    ]
