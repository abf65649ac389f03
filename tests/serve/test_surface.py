"""The rest of the surface a vLLM user reaches for, through a live server: a list of
prompts (one choice each), stop_token_ids, include_stop_str_in_output, the developer
role, GET /v1/models/{id}, HEAD /health, /version, /tokenize and /detokenize, and the BOS
rule (a text prompt and its tokenizer.json ids are the same prompt)."""

from __future__ import annotations

import httpx
import pytest
from tokenizers import Tokenizer

from tests.serve.conftest import LiveServer
from xspec.version import __version__

SERVERS = [("dsv4_tiny", "mtp", {"model.dtype": "float32"})]
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n"]
N = 16


def complete(live: LiveServer, **kw: object) -> dict:
    body = {"model": live.name, "max_tokens": N, "temperature": 0} | kw
    r = httpx.post(live.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(live: LiveServer, **kw: object) -> tuple[dict[int, str], dict[int, str], dict]:
    """The text and finish reason of each choice index of a streamed completion, and usage."""
    client = live.openai()
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage: dict = {}
    for chunk in client.completions.create(
        model=live.name, max_tokens=N, temperature=0, stream=True,
        stream_options={"include_usage": True}, **kw,
    ):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_a_list_of_prompts_gives_one_choice_each(served: LiveServer) -> None:
    """lm-evaluation-harness's --batch_size 2 sends one: each choice equals that prompt
    sent alone, and usage sums them."""
    alone = [complete(served, prompt=p) for p in PROMPTS]
    ids = [served.llm.tokenizer.encode(p) for p in PROMPTS]
    for prompt in (PROMPTS, ids):
        both = complete(served, prompt=prompt)
        assert [c["index"] for c in both["choices"]] == [0, 1, 2]
        assert [c["text"] for c in both["choices"]] == [a["choices"][0]["text"] for a in alone]
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert both["usage"][key] == sum(a["usage"][key] for a in alone)
        spec = both["usage"]["spec_decode"]
        assert spec["num_drafts"] == sum(a["usage"]["spec_decode"]["num_drafts"] for a in alone)
    texts, reasons, usage = streamed(served, prompt=PROMPTS)
    assert texts == {i: a["choices"][0]["text"] for i, a in enumerate(alone)}
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert usage["completion_tokens"] == 3 * N


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_stop_token_ids_and_include_stop_str(served: LiveServer) -> None:
    tok = served.llm.tokenizer
    full = complete(served, prompt=PROMPTS[0], ignore_eos=True)["choices"][0]["text"]
    out = tok.encode(full, special=False)
    stop_id = out[4]  # a token of the greedy output
    first = out.index(stop_id)
    r = complete(served, prompt=PROMPTS[0], ignore_eos=True, stop_token_ids=[stop_id])
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == first + 1
    assert choice["text"] == tok.decode(out[:first])  # the stop id's text is not kept
    kept = complete(served, prompt=PROMPTS[0], stop_token_ids=[stop_id],
                    include_stop_str_in_output=True)["choices"][0]["text"]  # fmt: skip
    assert kept == tok.decode(out[: first + 1])
    texts, reasons, _ = streamed(
        served, prompt=PROMPTS[0], extra_body={"stop_token_ids": [stop_id]}
    )
    assert texts[0] == choice["text"] and reasons[0] == "stop"

    stop = full[6:9]
    assert stop and stop in full
    cut = full[: full.index(stop)]
    body = {"prompt": PROMPTS[0], "stop": [stop]}
    assert complete(served, **body)["choices"][0]["text"] == cut
    with_stop = complete(served, **body, include_stop_str_in_output=True)["choices"][0]["text"]
    assert with_stop == cut + stop
    texts, _, _ = streamed(
        served, prompt=PROMPTS[0], stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert texts[0] == cut + stop


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_developer_role_is_a_system_message(served: LiveServer) -> None:
    client = served.openai()
    user = {"role": "user", "content": "def add(a, b):"}
    outs = [
        client.chat.completions.create(
            model=served.name, max_tokens=N, temperature=0,
            messages=[{"role": role, "content": "You write Python."}, user],
        ).choices[0].message.content
        for role in ("system", "developer")
    ]  # fmt: skip
    assert outs[0] == outs[1]


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_models_health_and_version(served: LiveServer) -> None:
    card = served.openai().models.retrieve(served.name)
    assert card.id == served.name and card.object == "model"
    r = httpx.get(served.url + "/v1/models/nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and err["type"] == "not_found_error" and "nope" in err["message"]
    assert httpx.head(served.url + "/health").status_code == 200
    assert httpx.get(served.url + "/version").json() == {"version": __version__}


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_tokenize_and_detokenize(served: LiveServer) -> None:
    theirs = Tokenizer.from_file(str(served.llm._built.target.checkpoint_dir / "tokenizer.json"))
    text = PROMPTS[0]
    r = httpx.post(served.url + "/tokenize", json={"model": served.name, "prompt": text}).json()
    assert r == {"count": len(r["tokens"]), "max_model_len": served.ctx.max_context,
                 "tokens": theirs.encode(text).ids}  # fmt: skip
    bare = httpx.post(served.url + "/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert bare.json()["tokens"] == theirs.encode(text, add_special_tokens=False).ids
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = httpx.post(served.url + "/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == served.ctx.chat_ids(messages, {})
    back = httpx.post(served.url + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    bad = httpx.post(served.url + "/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(served.url + "/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_a_text_prompt_and_its_tokenizer_ids_are_the_same_prompt(served: LiveServer) -> None:
    """The ids Tokenizer.from_file(tokenizer.json).encode gives (what a client holding the
    checkpoint's tokenizer sends) generate what the text does: no BOS of the server's own."""
    theirs = Tokenizer.from_file(str(served.llm._built.target.checkpoint_dir / "tokenizer.json"))
    for p in PROMPTS:
        text = complete(served, prompt=p)
        ids = complete(served, prompt=theirs.encode(p).ids)
        assert ids["choices"][0]["text"] == text["choices"][0]["text"]
        assert ids["usage"]["prompt_tokens"] == text["usage"]["prompt_tokens"]


@pytest.mark.parametrize("served", SERVERS, indirect=True, ids=lambda s: s[1])
def test_continuous_usage_stats(served: LiveServer) -> None:
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it): every chunk
    carries the usage so far, growing to the final one."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    seen = []
    for chunk in served.openai().completions.create(
        model=served.name, prompt=PROMPTS[0], max_tokens=N, temperature=0, stream=True,
        stream_options=options,  # type: ignore[arg-type]
    ):  # fmt: skip
        assert chunk.usage is not None
        seen.append(chunk.usage.completion_tokens)
    assert seen == sorted(seen) and seen[-1] == N and len(seen) > 2
