"""Tool calls in the chat formats: tools and calls rendered (DeepSeek-V4's DSML against
hand-written strings, Qwen3's template against transformers), the request's tools and
tool_choice checked, and output parsed whole and streamed, with the same result."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from xspec.chat import (
    DEEPSEEK_V4,
    PLAIN,
    PLAIN_DSML,
    PLAIN_HERMES,
    ChatFormat,
    ChatTemplate,
    chat_prompt,
    load_chat_template,
    tool_format,
)
from xspec.chat.tools import (
    DSML,
    HERMES,
    ToolCallStream,
    ToolChoice,
    ToolFormat,
    check_tool_choice,
    check_tools,
)
from xspec.errors import RequestError

ROOT = Path(__file__).resolve().parents[2]
QWEN3_TEMPLATE = (ROOT / "tests" / "fixtures" / "qwen3_chat_template.jinja").read_text()
QWEN3 = ChatTemplate(
    ChatFormat.jinja, "qwen3", QWEN3_TEMPLATE, {"eos_token": "<|im_end|>"}, "hermes"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}  # fmt: skip
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
T = "｜DSML｜"


def ids() -> Any:
    count = iter(range(100))
    return lambda: f"call_{next(count)}"


# -- rendering -------------------------------------------------------------------------


def test_deepseek_v4_renders_tools_calls_and_results() -> None:
    got = chat_prompt(ROUND_TRIP, template=DEEPSEEK_V4, tools=TOOLS)
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    system, rest = got.split("<｜User｜>", 1)
    assert system.startswith(BOS + "\n\n## Tools\n\nYou have access to a set of tools")
    assert system.endswith(
        f"### Available Tool Schemas\n\n{schema}\n\nYou MUST strictly follow the above defined "
        "tool name and parameter schemas to invoke tool calls.\n"
    )
    assert rest == (
        "Weather in Paris?<｜Assistant｜></think>Let me look.\n\n"
        f"<{T}tool_calls>\n"
        f'<{T}invoke name="get_weather">\n'
        f'<{T}parameter name="city" string="true">Paris</{T}parameter>\n'
        f'<{T}parameter name="days" string="false">2</{T}parameter>\n'
        f"</{T}invoke>\n"
        f"</{T}tool_calls>{EOS}"
        '<｜User｜><tool_result>{"temp": 21}</tool_result><｜Assistant｜></think>'
    )
    # a system message of the user's keeps its text before the tools section
    with_system = chat_prompt([{"role": "system", "content": "Be brief."}, *ROUND_TRIP[:1]],
                              template=DEEPSEEK_V4, tools=TOOLS)  # fmt: skip
    assert with_system.startswith(BOS + "Be brief.\n\n## Tools\n\n")


def test_deepseek_v4_tool_results_follow_call_order_and_keep_reasoning_with_tools() -> None:
    calls = [dict(CALL, id="a"), dict(CALL, id="b")]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "second"},
        {"role": "tool", "tool_call_id": "a", "content": "first"},
        {"role": "user", "content": "and?"},
    ]
    got = chat_prompt(messages, template=DEEPSEEK_V4, tools=TOOLS, options={"thinking": True})
    assert got.endswith(
        f"</{T}tool_calls>{EOS}<｜User｜><tool_result>first</tool_result>\n\n"
        "<tool_result>second</tool_result>\n\nand?<｜Assistant｜><think>"
    )
    assert "<｜Assistant｜><think>R</think>\n\n" in got  # tools: no turn drops its reasoning
    without = chat_prompt(messages, template=DEEPSEEK_V4, options={"thinking": True})
    assert "<｜Assistant｜></think>\n\n" in without  # before the last user turn: dropped


def test_qwen3_template_gets_the_tools_as_transformers_passes_them() -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(ROOT / "xspec" / "assets" / "dsv4_tiny" / "tokenizer.json"),
        chat_template=QWEN3_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )  # fmt: skip
    messages = [*ROUND_TRIP, {"role": "user", "content": "thanks"}]
    want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = chat_prompt(messages, template=QWEN3, tools=TOOLS)
    assert got == want
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n</tools>" in got
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in got


def test_which_tool_format_a_model_has(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_TEMPLATE}))
    qwen3 = load_chat_template(SimpleNamespace(path=str(tmp_path), arch="qwen3"), tmp_path)
    assert tool_format(qwen3) is HERMES  # the template writes <tool_call>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    other = load_chat_template(SimpleNamespace(path=str(tmp_path), arch="qwen3"), tmp_path)
    assert tool_format(other) is None
    assert tool_format(DEEPSEEK_V4) is DSML and tool_format(PLAIN) is None
    assert tool_format(PLAIN_DSML) is DSML and tool_format(PLAIN_HERMES) is HERMES


def test_the_plain_format_writes_calls_in_the_presets_format() -> None:
    """The presets see no tools; a call they made is written back as they wrote it."""
    got = chat_prompt(ROUND_TRIP, template=PLAIN_DSML, tools=TOOLS)
    assert got == "Weather in Paris?\n\nLet me look." + DSML.render_calls([CALL], "m") + (
        '\n\n{"temp": 21}'
    )
    only_calls = [ROUND_TRIP[0], {"role": "assistant", "tool_calls": [CALL]}]
    assert chat_prompt(only_calls, template=PLAIN_HERMES) == (
        "Weather in Paris?\n\n" + HERMES.render_calls([CALL], "m")
    )
    assert chat_prompt(only_calls, template=PLAIN) == "Weather in Paris?\n\n"


# -- the request -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "match"),
    [
        ([], "non-empty list"),
        ([{"type": "retrieval"}], r'tools\[0\] must be an object with "type": "function"'),
        ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\]\.function\.name"),
        ([WEATHER, WEATHER], "given twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "JSON Schema"),
    ],
)
def test_bad_tools_are_request_errors(tools: Any, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        check_tools(tools)


def test_tool_choice() -> None:
    assert check_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert check_tool_choice(None, None) == ToolChoice("none")
    assert check_tool_choice("required", TOOLS) == ToolChoice("required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert check_tool_choice(named, TOOLS) == ToolChoice("function", "get_weather")
    with pytest.raises(RequestError, match="not in tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, TOOLS)
    with pytest.raises(RequestError, match="has no tools"):
        check_tool_choice("required", None)
    with pytest.raises(RequestError, match='tool_choice must be "none"'):
        check_tool_choice("sometimes", TOOLS)


# -- parsing ---------------------------------------------------------------------------

OTHER = {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                     "arguments": '{"city": "Nice <b>"}'}}  # fmt: skip


def outputs(fmt: ToolFormat) -> dict[str, tuple[str, str, list[tuple[str, dict]]]]:
    """name -> (model output, content, calls)."""
    calls = fmt.render_calls([CALL, OTHER], "m")
    one = fmt.render_calls([CALL], "m")
    paris = ("get_weather", {"city": "Paris", "days": 2})
    nice = ("get_weather", {"city": "Nice <b>"})
    cut = calls[: calls.index("Nice") + 2]  # the second call cut off
    second = cut.rindex(DSML.invoke if fmt is DSML else HERMES.open)
    bad_json = (
        one.replace('"days": 2', '"days": 2,')
        if fmt is HERMES
        else one.replace('string="false">2', 'string="false">2,')
    )
    unknown = one.replace("get_weather", "launch")
    first = fmt.render_calls([CALL], "m")
    return {
        "text only": ("Hello <b>world</b>\n", "Hello <b>world</b>\n", []),
        "calls": (calls, "", [paris, nice]),
        "text then calls": ("Sure." + calls, "Sure.", [paris, nice]),
        "text, calls, text": ("A b " + one + "\n c d\n", "A bc d\n", [paris]),
        "cut off": ("a" + cut, "a" + cut[second:], [paris]),
        "bad json": ("x" + bad_json, "x" + bad_json.lstrip("\n"), []),
        "unknown function": (first + unknown, unknown.lstrip("\n"), [paris]),
    }


@pytest.mark.parametrize("fmt", [DSML, HERMES], ids=lambda f: f.name)
def test_parse_whole_outputs(fmt: ToolFormat) -> None:
    for name, (text, content, calls) in outputs(fmt).items():
        got = fmt.parse(text, TOOLS, ids())
        assert got.content == content, name
        assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == calls, name
        assert [c.id for c in got.tool_calls] == [f"call_{k}" for k in range(len(calls))]
    nan = fmt.render_calls([dict(CALL, function={"name": "get_weather",
                                                 "arguments": '{"days": 1}'})], "m")  # fmt: skip
    nan = nan.replace("1", "NaN")  # Python's json reads it; JSON has no NaN
    assert fmt.parse(nan, TOOLS).tool_calls == []
    # without the request's tools, any function name is a call
    assert fmt.parse(fmt.render_calls([dict(CALL, function={"name": "zz"})], "m")).tool_calls


def _stream(fmt: ToolFormat, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    stream, deltas, prev = ToolCallStream(fmt, TOOLS, ids()), [], 0
    for cut in [*cuts, len(text)]:
        deltas += stream.feed(text[prev:cut])
        prev = cut
    deltas += stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": tc.get("id"), "name": "", "arguments": ""})
            entry["name"] += tc["function"].get("name", "")
            entry["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[k] for k in sorted(calls)]


@pytest.mark.parametrize("fmt", [DSML, HERMES], ids=lambda f: f.name)
def test_streamed_deltas_add_up_to_the_whole_parse(fmt: ToolFormat) -> None:
    rng = random.Random(0)
    for name, (text, _, _) in outputs(fmt).items():
        whole = fmt.parse(text, TOOLS, ids())
        want = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
        splits = [list(range(1, len(text))), []]  # a character at a time, and all at once
        splits += [sorted(rng.sample(range(1, len(text)), min(8, len(text) - 1))) for _ in range(5)]
        for cuts in splits:
            assert _stream(fmt, text, cuts) == (whole.content, want), (name, cuts)


def test_no_part_of_a_tag_is_streamed_as_content() -> None:
    for fmt in (DSML, HERMES):
        text = "Sure." + fmt.render_calls([CALL], "m")
        stream = ToolCallStream(fmt, TOOLS, ids())
        sent = ""
        for ch in text:
            for d in stream.feed(ch):
                sent += d.get("content", "")
                assert "<" not in sent and "\n" not in sent, sent
        first = stream.finish()
        assert sent == "Sure." and not first and stream.calls[0].name == "get_weather"
    deltas = ToolCallStream(HERMES, TOOLS, ids()).feed(HERMES.render_calls([CALL], "m"))
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris", "days": 2}'}}]},
    ]  # fmt: skip
