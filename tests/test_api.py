"""The Python API and the speculative machinery on the Qwen3 tiny preset (fast)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import xspec
from tests.test_tokenizer import write_word_tokenizer
from xspec.errors import CheckpointError, ConfigError, RequestError

PROMPTS = [[5, 17, 42, 99, 3], list(range(60, 100)), [300, 7]]


@pytest.fixture(scope="module")
def base() -> xspec.LLM:
    return xspec.LLM(
        model="qwen3_tiny", spec="none", platform="cpu", overrides={"model.dtype": "float32"}
    )


def test_generate_ids_and_text(base: xspec.LLM) -> None:
    outs = base.generate(PROMPTS, max_new_tokens=12, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [12, 12, 12]
    assert all(o.ttft_s > 0 and o.latency_s >= o.ttft_s and o.tpot_s > 0 for o in outs)
    assert outs[0].prompt_ids == PROMPTS[0]  # ids used exactly as given: no BOS added
    text = base.generate("hello", max_new_tokens=4, ignore_eos=True)[0]
    assert isinstance(text.text, str) and len(text.token_ids) == 4


def test_batched_equals_single(base: xspec.LLM) -> None:
    batched = base.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
    single = [base.generate([p], max_new_tokens=10, ignore_eos=True)[0] for p in PROMPTS]
    assert [o.token_ids for o in batched] == [o.token_ids for o in single]
    # concurrency 1: continuous batching admits one at a time, same tokens
    serial = base.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, concurrency=1)
    assert [o.token_ids for o in serial] == [o.token_ids for o in batched]


def test_score_matches_greedy(base: xspec.LLM) -> None:
    out = base.generate([PROMPTS[1]], max_new_tokens=6, ignore_eos=True)[0]
    logits = base.score(PROMPTS[1] + out.token_ids[:-1])  # [T, V]
    greedy = logits[len(PROMPTS[1]) - 1 :].argmax(-1).tolist()
    assert greedy == out.token_ids


def test_seeded_sampling_reproducible(base: xspec.LLM) -> None:
    a = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
    )
    b = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True
    )
    c = base.generate(
        PROMPTS, max_new_tokens=8, temperature=1.0, top_p=0.9, seed=8, ignore_eos=True
    )
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


NAN_TENSOR = "model.layers.1.mlp.up_proj.weight"


def _llm(*overrides: str, model: str = "qwen3_tiny") -> xspec.LLM:
    return xspec.LLM(model=model, spec="none", platform="cpu", overrides=list(overrides))


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_bad_dirs(tmp_path_factory.mktemp("bad"))


def make_bad_dirs(root: Path) -> dict[str, Path]:
    """Copies of the Qwen3 tiny preset under ``root`` (each with a tokenizer.json unless
    noted): no_tokenizer, truncated (a shard), nan (one weight), ok; and a_file (a file)."""
    from safetensors.torch import load_file, save_file

    from xspec.models.qwen3.tiny import tiny_dir

    src = tiny_dir(False)
    out = {}
    for name in ("no_tokenizer", "truncated", "nan", "ok"):
        out[name] = root / name
        shutil.copytree(src, out[name])
        if name != "no_tokenizer":
            write_word_tokenizer(out[name] / "tokenizer.json")
    shard = out["truncated"] / "model-00001-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = out["nan"] / index["weight_map"][NAN_TENSOR]
    tensors = load_file(shard)
    tensors[NAN_TENSOR][3, 5] = math.nan
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (root / "a_file").write_text("not a directory")
    out["a_file"] = root / "a_file"
    return out


# One row per bad input: (id, call, the typed error, a substring of its message).
BAD_INPUTS = [
    ("empty ids", lambda llm, d: llm.generate([[]]), RequestError, "empty prompt"),
    ("empty text", lambda llm, d: llm.generate([""]), RequestError, "empty prompt"),
    ("id >= vocab", lambda llm, d: llm.generate([[1, 2, 100000]]), RequestError, "outside the vocabulary"),
    ("negative id", lambda llm, d: llm.generate([[-1]]), RequestError, "outside the vocabulary"),
    ("max_new_tokens=0", lambda llm, d: llm.generate([[1, 2]], max_new_tokens=0), RequestError, "max_new_tokens"),
    ("temperature<0", lambda llm, d: llm.generate([[1, 2]], temperature=-1.0), RequestError, "temperature"),
    ("float ids", lambda llm, d: llm.generate([[1.7, 2.2]]), RequestError, "token ids must be integers, got 1.7"),
    ("float ids, one prompt", lambda llm, d: llm.generate([1.0, 2]), RequestError, "must be integers"),
    ("max_new_tokens=2.5", lambda llm, d: llm.generate([[1]], max_new_tokens=2.5), RequestError, "max_new_tokens must be an integer"),
    ("max_new_tokens='4'", lambda llm, d: llm.generate([[1]], max_new_tokens="4"), RequestError, "max_new_tokens must be an integer"),
    ("concurrency=0", lambda llm, d: llm.generate([[1]], concurrency=0), RequestError, "concurrency must be an integer >= 1"),
    ("concurrency=-1", lambda llm, d: llm.generate([[1]], concurrency=-1), RequestError, "concurrency must be an integer >= 1"),
    ("seed='abc'", lambda llm, d: llm.generate([[1]], seed="abc"), RequestError, "seed must be null or an integer"),
    ("ignore_eos='no'", lambda llm, d: llm.generate([[1]], ignore_eos="no"), RequestError, "ignore_eos"),
    ("generate(None)", lambda llm, d: llm.generate(None), RequestError, "prompts must be a string"),
    ("generate(123)", lambda llm, d: llm.generate(123), RequestError, "prompts must be a string"),
    ("a None prompt", lambda llm, d: llm.generate([[1], None]), RequestError, "request 1: a prompt is"),
    ("bytes prompt", lambda llm, d: llm.generate(b"def f"), RequestError, "prompts: got bytes b'def f'; a prompt is text (str) or a list of int token ids, not bytes: decode it first"),
    ("bytearray prompt", lambda llm, d: llm.generate(bytearray(b"ab")), RequestError, "not bytes: decode it first"),
    ("memoryview prompt", lambda llm, d: llm.generate(memoryview(b"ab")), RequestError, "not bytes: decode it first"),
    ("bytes in a list", lambda llm, d: llm.generate(["ok", b"ab"]), RequestError, "request 1: got bytes b'ab'"),
    ("score bytes", lambda llm, d: llm.score(b"ab"), RequestError, "score: got bytes b'ab'"),
    ("score ragged", lambda llm, d: llm.score([[1, 2], [3]]), RequestError, "score takes one sequence"),
    ("score float", lambda llm, d: llm.score([1, 2.5]), RequestError, "must be integers"),
    ("overrides str", lambda llm, d: xspec.LLM(model="qwen3_tiny", overrides="model.dtype=float16"), ConfigError, "overrides must be a mapping"),
    ("override int", lambda llm, d: _llm(7), ConfigError, "'key=value' strings"),
    ("prompts ids", lambda llm, d: xspec.LLM(model="qwen3_tiny", overrides={"workload.prompts": [1, 2]}), ConfigError, "workload.prompts holds text"),
    ("dtype float64", lambda llm, d: _llm("model.dtype=float64"), ConfigError, "float32, bfloat16, float16"),
    ("num_requests=abc", lambda llm, d: _llm("workload.num_requests=abc"), ConfigError, "Integer"),
    ("empty prompt text", lambda llm, d: _llm("workload.prompts=[a,'']"), ConfigError, "workload.prompts[1] is an empty string"),
    ("device_index=99", lambda llm, d: _llm("platform.device_index=99"), ConfigError, "platform.device_index=99"),
    ("no tokenizer.json", lambda llm, d: _llm(f"model.path={d['no_tokenizer']}", model="qwen3"), CheckpointError, "tokenizer.json is missing"),
    ("truncated shard", lambda llm, d: _llm(f"model.path={d['truncated']}", model="qwen3"), CheckpointError, "model-00001-of-00003.safetensors is truncated"),
    ("NaN weight", lambda llm, d: _llm(f"model.path={d['nan']}", model="qwen3"), CheckpointError, "'model.layers.1.mlp.up_proj.weight' in"),
    ("qwen3 as dsv4", lambda llm, d: _llm(f"model.path={d['ok']}", model="dsv4_flash"), CheckpointError, "this is a Qwen3 checkpoint"),
    ("qwen3 as draft", lambda llm, d: xspec.LLM(model="dsv4_tiny_random", spec="mtp", platform="cpu", overrides={"spec.draft_path": str(d["ok"])}), ConfigError, "this is a Qwen3 checkpoint"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("call", "error", "needle"), [row[1:] for row in BAD_INPUTS], ids=[row[0] for row in BAD_INPUTS]
)
def test_bad_inputs_raise_typed_errors(
    base: xspec.LLM, bad_dirs: dict[str, Path], call, error: type, needle: str
) -> None:
    with pytest.raises(error) as e:
        call(base, bad_dirs)
    assert needle in str(e.value), str(e.value)


def test_unusable_cache_dir(bad_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XSPEC_CACHE_DIR", str(bad_dirs["a_file"]))
    with pytest.raises(CheckpointError, match="set XSPEC_CACHE_DIR to a writable directory"):
        _llm()


@pytest.mark.parametrize("gamma", [1, 3])
def test_oracle_and_wrong_drafters(base: xspec.LLM, gamma: int) -> None:
    # 17 = 1 (prefill) + 16, a multiple of gamma + 1: the oracle fills every block
    ref = base.generate(PROMPTS, max_new_tokens=17, ignore_eos=True)
    for method, rate in (("oracle", 1.0), ("wrong", 0.0)):
        llm = xspec.LLM(
            model="qwen3_tiny",
            spec=method,
            platform="cpu",
            overrides={"spec.num_speculative_tokens": gamma},
        )
        outs = llm.generate(PROMPTS, max_new_tokens=17, ignore_eos=True)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], method
        rep = llm.metrics.report()
        assert rep.acceptance_rate == pytest.approx(rate), method
        expected_per_step = gamma + 1 if rate == 1.0 else 1
        assert rep.mean_tokens_per_step == pytest.approx(expected_per_step), method


def test_score_shape(base: xspec.LLM) -> None:
    logits = base.score([1, 2, 3])
    assert logits.shape == (3, base._built.target.vocab_size) and logits.dtype == torch.float32


def test_continuous_batching_with_staggered_finishes(base: xspec.LLM) -> None:
    """Requests finishing at different steps free their slot for a waiting one; the
    sequences still running while a newcomer is prefilled must not repeat a token."""
    from xspec.engine.engine import Request
    from xspec.sampling import SamplingParams

    lengths = [3, 11, 5, 8]
    requests = [  # sampled (seeded per request): the random tiny model repeats tokens under greedy
        Request(PROMPTS[i % 3], n, SamplingParams(temperature=1.0, seed=i), ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    staggered = base._built.engine.run(requests, concurrency=2)
    alone = [base._built.engine.run([r], concurrency=1)[0] for r in requests]
    assert [len(g.token_ids) for g in staggered] == lengths
    assert [g.token_ids for g in staggered] == [g.token_ids for g in alone]


@pytest.mark.parametrize(("spec", "when"), [("none", "prefill"), ("oracle", "decode")])
def test_nonfinite_logits_fail_one_request_only(
    base: xspec.LLM, monkeypatch: pytest.MonkeyPatch, spec: str, when: str
) -> None:
    """A request whose target logits turn NaN ends alone with ``error`` set; its batch mates
    finish with exactly the tokens they get without it."""
    llm = base if spec == "none" else xspec.LLM(model="qwen3_tiny", spec=spec, platform="cpu")
    target = llm._built.target
    ref = llm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    marked: list[object] = []  # request 1's decoding state
    forward = target.forward

    def faulty(batch):  # NaN logits for request 1, from its prefill or its first decode step
        out = forward(batch)
        scored = range(len(batch.input_ids)) if batch.logit_rows is None else batch.logit_rows
        start = 0
        for n, state in zip(batch.seq_lens, batch.states):
            if int(batch.input_ids[start]) == PROMPTS[1][0] and n == len(PROMPTS[1]):
                marked.append(state)  # request 1's prefill
                poison = when == "prefill"
            else:
                poison = when == "decode" and any(state is m for m in marked)
            if poison:  # the logits rows of this sequence's scored rows
                out.logits[[k for k, r in enumerate(scored) if start <= r < start + n]] = math.nan
            start += n
        return out

    monkeypatch.setattr(target, "forward", faulty)
    outs = llm.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert outs[1].error is not None and "request 1" in outs[1].error and "NaN" in outs[1].error
    assert [o.error for o in (outs[0], outs[2])] == [None, None]
    assert [outs[0].token_ids, outs[2].token_ids] == [ref[0].token_ids, ref[2].token_ids]
    assert len(outs[1].token_ids) < 8


@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_generate_after_an_interrupt_mid_run(
    base: xspec.LLM, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """A KeyboardInterrupt inside ``generate`` (here from the target's forward, in the
    first prefill or the third decode step) leaves nothing in flight: the next calls,
    streamed or not, run and give the same outputs as before."""
    ref = base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    target = base._built.target
    forward, calls = target.forward, [0]

    def interrupted(batch):
        calls[0] += 1
        if calls[0] == (1 if when == "prefill" else 4):
            raise KeyboardInterrupt
        return forward(batch)

    monkeypatch.setattr(target, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    monkeypatch.undo()
    assert not base._built.engine.busy and base._built.engine.pool.reserved == 0
    again = base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
    streamed = list(base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, stream=True))
    assert sum(len(d.token_ids) for d in streamed) == 3 * 8


def test_generate_after_a_stream_left_by_an_exception(base: xspec.LLM) -> None:
    """An exception in the loop that reads a stream leaves its generator suspended (the
    traceback holds it); the next call ends that stream and runs, and reading on from
    the old stream says why it ended."""
    ref = base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    stream = base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True, stream=True)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            raise KeyboardInterrupt
    again = base.generate(PROMPTS, max_new_tokens=8, ignore_eos=True)
    assert [o.token_ids for o in again] == [o.token_ids for o in ref]
    with pytest.raises(RequestError, match="ended by a later generate"):
        next(stream)
    assert not base._built.engine.busy


def test_generate_with_structured_output(base: xspec.LLM) -> None:
    """``response_format`` / ``structured_outputs`` constrain every prompt's output; a
    grammar that does not compile and ignore_eos with a grammar are RequestErrors."""
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["a", "b"]}, "n": {"type": "integer", "maximum": 9}},
        "required": ["k", "n"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    outs = base.generate(["ab", [5, 6, 7]], max_new_tokens=30, response_format=fmt)
    for g in outs:
        assert g.finish_reason == "stop", g.text
        obj = json.loads(g.text)
        assert obj["k"] in ("a", "b") and 0 <= obj["n"] <= 9 and list(obj) == ["k", "n"]
    sampled = base.generate("x", 12, temperature=1.0, structured_outputs={"regex": "[xy]{3}"})
    assert sampled[0].text in {a + b + c for a in "xy" for b in "xy" for c in "xy"}
    with pytest.raises(RequestError, match="unclosed character class"):
        base.generate("x", structured_outputs={"regex": "[0-9"})
    with pytest.raises(RequestError, match="ignore_eos cannot go with structured output"):
        base.generate("x", ignore_eos=True, structured_outputs={"choice": ["a"]})
    with pytest.raises(RequestError, match="min_tokens cannot go with structured output"):
        base.generate("x", min_tokens=2, structured_outputs={"choice": ["a"]})


def test_n_choices_share_one_prefill(base: xspec.LLM) -> None:
    """``n=3``: three generations per prompt (prompt-major), the prompts prefilled once
    each, request k seeded seed + k; greedy choices all equal the single request."""
    outs = base.generate(
        PROMPTS[:2], max_new_tokens=6, temperature=0.9, seed=4, ignore_eos=True, n=3
    )
    assert [o.prompt_ids for o in outs] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert base.engine.prompt_tokens_computed == len(PROMPTS[0]) + len(PROMPTS[1])
    assert len({tuple(o.token_ids) for o in outs[:3]}) == 3
    greedy = base.generate(PROMPTS[1], max_new_tokens=6, ignore_eos=True, n=3)
    single = base.generate(PROMPTS[1], max_new_tokens=6, ignore_eos=True)[0]
    assert all(g.token_ids == single.token_ids for g in greedy)
    rids = {d.rid for d in base.generate(PROMPTS[:2], 3, ignore_eos=True, n=2, stream=True)}
    assert rids == {0, 1, 2, 3}
    with pytest.raises(RequestError, match="n must be an integer >= 1"):
        base.generate("x", n=0)
