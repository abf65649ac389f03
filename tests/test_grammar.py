"""xspec.grammar: specs checked, grammars compiled once per tokenizer, and the masks a
speculative step reads along a draft path equal the masks of the committed path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from xspec.errors import RequestError
from xspec.grammar import CACHE_SIZE, MAX_SPEC_CHARS, GrammarCompiler, GrammarSpec, request_spec
from xspec.json_schema import SAFE_INTEGER, compact_schema
from xspec.tokenizer import ByteTokenizer, load_tokenizer

TINY = Path(__file__).resolve().parents[1] / "xspec" / "assets" / "dsv4_tiny"
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def byte() -> GrammarCompiler:
    return GrammarCompiler(ByteTokenizer(512, 0, [1, 2]), 512)


@pytest.fixture(scope="module")
def bpe() -> GrammarCompiler:
    return GrammarCompiler(load_tokenizer(TINY, 1024, 0, 1), 1024)


def _walk(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, steps: int = 40) -> list[int]:
    """Tokens drawn uniformly from each mask until a stop token or ``steps``."""
    g = torch.Generator().manual_seed(seed)
    c, out = compiler.compile(spec).constraint(), []
    for _ in range(steps):
        allowed = c.allowed().nonzero().flatten()
        token = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
        c.commit([token])
        out.append(token)
        if token in compiler.tokenizer.stop_ids:
            break
    return out


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_path_masks_are_the_committed_paths_masks(
    which: str, request: pytest.FixtureRequest
) -> None:
    compiler: GrammarCompiler = request.getfixturevalue(which)
    spec = GrammarSpec.json_schema(SCHEMA)
    for seed in range(4):
        path = _walk(compiler, spec, seed)
        c = compiler.compile(spec).constraint()
        before = c.allowed()
        masks = c.path_masks(path[:-1])
        assert torch.equal(c.allowed(), before)  # the matcher ends where it started
        fresh = compiler.compile(spec).constraint()
        for j in range(len(path)):
            assert torch.equal(masks[j], fresh.allowed()), (seed, j)
            assert masks[j, path[j]]
            fresh.commit([path[j]])


def test_a_forbidden_draft_ends_the_reachable_rows(byte: GrammarCompiler) -> None:
    tok = byte.tokenizer
    c = byte.compile(GrammarSpec.regex("[0-9]{3}-ok")).constraint()
    drafts = tok.encode("12x-ok")  # 'x' is forbidden at row 2
    masks = c.path_masks(drafts)
    assert masks[0, drafts[0]] and masks[1, drafts[1]] and not masks[2, drafts[2]]
    assert all(torch.equal(masks[j], masks[2]) for j in range(3, len(drafts) + 1))
    assert torch.equal(c.allowed(), masks[0])
    assert c.path_masks([10_000])[1].equal(masks[0])  # an id outside the vocabulary too


def test_samples_under_the_mask_satisfy_the_grammar(byte: GrammarCompiler) -> None:
    tok = byte.tokenizer
    for seed in range(8):
        obj = json.loads(
            tok.decode(
                [
                    t
                    for t in _walk(byte, GrammarSpec.json_schema(SCHEMA), seed, 200)
                    if t not in tok.stop_ids
                ]
            )
        )
        assert list(obj) == ["name", "age"] and isinstance(obj["age"], int)
        text = tok.decode(_walk(byte, GrammarSpec.regex("(ab|cd)[0-9]{2}"), seed))
        assert re.fullmatch("(ab|cd)[0-9]{2}", text), text
        assert tok.decode(_walk(byte, GrammarSpec.choice(["yes", "no", "maybe"]), seed)) in {
            "yes",
            "no",
            "maybe",
        }
        out = tok.decode(_walk(byte, GrammarSpec.grammar('root ::= "x" [0-9]+ "y"'), seed, 12))
        assert re.fullmatch("x[0-9]+y?", out), out
    assert json.loads(tok.decode(_walk(byte, GrammarSpec.json_object(), 0, 400)[:-1])) is not None


def _accepts(compiler: GrammarCompiler, schema: dict, text: str) -> bool:
    """Whether ``text`` (then a stop token) is a whole output under ``schema``."""
    c = compiler.compile(GrammarSpec.json_schema(schema)).constraint()
    for t in compiler.tokenizer.encode(text):
        if not c.allowed()[t]:
            return False
        c.commit([t])
    return bool(c.allowed()[1])


def test_schemas_compile_closed_and_bounded(byte: GrammarCompiler) -> None:
    item = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/item"}}},
        "$defs": {"item": item},
    }
    closed = compact_schema(schema)
    assert closed["additionalProperties"] is False and "additionalProperties" not in schema
    got = closed["$defs"]["item"]
    assert got["additionalProperties"] is False
    assert got["properties"]["x"] == {
        "type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER
    }  # fmt: skip
    assert _accepts(byte, schema, '{"items": [{"x": 1}]}')
    assert not _accepts(byte, schema, '{"items": [{"x": 1, "y": 2}]}')  # not listed
    assert not _accepts(byte, schema, '{"items": [], "z": 0}')
    assert not _accepts(byte, schema, '{"items": [{"x": 90071992547409910}]}')  # > 2**53 - 1
    number = {"type": "number", "maximum": 10}
    assert compact_schema(number) == number | {"minimum": -SAFE_INTEGER, "multipleOf": 1e-9}
    for text, ok in [
        ("2.5", True),
        ("-0.123456789", True),
        ("0.1234567891", False),
        ("1e1", False),
    ]:
        assert _accepts(byte, number, text) is ok, text
    open_map = {
        "type": "object",
        "properties": {"a": {}},
        "additionalProperties": {"type": "string"},
    }
    assert _accepts(byte, open_map, '{"a": 1, "b": "c"}')  # given: kept


def test_forced_tokens_and_the_end(byte: GrammarCompiler) -> None:
    tok = byte.tokenizer
    c = byte.compile(GrammarSpec.regex("[0-9]{3}-ok")).constraint()
    assert c.forced(4) == []  # a digit: a choice, nothing forced
    c.commit(tok.encode("123"))
    assert tok.decode(c.forced(8)) == "-ok" and c.forced(2) == tok.encode("-o")
    assert c.forced(0) == []
    c.commit(tok.encode("-ok"))
    assert c.finished and set(c.allowed().nonzero().flatten().tolist()) == {1, 2}
    masks = c.path_masks([2, 1, 5])  # drafts past the end: rows never sampled
    assert all(set(m.nonzero().flatten().tolist()) == {1, 2} for m in masks)
    assert c.finished and c.error is None  # the matcher is where it was
    c.commit([2])  # the stop token that ends it
    assert c.error is None


def test_a_stop_token_drafted_where_the_grammar_may_end(byte: GrammarCompiler) -> None:
    """``ab+`` after ``ab`` may end or go on: a drafted stop token ends the walk, the
    matcher keeps every committed token (its rollback history counts no stop)."""
    tok = byte.tokenizer
    c = byte.compile(GrammarSpec.regex("ab+")).constraint()
    c.commit(tok.encode("ab"))
    before = c.allowed()
    assert set(before.nonzero().flatten().tolist()) == {1, 2, *tok.encode("b")}
    masks = c.path_masks([2, 1])
    assert torch.equal(masks[1], before) and torch.equal(masks[2], before)
    assert torch.equal(c.allowed(), before) and not c.finished
    c.commit([*tok.encode("b"), 2])
    assert c.error is None


def test_compiled_once_and_evicted_least_recent_first(byte: GrammarCompiler) -> None:
    spec = GrammarSpec.regex("a+")
    assert byte.compile(spec) is byte.compile(GrammarSpec.regex("a+"))
    for i in range(CACHE_SIZE):
        byte.compile(GrammarSpec.regex(f"b{i}"))
    assert spec not in byte._cache
    a, b = byte.compile(spec).constraint(), byte.compile(spec).constraint()
    a.commit(byte.tokenizer.encode("aa"))
    assert not torch.equal(a.allowed(), b.allowed())  # requests do not share a matcher


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda: GrammarSpec.json_schema([1]), "must be a JSON Schema object, got list"),
        (lambda: GrammarSpec.regex(""), "regex must be a non-empty string"),
        (lambda: GrammarSpec.regex(None), "got null"),
        (lambda: GrammarSpec.choice([]), "non-empty list of non-empty strings"),
        (lambda: GrammarSpec.choice(["a", 1]), "non-empty list of non-empty strings"),
        (lambda: GrammarSpec.grammar("  "), "non-empty Lark or GBNF"),
        (lambda: GrammarSpec.regex("a" * (MAX_SPEC_CHARS + 1)), "at most 1,048,576"),
    ],
)
def test_bad_specs_are_request_errors(make, needle: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RequestError, match=re.escape(needle)):
        make()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (GrammarSpec.regex("[0-9"), "unclosed character class"),
        (
            GrammarSpec.json_schema({"type": "nonsense"}),
            "json_schema: the grammar cannot be compiled",
        ),
        (GrammarSpec.grammar("root ::= undefined_rule"), "grammar"),
    ],
)
def test_grammars_that_do_not_compile_are_request_errors(
    byte: GrammarCompiler, spec: GrammarSpec, needle: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(needle)):
        byte.compile(spec)


def test_a_model_without_a_stop_token_cannot_be_constrained() -> None:
    with pytest.raises(RequestError, match="needs a stop token"):
        GrammarCompiler(ByteTokenizer(512, 0, []), 512).compile(GrammarSpec.json_object())


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, GrammarSpec.json_object()),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
            GrammarSpec.json_schema(SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, GrammarSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, GrammarSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "a+"}}, GrammarSpec.regex("a+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, GrammarSpec.choice(["a", "b"])),
        ({"structured_outputs": {"grammar": 'root ::= "a"'}}, GrammarSpec.grammar('root ::= "a"')),
        ({"structured_outputs": {"json_object": True}}, GrammarSpec.json_object()),
        ({"structured_outputs": {}}, None),
    ],
)  # fmt: skip
def test_request_fields_to_specs(kwargs: dict, expected: GrammarSpec | None) -> None:
    assert request_spec(**kwargs) == expected


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type='yaml'"),
        ({"response_format": "json"}, "response_format must be an object"),
        ({"response_format": {"type": "json_schema"}}, "must be an object with a 'schema'"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}, "response_format.json_schema.schema must be a JSON Schema object"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "sets regex and choice; set exactly one"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml is not supported"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json is a string that is not a JSON Schema"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "not both"),
    ],
)  # fmt: skip
def test_bad_request_fields_name_the_field(kwargs: dict, needle: str) -> None:
    with pytest.raises(RequestError, match=re.escape(needle)):
        request_spec(**kwargs)


def test_forced_tokens_can_be_turned_off() -> None:
    """``spec.forced_tokens=false``: the constraint offers no forced tokens (masks alike)."""
    tok = ByteTokenizer(512, 0, [1, 2])
    on = GrammarCompiler(tok, 512).compile(GrammarSpec.regex("[0-9]{3}-ok")).constraint()
    off = GrammarCompiler(tok, 512, forced_tokens=False).compile(GrammarSpec.regex("[0-9]{3}-ok"))
    c = off.constraint()
    for x in (on, c):
        x.commit(tok.encode("123"))
    assert on.forced(8) == tok.encode("-ok") and c.forced(8) == []
    assert torch.equal(on.allowed(), c.allowed())


def _follows(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    """Whether ``text`` (then a stop token) is a whole output under ``spec``."""
    c = compiler.compile(spec).constraint()
    for t in compiler.tokenizer.encode(text, False):
        if not c.allowed()[t]:
            return False
        c.commit([t])
    return bool(c.allowed()[1])


@pytest.mark.parametrize("which", ["byte", "bpe"])
def test_a_grammar_after_the_reasoning(which: str, request: pytest.FixtureRequest) -> None:
    compiler: GrammarCompiler = request.getfixturevalue(which)
    answers = {
        GrammarSpec.json_schema(SCHEMA): '{"name": "ab", "age": 3}',
        GrammarSpec.json_object(): '{"k": [1]}',
        GrammarSpec.regex("[0-9]{3}-ok"): "123-ok",
        GrammarSpec.choice(["yes", "no"]): "no",
        GrammarSpec.grammar('root ::= "x" [0-9]+ "y"'): "x12y",
    }
    for spec, answer in answers.items():
        opened = spec.after_reasoning()  # DeepSeek-V4: the prompt opened <think>
        assert _follows(compiler, opened, "a < b, so</think>" + answer)
        assert _follows(compiler, opened, "</think>" + answer)  # empty reasoning
        assert not _follows(compiler, opened, answer)  # the reasoning is not skipped
        assert not _follows(compiler, opened, "x</think>y</think>" + answer)  # the first ends it
        assert not _follows(compiler, opened, "ok</think>" + answer + "!")
        written = spec.after_reasoning(opened=False)  # Qwen3 writes <think> itself
        assert _follows(compiler, written, "<think>\nhm\n</think>\n\n" + answer)
        assert not _follows(compiler, written, "hm</think>" + answer)
        bounded = spec.after_reasoning(max_chars=5)
        assert _follows(compiler, bounded, "12345</think>" + answer)
        assert not _follows(compiler, bounded, "123456</think>" + answer)
        c = compiler.compile(bounded).constraint()
        c.commit(compiler.tokenizer.encode("12345", False))  # the bound reached: </think> forced
        assert compiler.tokenizer.decode(c.forced(32)).startswith("</think>")
    assert GrammarSpec.regex("a").after_reasoning() != GrammarSpec.regex("a")  # cached apart
    with pytest.raises(RequestError, match="reasoning bound"):
        GrammarSpec.regex("a").after_reasoning(max_chars=-1)
