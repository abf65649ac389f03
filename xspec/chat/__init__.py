"""Chat messages -> the prompt text a model was trained on (``/v1/chat/completions``).

One :class:`ChatTemplate` per model, chosen once by :func:`load_chat_template`; then
:func:`chat_prompt` renders each request's messages (:func:`chat_prompt_ids`: to token ids,
as transformers' ``apply_chat_template`` tokenizes them). Four formats:

* ``jinja``: the checkpoint's own template, ``chat_template.jinja`` (newer checkpoints) or
  ``tokenizer_config.json``'s ``chat_template`` (Qwen3); the file wins, as in transformers.
  A template is a stranger's code: it runs in a sandbox (:mod:`xspec.chat.jinja`) with what
  Hugging Face templates expect, the tokenizer's special tokens (``bos_token``,
  ``eos_token``, ...) among its variables; the server renders it in a process of its own
  under a time and a memory limit (:mod:`xspec.chat.renderer`). A ``chat_template.jinja``
  that is a link leading out of the checkpoint directory is refused;
* ``deepseek_v4``: DeepSeek-V4's encoding, written in Python from its documentation
  (:mod:`xspec.chat.deepseek_v4`) for ``deepseek_v4`` checkpoints without a Jinja template; the
  ``encoding/`` Python folder such checkpoints ship is never imported or run;
* ``plain``: the built-in presets (``dsv4_tiny``, ``qwen3_tiny``, ...). They were trained on
  raw Python files and know no chat markers (their only specials are bos / eos / noise /
  mask), so the prompt is the messages' contents in order, separated by a blank line
  (``"\\n\\n"``), with no role names; the generation prompt adds nothing (the model
  continues the last message's text). The tokenizer adds the BOS, as for any prompt;
* ``none``: a user checkpoint with no template at all: a chat request is refused
  (:class:`~xspec.errors.RequestError` naming the files to add; completions still work).

Messages follow OpenAI's shape: a list of ``{"role", "content"}`` with role ``system``,
``user``, ``assistant`` or ``tool``; content a string or a list of text parts
``{"type": "text", "text": ...}`` (joined with ``"\\n"``, as vLLM does for string-content
templates). An assistant message may carry ``tool_calls`` instead of content; other keys
(``name``, ``tool_call_id``, ``reasoning_content``) pass through to the template. Anything
else (a lone surrogate too: it is not Unicode) is a :class:`~xspec.errors.RequestError` that
names the message and the key (the server answers 400). ``options`` are the request's ``chat_template_kwargs``
(``enable_thinking`` for Qwen3; ``thinking`` / ``reasoning_effort`` for DeepSeek-V4).
``tools`` are the request's function specs, shown by the Jinja and DeepSeek-V4 formats;
:func:`tool_format` says how the model writes calls (:mod:`xspec.chat.tools` parses them,
:mod:`xspec.chat.tool_grammar` constrains them).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.chat import jinja
from xspec.chat.deepseek_v4 import render as render_deepseek_v4
from xspec.chat.tools import DSML, FORMATS, HERMES, ToolFormat, check_tools
from xspec.errors import CheckpointError, RequestError
from xspec.paths import escapes
from xspec.tokenizer import lone_surrogate

if TYPE_CHECKING:
    from xspec.chat.renderer import TemplateRenderer
    from xspec.config import ModelConfig
    from xspec.tokenizer import Tokenizer

__all__ = [
    "PLAIN_DSML",
    "PLAIN_HERMES",
    "ChatFormat",
    "ChatTemplate",
    "chat_prompt",
    "chat_prompt_ids",
    "check_messages",
    "encode_chat_prompt",
    "load_chat_template",
    "render_deepseek_v4",
    "tool_format",
]

TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ROLES = ("system", "user", "assistant", "tool")
# the named special tokens transformers hands a template (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")  # fmt: skip
# names a message's reasoning arrives under; transformers fills the first and "thinking"
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


class ChatFormat(str, enum.Enum):
    jinja = "jinja"
    deepseek_v4 = "deepseek_v4"
    plain = "plain"
    none = "none"


@dataclass(frozen=True)
class ChatTemplate:
    """How one model's chat prompts are written. ``source`` says where the format came
    from (a file, or the built-in it is), for messages."""

    format: ChatFormat
    source: str
    text: str = ""  # the Jinja source (format jinja)
    special_tokens: dict[str, str] = field(default_factory=dict)  # Jinja variables
    tools: str = ""  # how the model writes tool calls: a FORMATS key, "" for none


PLAIN = ChatTemplate(ChatFormat.plain, "xspec's plain format for the built-in presets")
# the presets know no tools; a call grammar makes them write calls in their family's format
PLAIN_DSML = ChatTemplate(ChatFormat.plain, PLAIN.source, tools=DSML.name)
PLAIN_HERMES = ChatTemplate(ChatFormat.plain, PLAIN.source, tools=HERMES.name)
DEEPSEEK_V4 = ChatTemplate(
    ChatFormat.deepseek_v4,
    "DeepSeek-V4 encoding (built in, from the checkpoint's encoding/README.md)",
    tools=DSML.name,
)


# -- messages --------------------------------------------------------------------------


def _content_text(content: Any, where: str) -> str:
    """A string, or OpenAI text parts joined with a newline."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where}.content must be a string or a list of text parts, got "
            f"{type(content).__name__}"
        )
    texts = []
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise RequestError(
                f"{where}.content[{k}] is a {kind!r} part; only text parts "
                '{"type": "text", "text": "..."} are supported'
            )
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.content[{k}].text must be a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _message(m: Any, i: int) -> dict[str, Any]:
    """One checked message as plain JSON data, None-valued keys dropped (as transformers
    does: templates handle a missing key, not a None one)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise RequestError(
            f"{where} must be an object with role and content, got {type(m).__name__}"
        )
    role = m.get("role")
    if role not in ROLES:
        got = "missing" if role is None else repr(role)
        raise RequestError(f"{where}.role is {got}; use one of {', '.join(ROLES)}")
    out = {k: v for k, v in m.items() if v is not None}
    if "content" in out:
        out["content"] = _content_text(out["content"], where)
    elif not (role == "assistant" and out.get("tool_calls")):
        raise RequestError(f"{where} ({role}) has no content")
    reasoning = next((out[k] for k in REASONING_KEYS if k in out), None)
    if reasoning is not None:
        if not isinstance(reasoning, str):
            raise RequestError(f"{where}.reasoning_content must be a string")
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}  # as transformers
    return _json_data(out, where)


def _json_data(value: dict[str, Any], where: str) -> dict[str, Any]:
    """``value`` copied through JSON: plain data only (a template sees data, never a
    Python object's methods), and Unicode text only (no lone surrogate)."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise RequestError(f"{where} holds a value that is not JSON data ({e})") from None
    if (at := lone_surrogate(text)) is not None:
        raise RequestError(
            f"{where} holds a lone surrogate U+{ord(text[at]):04X}, which is not Unicode (a "
            "JSON \\ud800-style escape without its pair); send valid UTF-8 text"
        )
    plain: dict[str, Any] = json.loads(text)
    return plain


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's messages, checked and normalised (content as one string)."""
    if not isinstance(messages, list) or not messages:
        got = "an empty list" if isinstance(messages, list) else type(messages).__name__
        raise RequestError(
            f"messages must be a non-empty list of {{role, content}} objects, got {got}"
        )
    return [_message(m, i) for i, m in enumerate(messages)]


def _options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
        raise RequestError("chat_template_kwargs must be an object with string keys")
    reserved = sorted({"messages", "add_generation_prompt"} & set(options))
    if reserved:
        raise RequestError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    return _json_data(dict(options), "chat_template_kwargs")


# -- rendering -------------------------------------------------------------------------


def chat_prompt(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
    renderer: TemplateRenderer | None = None,
    max_chars: int = jinja.MAX_ITEMS,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for ``messages``, ending with the assistant's turn header when
    ``add_generation_prompt``. Bad messages or a template that refuses them raise
    :class:`~xspec.errors.RequestError`. A Jinja template renders through ``renderer``
    (its own process, bounded) when given, else in this process with the sandbox's caps;
    either way its output stops at ``max_chars`` characters. ``tools``: the request's
    function specs (:func:`~xspec.chat.tools.check_tools`; leave them out for
    ``tool_choice="none"``), the Jinja template's ``tools`` variable; the plain format
    does not show them (it writes assistants' calls in the preset's tool format)."""
    msgs, opts = check_messages(messages), _options(options)
    if tools:
        tools = check_tools(_json_data({"tools": tools}, "tools")["tools"])
        opts["tools"] = tools
    if template.format is ChatFormat.jinja:
        if renderer is not None:
            return renderer.render(msgs, add_generation_prompt, opts, max_chars)
        return jinja.render(
            template.text, template.source, template.special_tokens, msgs,
            add_generation_prompt, opts, max_chars,
        )  # fmt: skip
    if template.format is ChatFormat.deepseek_v4:
        return render_deepseek_v4(
            msgs, add_generation_prompt=add_generation_prompt, options=opts, tools=tools
        )
    if template.format is ChatFormat.plain:
        return "\n\n".join(_plain_part(m, i, tool_format(template)) for i, m in enumerate(msgs))
    raise RequestError(
        f"this model has no chat template ({template.source}): add a {CHAT_TEMPLATE_FILE} "
        f"or a chat_template in {TOKENIZER_CONFIG} to the checkpoint, or send the prompt to "
        "/v1/completions"
    )


def _plain_part(m: dict[str, Any], i: int, fmt: ToolFormat | None) -> str:
    """A message in the plain format: its content, then its calls as the model writes them."""
    content = m.get("content", "")
    if not (fmt and m.get("tool_calls")):
        return str(content)
    calls = fmt.render_calls(m["tool_calls"], f"messages[{i}]")
    return content + calls if content else calls.lstrip("\n")


def tool_format(template: ChatTemplate) -> ToolFormat | None:
    """How the model writes tool calls (:attr:`ChatTemplate.tools`): DeepSeek-V4's DSML,
    Qwen3's ``<tool_call>`` JSON, or None (this model has no tool format)."""
    return FORMATS.get(template.tools)


def _sniff_tools(text: str) -> str:
    """The tool format a Jinja template writes: DSML, Qwen3's tags, or none."""
    if DSML.TOKEN in text:
        return DSML.name
    return HERMES.name if HERMES.open in text else ""


def chat_prompt_ids(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """:func:`chat_prompt` as token ids. A Jinja or DeepSeek-V4 prompt already holds every
    special token the model expects (its BOS text too, or none: Qwen3), so the BOS id the
    tokenizer prepends to plain prompts is left off, as ``apply_chat_template`` tokenizes
    (no special tokens added). The plain format keeps it: the presets were trained with it."""
    text = chat_prompt(
        messages,
        template=template,
        add_generation_prompt=add_generation_prompt,
        options=options,
        tools=tools,
    )
    return encode_chat_prompt(text, template=template, tokenizer=tokenizer)


def encode_chat_prompt(text: str, *, template: ChatTemplate, tokenizer: Tokenizer) -> list[int]:
    """:func:`chat_prompt`'s text as token ids (:func:`chat_prompt_ids`' second half)."""
    return tokenizer.encode(text, special=template.format is ChatFormat.plain)


# -- loading ---------------------------------------------------------------------------


def _read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict ({} when the checkpoint has none)."""
    file = directory / TOKENIZER_CONFIG
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {file} ({e}); fix or remove the file") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return config


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The named special tokens as strings (a value may be an AddedToken object)."""
    out = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _config_template(value: Any, file: Path) -> str:
    """``chat_template``: a string, or a list of named templates (the ``default`` one)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return str(named["default"])
        raise CheckpointError(
            f"{file}: chat_template lists templates {sorted(map(str, named))} but no "
            '"default" one; name one "default"'
        )
    raise CheckpointError(f"{file}: chat_template must be a string, got {type(value).__name__}")


def load_chat_template(model_cfg: ModelConfig, checkpoint_dir: Path | None) -> ChatTemplate:
    """The chat format of a model: the built-in presets (no ``model.path``) use the plain
    format; a checkpoint its ``chat_template.jinja``, else its ``tokenizer_config.json``
    ``chat_template``, else (``model.arch=deepseek_v4``) DeepSeek-V4's encoding, else none.
    A template that does not parse is a :class:`~xspec.errors.CheckpointError` here, before
    any request."""
    if model_cfg.path is None:
        return PLAIN_DSML if model_cfg.arch == "deepseek_v4" else PLAIN_HERMES
    directory = checkpoint_dir if checkpoint_dir is not None else Path(model_cfg.path)
    config = _read_tokenizer_config(directory)
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
        if (target := escapes(directory, Path(CHAT_TEMPLATE_FILE))) is not None:
            raise CheckpointError(
                f"{file} is a link to {target}, outside the checkpoint directory; copy the "
                "template into the directory (refused: a checkpoint names only its own files)"
            )
        try:
            text, source = file.read_text(encoding="utf-8"), str(file)
        except (OSError, UnicodeDecodeError) as e:
            raise CheckpointError(f"cannot read {file} ({e})") from e
    elif config.get("chat_template") is not None:
        where = directory / TOKENIZER_CONFIG
        text, source = _config_template(config["chat_template"], where), f"{where} chat_template"
    elif model_cfg.arch == "deepseek_v4":
        return DEEPSEEK_V4
    else:
        return ChatTemplate(
            ChatFormat.none,
            f"{directory} has no {CHAT_TEMPLATE_FILE} and no chat_template in {TOKENIZER_CONFIG}",
        )
    try:
        jinja.compile_template(text)
    except Exception as e:  # jinja2.TemplateSyntaxError, with its line
        raise CheckpointError(f"the chat template {source} does not parse: {e}") from None
    return ChatTemplate(ChatFormat.jinja, source, text, _special_tokens(config), _sniff_tools(text))
