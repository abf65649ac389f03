"""Chat templates (xspec/chat/): Qwen3's real Jinja template renders exactly as
transformers' apply_chat_template does, DeepSeek-V4's encoding against hand-written
strings, the plain format of the tiny presets, the sandbox, and bad messages."""

from __future__ import annotations

import json
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
    chat_prompt_ids,
    load_chat_template,
)
from xspec.chat.renderer import RenderLimits, TemplateRenderer
from xspec.errors import CheckpointError, RequestError
from xspec.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
QWEN3_TEMPLATE = (ROOT / "tests" / "fixtures" / "qwen3_chat_template.jinja").read_text()
TINY = ROOT / "xspec" / "assets" / "dsv4_tiny"
QWEN3_SPECIALS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"


def model(path: Path | None, arch: str = "qwen3") -> Any:
    """The two ModelConfig fields the loader reads."""
    return SimpleNamespace(path=None if path is None else str(path), arch=arch)


def qwen3_checkpoint(directory: Path, *, as_file: bool = False) -> ChatTemplate:
    """A Qwen3 tokenizer_config.json (or the chat_template.jinja form) and its template."""
    config = dict(QWEN3_SPECIALS)
    if as_file:
        (directory / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    else:
        config["chat_template"] = QWEN3_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return load_chat_template(model(directory), directory)


@pytest.fixture(scope="module")
def hf_qwen3() -> Any:
    """transformers' tokenizer carrying Qwen3's template and special tokens (the vocabulary
    does not matter: only the rendered strings are compared)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TINY / "tokenizer.json"),
        chat_template=QWEN3_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )


SYSTEM = {"role": "system", "content": "You are terse."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Give me a short introduction to LLMs."}],
    "system": [SYSTEM, {"role": "user", "content": "Hi"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
    ],
    "reasoning_after_last_user": [  # the last turn keeps its reasoning, earlier ones lose it
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nA"},
        {"role": "user", "content": "b"},
        {"role": "assistant", "content": "B", "reasoning_content": "new thoughts"},
    ],
    "tools": [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": '{"t": 21}'},
    ],
}


@pytest.mark.parametrize("options", [None, {"enable_thinking": False}, {"enable_thinking": True}])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen3_template_renders_as_transformers(
    tmp_path: Path, hf_qwen3: Any, name: str, options: dict | None, add_generation_prompt: bool
) -> None:
    template = qwen3_checkpoint(tmp_path)
    messages = CONVERSATIONS[name]
    ours = chat_prompt(
        messages, template=template, add_generation_prompt=add_generation_prompt, options=options
    )
    theirs = hf_qwen3.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **(options or {})
    )
    assert ours == theirs


def test_qwen3_enable_thinking_false_closes_an_empty_think_block(tmp_path: Path) -> None:
    template = qwen3_checkpoint(tmp_path)
    text = chat_prompt(
        CONVERSATIONS["system"], template=template, options={"enable_thinking": False}
    )
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_chat_template_file_form_and_text_parts(tmp_path: Path, hf_qwen3: Any) -> None:
    """chat_template.jinja (newer checkpoints) wins over tokenizer_config.json; OpenAI text
    parts render as their texts joined with a newline."""
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**QWEN3_SPECIALS, "chat_template": "{{ raise_exception('not me') }}"})
    )
    (tmp_path / "chat_template.jinja").write_text(QWEN3_TEMPLATE, encoding="utf-8")
    template = load_chat_template(model(tmp_path), tmp_path)
    assert template.source.endswith("chat_template.jinja")
    parts = [{"type": "text", "text": "line one"}, {"type": "text", "text": "line two"}]
    ours = chat_prompt([{"role": "user", "content": parts}], template=template)
    joined = [{"role": "user", "content": "line one\nline two"}]
    assert ours == hf_qwen3.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)


# ChatML written with plain tags and newlines: its output depends on trim_blocks and
# lstrip_blocks, the whitespace rules Hugging Face templates are written against
WHITESPACE_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
<|im_start|>system
Default.<|im_end|>
    {% endif %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def test_whitespace_rules_match_transformers(hf_qwen3: Any) -> None:
    template = jinja(WHITESPACE_TEMPLATE, bos_token="<s>")
    for messages in CONVERSATIONS.values():
        messages = [m for m in messages if m["role"] != "tool"]
        theirs = hf_qwen3.apply_chat_template(
            messages,
            chat_template=WHITESPACE_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
            bos_token="<s>",
        )
        assert chat_prompt(messages, template=template) == theirs


def jinja(text: str, **specials: str) -> ChatTemplate:
    return ChatTemplate(ChatFormat.jinja, "test template", text, specials)


def test_special_tokens_tojson_and_loop_controls(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>", "__type": "AddedToken"},
                "eos_token": "</s>",
                "chat_template": (
                    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}"
                    "{% continue %}{% endif %}{{ m | tojson }}{{ eos_token }}{% endfor %}"
                ),
            }
        )
    )
    template = load_chat_template(model(tmp_path), tmp_path)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    text = chat_prompt([SYSTEM, {"role": "user", "content": "<é>"}], template=template)
    assert text == '<s>{"role": "user", "content": "<é>"}</s>'  # no HTML escaping, no \\u


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{{ raise_exception('roles must alternate') }}", "refused.*roles must alternate"),
        ("{{ messages.__class__.__mro__ }}", "refused"),  # the sandbox: no dunder attributes
        ("{{ ''.__class__.__base__.__subclasses__() }}", "refused"),
        ("{% set x = messages.append(1) %}", "refused"),  # immutable: no mutation of inputs
        ("{% set ns = namespace(_x=1) %}", "refused.*underscore"),
        ("{{ cycler.__init__.__globals__ }}", "refused"),
        ("{{ messages[0].content.startswith() }}", "failed on these messages: TypeError"),
    ],
)
def test_templates_are_sandboxed_and_their_errors_are_request_errors(text: str, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        chat_prompt([{"role": "user", "content": "x"}], template=jinja(text))


def test_compiling_evaluates_nothing() -> None:
    """jinja2 folds constant expressions while compiling: a template's
    ``'a' * 200000000`` allocated 200 MB at start-up, before any request."""
    import tracemalloc

    from xspec.chat.jinja import compile_template

    tracemalloc.start()
    try:
        for text in ("{% set s = 'a' * 200000000 %}", "{{ 'a' * 200000000 }}",
                     "{{ 'a' | center(200000000) }}", "{{ '%200000000d' % 1 }}"):  # fmt: skip
            compile_template(text)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, f"compiling allocated {peak >> 20} MiB"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{% set s = 'ab' * 100000000 %}", r"'\*' would build a value of 200000000 items"),
        ("{{ [0] * 100000000 }}", "would build a value of 100000000 items"),
        ("{% set s = 'a' * 10000000 %}{{ s + s }}", r"'\+' would build a value of 20000000"),
        ("{{ '%200000000d' % 1 }}", r"'%' would build"),
        ("{{ '%*d' % (5, 1) }}", r"'\*' width"),
        ("{{ 9 ** 99999 }}", "an integer of"),
    ],
)
def test_operators_cannot_build_huge_values(text: str, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        chat_prompt([{"role": "user", "content": "x"}], template=jinja(text))


def test_the_output_stops_at_max_chars() -> None:
    text = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
    with pytest.raises(RequestError, match="wrote more than 1000 characters"):
        chat_prompt([{"role": "user", "content": "xy"}], template=jinja(text), max_chars=1000)
    small = "{{ messages[0].content * 3 }}"
    assert chat_prompt([{"role": "user", "content": "xy"}], template=jinja(small)) == "xyxyxy"


# a template that is slow, or grows a string, only for certain messages
HOSTILE = (
    "{%- if messages[0].content == 'loop' -%}{% for i in range(100000) %}"
    "{% for j in range(100000) %}{% endfor %}{% endfor %}{%- endif -%}"
    "{%- if messages[0].content == 'grow' -%}{% set ns = namespace(s='ab' * 1000000) %}"
    "{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{%- endif -%}"
    "{%- for m in messages %}[{{ m.content }}]{% endfor -%}"
)


def test_the_renderer_process_bounds_time_and_memory() -> None:
    """A render past the time limit is killed with its process; one past the memory
    limit fails in the process; either is that request's RequestError, and the next
    render works (a fresh process)."""

    def render(renderer: TemplateRenderer, content: str) -> str:
        return chat_prompt([{"role": "user", "content": content}], template=jinja(HOSTILE),
                           renderer=renderer, max_chars=100)  # fmt: skip

    for timeout_s, memory_mib, bad, match in [
        (0.5, 0, "loop", r"time limit of 0\.5 s \(server\.template_timeout_s\)"),
        (30, 128, "grow", r"out of memory.*template_memory_mib=128"),
    ]:
        renderer = TemplateRenderer(jinja(HOSTILE), RenderLimits(timeout_s, memory_mib))
        try:
            assert render(renderer, "hi") == "[hi]"
            with pytest.raises(RequestError, match=match):
                render(renderer, bad)
            assert render(renderer, "hi") == "[hi]"
        finally:
            renderer.close()
    renderer = TemplateRenderer(jinja(HOSTILE), RenderLimits())
    with pytest.raises(RequestError, match="wrote more than 100 characters"):
        render(renderer, "x" * 200)
    renderer.close()
    with pytest.raises(CheckpointError, match="cannot be used: TemplateSyntaxError"):
        TemplateRenderer(jinja("{% for %}"), RenderLimits())


@pytest.mark.parametrize(
    ("messages", "options", "match"),
    [
        ([{"role": "user", "content": "a\ud800b"}], None, r"messages\[0\] holds a lone surrogate U\+D800"),
        ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], None, "messages.0. holds a lone"),
        ([{"role": "user", "content": "ok"}], {"x": "\ud800"}, "chat_template_kwargs holds a lone"),
    ],
)  # fmt: skip
def test_text_that_is_not_unicode_is_a_request_error(
    messages: list, options: dict | None, match: str
) -> None:
    with pytest.raises(RequestError, match=match):
        chat_prompt(messages, template=PLAIN, options=options)


def test_a_template_file_linking_out_of_the_checkpoint_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.jinja"
    outside.write_text("{{ messages }}")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja is a link to .*elsewhere"):
        load_chat_template(model(ckpt), ckpt)
    # a Hugging Face cache snapshot links its files into the repository's blobs: allowed
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc123").write_text("{{ messages[0].content }}")
    snapshot = repo / "snapshots" / "rev"
    snapshot.mkdir(parents=True)
    (snapshot / "chat_template.jinja").symlink_to(repo / "blobs" / "abc123")
    assert load_chat_template(model(snapshot), snapshot).format is ChatFormat.jinja


def test_generation_tag_renders_its_body() -> None:
    text = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert chat_prompt([{"role": "user", "content": "x"}], template=jinja(text)) == "[x]"


def test_a_template_that_does_not_parse_fails_at_load(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja does not parse"):
        load_chat_template(model(tmp_path), tmp_path)


def test_named_templates_pick_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    template = load_chat_template(model(tmp_path), tmp_path)
    assert chat_prompt([{"role": "user", "content": "x"}], template=template) == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[:1]}))
    with pytest.raises(CheckpointError, match='no "default"'):
        load_chat_template(model(tmp_path), tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read"):
        load_chat_template(model(tmp_path), tmp_path)


def test_which_format_a_model_gets(tmp_path: Path) -> None:
    assert load_chat_template(model(None, "deepseek_v4"), TINY) is PLAIN_DSML  # the presets
    assert load_chat_template(model(None, "qwen3"), None) is PLAIN_HERMES
    assert load_chat_template(model(tmp_path, "deepseek_v4"), tmp_path) is DEEPSEEK_V4
    none = load_chat_template(model(tmp_path, "qwen3"), tmp_path)
    assert none.format is ChatFormat.none
    with pytest.raises(
        RequestError, match=r"no chat template.*chat_template\.jinja.*/v1/completions"
    ):
        chat_prompt([{"role": "user", "content": "x"}], template=none)


# -- DeepSeek-V4 (hand-written expected strings) --------------------------------------

DSV4_TURNS = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4.", "reasoning_content": "Simple arithmetic."},
    {"role": "user", "content": "And 3+3?"},
]


def dsv4(messages: list[dict], **kw: Any) -> str:
    return chat_prompt(messages, template=DEEPSEEK_V4, **kw)


def test_deepseek_v4_documented_example() -> None:
    """encoding/README.md's quick start: system + user in thinking mode."""
    got = dsv4(DSV4_TURNS[:2], options={"thinking": True})
    assert (
        got == BOS + "You are a helpful assistant." + USER + "What is 2+2?" + ASSISTANT + "<think>"
    )


def test_deepseek_v4_chat_mode_multi_turn() -> None:
    assert dsv4(DSV4_TURNS) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant."
        "<｜User｜>What is 2+2?<｜Assistant｜></think>4.<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜></think>"
    )
    assert dsv4(DSV4_TURNS, options={"thinking": False}) == dsv4(DSV4_TURNS)


def test_deepseek_v4_thinking_mode_drops_earlier_reasoning() -> None:
    """Before the last user message the reasoning is dropped (the turn opens with
    </think>); the new turn opens with <think>."""
    assert dsv4(DSV4_TURNS, options={"enable_thinking": True}) == (
        "<｜begin▁of▁sentence｜>You are a helpful assistant."
        "<｜User｜>What is 2+2?<｜Assistant｜></think>4.<｜end▁of▁sentence｜>"
        "<｜User｜>And 3+3?<｜Assistant｜><think>"
    )


def test_deepseek_v4_reasoning_after_the_last_user_is_kept() -> None:
    got = dsv4(DSV4_TURNS[1:3], options={"thinking": True})
    assert got == (
        "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>"
        "Simple arithmetic.</think>4.<｜end▁of▁sentence｜>"
    )


def test_deepseek_v4_no_generation_prompt_and_max_effort() -> None:
    assert dsv4(DSV4_TURNS[1:2], add_generation_prompt=False) == BOS + USER + "What is 2+2?"
    got = dsv4(DSV4_TURNS[1:2], options={"thinking": True, "reasoning_effort": "max"})
    assert got.startswith(BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n")
    assert got.endswith("is left unchecked.\n\n" + USER + "What is 2+2?" + ASSISTANT + "<think>")
    high = dsv4(DSV4_TURNS[1:2], options={"thinking": True, "reasoning_effort": "high"})
    assert high == BOS + USER + "What is 2+2?" + ASSISTANT + "<think>"  # only "max" writes
    chat = dsv4(DSV4_TURNS[1:2], options={"reasoning_effort": "max"})  # chat mode: no preamble
    assert chat == BOS + USER + "What is 2+2?" + ASSISTANT + "</think>"


@pytest.mark.parametrize(
    ("messages", "options", "match"),
    [
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}],
            None,
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not JSON text",
        ),
        (DSV4_TURNS, {"thinking": "yes"}, "thinking must be true or false"),
        (DSV4_TURNS, {"reasoning_effort": "low"}, "reasoning_effort must be"),
    ],
)
def test_deepseek_v4_refusals(messages: list[dict], options: dict | None, match: str) -> None:
    with pytest.raises(RequestError, match=match):
        dsv4(messages, options=options)


# -- the tiny presets and token ids ---------------------------------------------------


def test_plain_format_for_the_tiny_presets() -> None:
    """The embedded default: contents joined by a blank line, no role names; its tokenizer
    adds the one <|bos|> the model was trained with."""
    messages = [SYSTEM, {"role": "user", "content": "def fib(n):"}]
    assert chat_prompt(messages, template=PLAIN) == "You are terse.\n\ndef fib(n):"
    assert chat_prompt(messages, template=PLAIN, options={"enable_thinking": False}) == (
        "You are terse.\n\ndef fib(n):"
    )
    tok = load_tokenizer(TINY, 1024, 0, 1)
    ids = chat_prompt_ids(messages, template=PLAIN, tokenizer=tok)
    assert ids == tok.encode("You are terse.\n\ndef fib(n):") and ids[0] == 0
    assert ids.count(0) == 1 and tok.decode(ids) == "You are terse.\n\ndef fib(n):"


def dsv4_tokenizer(path: Path) -> HFTokenizer:
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from tokenizers.processors import TemplateProcessing

    specials = [BOS, EOS, USER, ASSISTANT, "<think>", "</think>"]
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.post_processor = TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 2)])
    tok.save(str(path))
    return HFTokenizer(path, bos_id=2, stop_ids=[3])  # ids 2.. are the specials in order


def test_one_bos_when_template_and_tokenizer_both_write_it(tmp_path: Path) -> None:
    tok = dsv4_tokenizer(tmp_path / "tokenizer.json")
    ids = chat_prompt_ids([{"role": "user", "content": "hi"}], template=DEEPSEEK_V4, tokenizer=tok)
    assert ids == [2, 4, 1, 5, 7]  # BOS <｜User｜> hi <｜Assistant｜> </think>
    assert tok.encode("hi") == [2, 1]  # while a plain prompt gets the tokenizer's BOS


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_jinja_ids_equal_transformers_tokenized_chat(tmp_path: Path, name: str) -> None:
    """Token for token as apply_chat_template(tokenize=True): the tokenizer's BOS (the tiny
    tokenizer prepends <|bos|>) is not added to a template's prompt (Qwen3 writes none)."""
    from transformers import PreTrainedTokenizerFast

    template = qwen3_checkpoint(tmp_path)
    tok = load_tokenizer(TINY, 1024, 0, 1)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(TINY / "tokenizer.json"))
    messages = CONVERSATIONS[name]
    out = hf.apply_chat_template(
        messages, chat_template=QWEN3_TEMPLATE, tokenize=True, add_generation_prompt=True
    )
    theirs = list(out["input_ids"] if hasattr(out, "keys") else out)
    assert chat_prompt_ids(messages, template=template, tokenizer=tok) == theirs
    assert theirs[0] != tok.bos_id
    byte = ByteTokenizer(300, bos_id=2, stop_ids=[3])  # adds no BOS: the text keeps its own
    text = chat_prompt([{"role": "user", "content": "hi"}], template=DEEPSEEK_V4)
    assert chat_prompt_ids([{"role": "user", "content": "hi"}], template=DEEPSEEK_V4,
                           tokenizer=byte) == byte.encode(text)  # fmt: skip


# -- bad requests ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", "messages must be a non-empty list.*got str"),
        ([], "got an empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"content": "x"}], r"messages\[0\]\.role is missing; use one of system, user"),
        ([{"role": "bot", "content": "x"}], r"messages\[0\]\.role is 'bot'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) has no content"),
        ([{"role": "user", "content": None}], r"messages\[0\] \(user\) has no content"),
        ([{"role": "user", "content": 3}], r"content must be a string or a list of text parts"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"content\[0\] is a 'image_url' part; only text parts",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 1}]}], r"\.text must be a string"),
        ([{"role": "assistant", "content": "a", "reasoning_content": 5}], "reasoning_content"),
        ([{"role": "user", "content": "x", "name": object()}], "not JSON data"),
    ],
)
def test_bad_messages_are_request_errors(messages: Any, match: str) -> None:
    for template in (PLAIN, DEEPSEEK_V4, jinja("{{ messages | length }}")):
        with pytest.raises(RequestError, match=match):
            chat_prompt(messages, template=template)


def test_assistant_tool_calls_without_content_are_allowed_and_bad_options_refused() -> None:
    msg = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert chat_prompt([msg], template=jinja("{{ messages[0] | tojson }}")) == (
        '{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}'
    )
    user = [{"role": "user", "content": "x"}]
    with pytest.raises(RequestError, match="cannot set add_generation_prompt"):
        chat_prompt(user, template=PLAIN, options={"add_generation_prompt": False})
    with pytest.raises(RequestError, match="chat_template_kwargs must be an object"):
        chat_prompt(user, template=PLAIN, options=["x"])  # type: ignore[arg-type]
