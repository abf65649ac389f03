"""Stop strings: found across token boundaries and inside a multi-token verify step; no
token after the stop is kept; max_new_tokens still bounds everything."""

from __future__ import annotations

from functools import cache

import pytest

import xspec
from xspec.engine.engine import Engine, Request
from xspec.engine.stop import MAX_STOP_CHARS, MAX_STOP_STRINGS, StopMatcher
from xspec.errors import RequestError
from xspec.sampling import SamplingParams

# prompts whose greedy qwen3_tiny continuations vary (distinct neighbouring tokens)
PROMPTS = [
    [
        362,
        415,
        309,
        462,
        76,
        159,
        51,
        374,
        38,
        461,
        436,
        351,
        170,
        242,
        287,
        52,
        182,
        223,
        162,
        313,
    ],
    [42, 164, 449, 261, 478],
]
N = 16


@cache
def llm(spec: str) -> xspec.LLM:
    return xspec.LLM(model="qwen3_tiny", spec=spec, platform="cpu")  # oracle: gamma 3


@cache
def free_run() -> list[list[int]]:
    return [g.token_ids for g in llm("none").generate(PROMPTS, max_new_tokens=N, ignore_eos=True)]


def tagged(ids: list[int]) -> str:
    """A decoder whose text shows token boundaries: ``<5><17>``."""
    return "".join(f"<{i}>" for i in ids)


def engine(spec: str) -> Engine:
    b = llm(spec)._built
    return Engine(b.target, b.drafter, b.capture, stop_ids=frozenset(), decode=tagged)


@pytest.mark.parametrize("spec", ["none", "oracle"])
@pytest.mark.parametrize("end", [2, 6, 7])  # oracle steps commit tokens 1-4, 5-8: 6, 7 mid-step
def test_stop_string_spanning_two_tokens(spec: str, end: int) -> None:
    """The stop ``'a><b'`` straddles tokens end-1 and end: the output ends at token
    ``end`` (kept), its text before the stop; the oracle's step that accepted past it
    (4 tokens per step) loses the rest."""
    tokens = free_run()[0]
    a, b = tokens[end - 1], tokens[end]
    stop = f"{a}><{b}"
    first = next(j for j in range(1, N) if stop in tagged(tokens[: j + 1]))
    assert first == end, "the free-running output holds this pair earlier; pick another end"
    gens = engine(spec).run(
        [Request(PROMPTS[0], N, SamplingParams(), ignore_eos=True, stop=[stop])], 1
    )
    assert gens[0].token_ids == tokens[: end + 1]
    full = tagged(tokens[: end + 1])
    assert gens[0].text == full[: full.index(stop)]
    assert stop not in gens[0].text


def test_first_of_several_stops_and_max_tokens_bound() -> None:
    """Of two stop strings the earlier match wins; a stop string never reached leaves
    max_new_tokens in charge; requests in one batch stop independently."""
    t0, t1 = free_run()
    early, late = f"<{t0[3]}>", f"<{t0[9]}>"
    want = next(j for j in range(N) if early in tagged(t0[: j + 1]))
    gens = engine("oracle").run(
        [
            Request(PROMPTS[0], N, SamplingParams(), ignore_eos=True, stop=[late, early]),
            Request(PROMPTS[1], 5, SamplingParams(), ignore_eos=True, stop=["never"]),
        ],
        2,
    )
    assert gens[0].token_ids == t0[: want + 1]
    assert gens[1].token_ids == t1[:5]
    assert gens[1].text == tagged(t1[:5])


def test_api_stop_strings_with_the_tokenizer() -> None:
    """generate(stop=[...]): text cut before the stop, tokens up to the one completing it,
    the same with a speculative method (greedy output == baseline)."""
    base = llm("none").generate(PROMPTS, max_new_tokens=N, ignore_eos=True)
    tok = llm("none").tokenizer
    text = base[1].text
    stop = text[3:5]  # two characters a few tokens in
    ids = base[1].token_ids
    end = next(j for j in range(N) if stop in tok.decode(ids[: j + 1]))
    for spec in ("none", "oracle"):
        got = llm(spec).generate(PROMPTS, max_new_tokens=N, ignore_eos=True, stop=[stop])
        assert got[1].token_ids == ids[: end + 1]
        assert got[1].text == text[: text.index(stop)]
        if stop not in base[0].text:
            assert got[0].token_ids == base[0].token_ids


@pytest.mark.parametrize("bad", ["ab", [""], [3]])
def test_bad_stop_is_a_request_error(bad: object) -> None:
    with pytest.raises(RequestError, match="stop must be a list of non-empty strings"):
        llm("none").generate(PROMPTS, max_new_tokens=2, stop=bad)  # type: ignore[arg-type]


def test_stop_without_a_decoder_is_refused() -> None:
    b = llm("none")._built
    bare = Engine(b.target, b.drafter, b.capture, stop_ids=frozenset())
    with pytest.raises(RequestError, match="need a tokenizer"):
        bare.run([Request(PROMPTS[0], 4, SamplingParams(), stop=["x"])], 1)


def test_workload_stop_composes() -> None:
    from xspec.compose import compose_run

    cfg = compose_run(["workload.stop=[ab,cd]"])
    assert cfg.workload.stop == ["ab", "cd"]


def test_stop_limits_are_request_errors() -> None:
    """At most MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters each;
    more is refused before the request runs (the server's 400), the limits themselves
    are taken."""
    eng = engine("none")
    many = [f"<{i}>" for i in range(MAX_STOP_STRINGS + 1)]
    with pytest.raises(RequestError, match=rf"stop: {len(many)} stop strings; at most"):
        eng.check(Request(PROMPTS[0], 4, SamplingParams(), stop=many), "request")
    long = ["x" * (MAX_STOP_CHARS + 1)]
    with pytest.raises(RequestError, match=rf"stop: a stop string of {MAX_STOP_CHARS + 1} char"):
        eng.check(Request(PROMPTS[0], 4, SamplingParams(), stop=long), "request")
    limits = ["y" * MAX_STOP_CHARS] * MAX_STOP_STRINGS
    eng.check(Request(PROMPTS[0], 4, SamplingParams(), stop=limits), "request")


def test_stop_check_decodes_each_token_once() -> None:
    """Stop strings are looked for in each token's new text only: the ids decoded per
    token stay the same for a 4x longer output (the whole output was decoded per token
    up to the longest stop's length: O(n) per token), and the output is exact."""
    per_token = []
    for n in (16, 64):
        decoded = [0]

        def counting(ids: list[int], decoded: list[int] = decoded) -> str:
            decoded[0] += len(ids)
            return tagged(ids)

        b = llm("none")._built
        eng = Engine(b.target, b.drafter, b.capture, stop_ids=frozenset(), decode=counting)
        stop = ["never" * 40]  # 200 characters, never found
        gen = eng.run([Request(PROMPTS[0], n, SamplingParams(), ignore_eos=True, stop=stop)], 1)[0]
        assert len(gen.token_ids) == n and gen.text == tagged(gen.token_ids)
        per_token.append((decoded[0] - n) / n)  # less the final text's one decode
    assert per_token[1] <= per_token[0] * 1.25, per_token


def test_matcher_waits_for_whole_characters() -> None:
    """With a byte-level decoder a character's first bytes decode to U+FFFD; the stop
    ``'é!'`` (bytes c3 a9 21) is found once its last byte arrives, and the text before
    it is exact."""
    out = "ab cé!d".encode()
    matcher = StopMatcher(["é!", "zz"], lambda ids: bytes(ids).decode("utf-8", "replace"))
    found = [matcher.push(t) for t in out]
    end = out.index(b"!")
    assert found[:end] == [None] * end and found[end] == "ab c"
