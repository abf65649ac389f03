"""lm-evaluation-harness against the server: its generate_until request, in its exact
shape, gives ``LLM.generate``'s greedy text; and (slow) the harness itself runs a local
task of each kind (tests/serve/lm_eval_tasks: a multiple-choice loglikelihood task and a
generate_until task) through ``local-completions``, its loglikelihoods equal to
``xspec.LLM.score``'s and its generations to ``LLM.generate``'s greedy ones."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import xspec
from tests.serve.conftest import LiveServer, start_server

FP32 = {"model.dtype": "float32"}
TASKS = Path(__file__).parent / "lm_eval_tasks"
STOP = ["\n\n"]  # the generation task's ``until``
MAX_GEN = 8  # its max_gen_toks


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    server = start_server("dsv4_tiny", "mtp", FP32)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference() -> xspec.LLM:
    """``spec=none`` on the same weights, outside the server."""
    return xspec.LLM(model="dsv4_tiny", spec="none", platform="cpu", overrides=FP32)


def test_generate_until_request_equals_generate(live: LiveServer, reference: xspec.LLM) -> None:
    """``LocalCompletionsAPI._create_payload(generate=True)`` as the harness sends it with
    its remote tokenizer and ``--batch_size 2``: token-id prompts in a list, ``stop``,
    ``max_tokens``, ``temperature: 0``, ``seed``; each choice is that prompt's greedy
    ``LLM.generate`` text, cut before the stop string."""
    prompts = ["def fibonacci(n):\n", "Once upon a time"]
    ids = [reference.tokenizer.encode(p, special=False) for p in prompts]
    payload = {
        "prompt": ids, "model": live.name, "max_tokens": MAX_GEN, "temperature": 0.0,
        "stop": STOP, "seed": 1234,
    }  # fmt: skip
    r = httpx.post(live.url + "/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    want = [reference.generate(i, MAX_GEN, stop=STOP)[0].text for i in ids]
    assert texts == want


def _encode_pair(llm: xspec.LLM, context: str, continuation: str) -> tuple[list[int], int]:
    """The harness's ``_encode_pair`` (a causal model) with the server's tokenizer: the
    context's trailing spaces move to the continuation; the pair is encoded whole and
    split at the context's length. Returns the pair's ids and the context's length."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = llm.tokenizer.encode(context + continuation, special=False)
    return whole, len(llm.tokenizer.encode(context, special=False))


def _samples(out: Path, task: str) -> list[dict]:
    (path,) = out.rglob(f"samples_{task}_*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None or importlib.util.find_spec("tenacity") is None,
    reason="lm-evaluation-harness is not installed (pip install -e '.[eval]')",
)
def test_lm_eval_harness_runs_both_kinds(
    live: LiveServer, reference: xspec.LLM, tmp_path: Path
) -> None:
    args = (
        f"model={live.name},base_url={live.url}/v1/completions,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1"
    )
    cmd = [
        sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
        "--tasks", "xspec_choice,xspec_gen", "--include_path", str(TASKS),
        "--output_path", str(tmp_path), "--log_samples", "--batch_size", "1",
    ]  # fmt: skip
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # the tasks' data_files are relative to the working directory: the tasks' folder
    r = subprocess.run(cmd, cwd=TASKS, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    choice = _samples(tmp_path, "xspec_choice")
    assert len(choice) == 3
    for sample in choice:
        pairs = sample["arguments"].values()
        for pair, (ll, greedy) in zip(pairs, sample["filtered_resps"], strict=True):
            ids, ctxlen = _encode_pair(reference, pair["arg_0"], pair["arg_1"])
            lp = torch.log_softmax(reference.score(ids), dim=-1)  # [T, V]
            rows = range(ctxlen, len(ids))
            assert float(ll) == sum(lp[i - 1, ids[i]].item() for i in rows)
            argmax = all(lp[i - 1].argmax().item() == ids[i] for i in rows)
            assert greedy == str(argmax)
    gen = _samples(tmp_path, "xspec_gen")
    assert len(gen) == 3
    for sample in gen:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = reference.tokenizer.encode(prompt, special=False)
        want = reference.generate(ids, MAX_GEN, stop=STOP)[0].text
        assert sample["filtered_resps"] == [want]
