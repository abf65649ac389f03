"""Call grammars: every output a random walk under the mask produces parses back into
calls of the offered functions whose arguments validate against their schemas (DSML and
Qwen3's format, byte and BPE vocabularies); auto admits text or text then calls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from xspec.chat import DEEPSEEK_V4, PLAIN, PLAIN_HERMES
from xspec.chat.tool_grammar import plan_tools, tool_grammar
from xspec.chat.tools import DSML, HERMES, ToolFormat, check_tool_choice, check_tools
from xspec.errors import RequestError
from xspec.grammar import GrammarCompiler, GrammarSpec
from xspec.tokenizer import ByteTokenizer, load_tokenizer

TINY = Path(__file__).resolve().parents[2] / "xspec" / "assets" / "dsv4_tiny"
BOOK = {
    "type": "object",
    "properties": {
        "room": {"enum": ["red", "blue"]},
        "guests": {"type": "integer", "minimum": 1, "maximum": 9},
        "code": {"type": "string", "maxLength": 3},
        "late": {"type": "boolean"},
        "extras": {"type": "array", "items": {"enum": ["tea", "cake"]}, "maxItems": 2},
        "who": {
            "type": "object",
            "properties": {"vip": {"type": "boolean"}},
            "required": ["vip"],
            "additionalProperties": False,
        },
    },
    "required": ["room", "guests"],
    "additionalProperties": False,
}
TOOLS = check_tools([
    {"type": "function", "function": {"name": "book", "parameters": BOOK}},
    {"type": "function", "function": {"name": "ping"}},
    {"type": "function", "function": {"name": "say", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
])  # fmt: skip
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {}) for t in TOOLS}


def valid(value: Any, schema: dict[str, Any]) -> bool:
    """The JSON Schema features the tests use."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "integer":
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and schema.get("minimum", value) <= value <= schema.get("maximum", value)
        )
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(valid(v, schema["items"]) for v in value)
        )
    if kind == "object":
        props = schema.get("properties", {})
        return (
            isinstance(value, dict)
            and all(k in value for k in schema.get("required", []))
            and all(valid(v, props[k]) for k, v in value.items() if k in props)
            and (schema.get("additionalProperties", True) is not False or set(value) <= set(props))
        )
    return True


@pytest.fixture(scope="module", params=["byte", "bpe"])
def compiler(request: pytest.FixtureRequest) -> GrammarCompiler:
    if request.param == "byte":
        return GrammarCompiler(ByteTokenizer(512, 0, [1, 2]), 512)
    return GrammarCompiler(load_tokenizer(TINY, 1024, 0, 1), 1024)


def walk(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, steps: int = 1500) -> str | None:
    """The text of a uniform random walk under the mask; None if it did not end."""
    g = torch.Generator().manual_seed(seed)
    c, out = compiler.compile(spec).constraint(), []
    for _ in range(steps):
        allowed = c.allowed().nonzero().flatten()
        token = int(allowed[torch.randint(len(allowed), (1,), generator=g)])
        if token in compiler.tokenizer.stop_ids:
            return compiler.tokenizer.decode(out)
        c.commit([token])
        out.append(token)
    return None


def accepts(compiler: GrammarCompiler, spec: GrammarSpec, text: str) -> bool:
    tok = compiler.tokenizer
    ids = tok.encode(text)
    if tok.bos_id is not None and ids[:1] == [tok.bos_id]:
        ids = ids[1:]
    c = compiler.compile(spec).constraint()
    for t in ids:
        if not c.allowed()[t]:
            return False
        c.commit([t])
    return bool(c.allowed()[min(tok.stop_ids)])


@pytest.mark.parametrize("fmt", [DSML, HERMES], ids=lambda f: f.name)
@pytest.mark.parametrize("choice", ["required", "book", "ping"])
def test_walks_under_the_call_grammar_parse_into_valid_calls(
    compiler: GrammarCompiler, fmt: ToolFormat, choice: str
) -> None:
    named = {"type": "function", "function": {"name": choice}}
    spec = tool_grammar(
        fmt,
        TOOLS[:2],
        check_tool_choice(choice if choice == "required" else named, TOOLS[:2]),
        parallel=False,  # a uniform walk would keep adding calls
    )
    assert spec is not None
    ended = 0
    for seed in range(6):
        text = walk(compiler, spec, seed)
        if text is None:  # the walk may wander in a long value; most end
            continue
        ended += 1
        parsed = fmt.parse(text, TOOLS)
        assert parsed.content == "" and parsed.tool_calls, text
        for call in parsed.tool_calls:
            assert choice == "required" or call.name == choice
            assert valid(json.loads(call.arguments), SCHEMAS[call.name]), text
    assert ended >= 4


@pytest.mark.parametrize("fmt", [DSML, HERMES], ids=lambda f: f.name)
def test_what_the_grammars_admit(compiler: GrammarCompiler, fmt: ToolFormat) -> None:
    def call(name: str, args: dict[str, Any]) -> str:
        return fmt.render_calls([{"function": {"name": name, "arguments": json.dumps(args)}}], "m")

    say = call("say", {"text": "a </b> <c>\n"})  # a plain string is written as is
    two = fmt.render_calls(
        [{"function": {"name": "ping"}}, {"function": {"name": "book", "arguments": '{"room": "red", "guests": 2}'}}],
        "m",
    )  # fmt: skip
    required = tool_grammar(fmt, TOOLS, check_tool_choice("required", TOOLS))
    auto = tool_grammar(fmt, TOOLS, check_tool_choice("auto", TOOLS))
    single = tool_grammar(fmt, TOOLS, check_tool_choice("required", TOOLS), parallel=False)
    assert required is not None and auto is not None and single is not None
    assert accepts(compiler, required, say) and accepts(compiler, required, two)
    assert not accepts(compiler, required, "Hello")
    assert not accepts(compiler, required, call("book", {"room": "green", "guests": 2}))
    assert not accepts(compiler, required, call("book", {"room": "red"}))  # guests required
    assert not accepts(compiler, single, two) and accepts(compiler, single, say)
    assert accepts(compiler, auto, "Hello") and accepts(compiler, auto, "Sure." + say)
    assert not accepts(compiler, auto, "Sure." + fmt.open + "oops")
    thinking = tool_grammar(fmt, TOOLS, check_tool_choice("required", TOOLS), reasoning=True)
    assert thinking is not None
    prefix = "Let me see.</think>" if fmt is DSML else "<think>\nLet me see.\n</think>\n\n"
    assert accepts(compiler, thinking, prefix + say) and not accepts(compiler, thinking, say)
    after = required.after_reasoning(opened=fmt is DSML)  # the server's composition
    assert accepts(compiler, after, prefix + say) and not accepts(compiler, after, say)
    assert tool_grammar(fmt, TOOLS, check_tool_choice("none", TOOLS)) is None
    # only declared properties, unless the schema admits others
    assert not accepts(compiler, required, call("say", {"text": "a", "x": 1}))
    assert not accepts(compiler, required, call("ping", {"x": 1}))
    if fmt is HERMES:
        open_ = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "additionalProperties": True}}}])  # fmt: skip
        spec = tool_grammar(fmt, open_, check_tool_choice("required", open_))
        assert spec is not None and accepts(compiler, spec, call("f", {"x": 1}))
    # nested objects are closed, numbers bounded, as in a response's schema
    nested = check_tools([{"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"at": {"type": "object", "properties": {
            "n": {"type": "number"}}}}}}}])  # fmt: skip
    spec = tool_grammar(fmt, nested, check_tool_choice("required", nested))
    assert spec is not None and accepts(compiler, spec, call("g", {"at": {"n": 2.5}}))
    assert not accepts(compiler, spec, call("g", {"at": {"n": 2.5, "x": 1}}))
    assert not accepts(compiler, spec, call("g", {"at": {"n": 1e300}}))


def test_dsml_needs_parameters_it_can_split() -> None:
    bad = check_tools(
        [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{}, {}]}}}]
    )
    with pytest.raises(RequestError, match=r"tools\[0\]\.function\.parameters: .*anyOf"):
        tool_grammar(DSML, bad, check_tool_choice("required", bad))
    assert tool_grammar(HERMES, bad, check_tool_choice("required", bad)) is not None


def test_plan_tools_reads_the_request_once() -> None:
    raw = [{"type": "function", "function": {"name": "ping"}}]
    plan = plan_tools(DEEPSEEK_V4, raw, "required", False)
    assert plan is not None and plan.format is DSML and plan.choice.mode == "required"
    assert plan.grammar == tool_grammar(DSML, plan.tools, plan.choice, parallel=False)
    text = DSML.render_calls([{"function": {"name": "ping"}}], "m")
    assert [c.name for c in plan.parse(text).tool_calls] == ["ping"]
    assert plan.stream().feed(text)[0]["tool_calls"][0]["function"]["name"] == "ping"
    auto = plan_tools(PLAIN_HERMES, raw)
    assert auto is not None and auto.format is HERMES and auto.choice.mode == "auto"
    assert auto.grammar is not None
    unconstrained = plan_tools(PLAIN_HERMES, raw, constrain_auto=False)
    assert unconstrained is not None and unconstrained.grammar is None
    assert plan_tools(DEEPSEEK_V4, raw, "none") is None
    assert plan_tools(DEEPSEEK_V4, None) is None and plan_tools(DEEPSEEK_V4, None, "none") is None
    for args, match in [
        ((PLAIN, raw), "has no tool-call format"),
        ((DEEPSEEK_V4, None, "required"), "has no tools"),
        ((DEEPSEEK_V4, raw, "auto", "yes"), "parallel_tool_calls must be true or false"),
        ((DEEPSEEK_V4, [{"type": "function"}]), r"tools\[0\]\.function"),
    ]:
        with pytest.raises(RequestError, match=match):
            plan_tools(*args)


@pytest.mark.slow
def test_the_tiny_model_speculating_under_the_grammar_writes_valid_calls() -> None:
    """dsv4_tiny (plain format, DSML) with MTP drafts, greedy and T=0.8: the output is one
    call of the named (or any) function, and its arguments validate."""
    import xspec
    from xspec.chat import PLAIN_DSML, chat_prompt_ids
    from xspec.engine.engine import Engine, Request
    from xspec.sampling import SamplingParams

    b = xspec.LLM(model="dsv4_tiny", spec="mtp", platform="cpu").built
    compiler = GrammarCompiler(b.tokenizer, b.target.vocab_size)
    engine = Engine(b.target, b.drafter, b.capture, stop_ids=b.tokenizer.stop_ids)
    tools = TOOLS[:2]
    messages = [{"role": "user", "content": "Book a room for two."}]
    ids = chat_prompt_ids(messages, template=PLAIN_DSML, tokenizer=b.tokenizer, tools=tools)
    choices: list[Any] = ["required", {"type": "function", "function": {"name": "book"}}]
    reqs = []
    for choice in choices:
        spec = tool_grammar(DSML, tools, check_tool_choice(choice, tools), parallel=False)
        assert spec is not None
        for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=3)):
            reqs.append(Request(ids, 300, params, grammar=compiler.compile(spec)))
    for k, gen in enumerate(engine.run(reqs, concurrency=len(reqs))):
        assert gen.error is None and gen.token_ids[-1] in b.tokenizer.stop_ids
        text = b.tokenizer.decode([t for t in gen.token_ids if t not in b.tokenizer.stop_ids])
        parsed = DSML.parse(text, tools)
        assert parsed.content == "" and len(parsed.tool_calls) == 1, text
        call = parsed.tool_calls[0]
        assert k < 2 or call.name == "book"
        assert valid(json.loads(call.arguments), SCHEMAS[call.name]), text
