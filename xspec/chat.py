"""Chat messages -> the prompt text a model was trained on (``/v1/chat/completions``).

One :class:`ChatTemplate` per model, chosen once by :func:`load_chat_template`; then
:func:`chat_prompt` renders each request's messages (:func:`chat_prompt_ids`: to token ids,
as transformers' ``apply_chat_template`` tokenizes them). Four formats:

* ``jinja``: the checkpoint's own template, ``chat_template.jinja`` (newer checkpoints) or
  ``tokenizer_config.json``'s ``chat_template`` (Qwen3); the file wins, as in transformers.
  A template is a stranger's code, so it runs in jinja2's ``ImmutableSandboxedEnvironment``:
  it reads the messages and cannot reach Python. It gets what Hugging Face templates expect
  (transformers' ``utils/chat_template_utils.py``): ``trim_blocks`` / ``lstrip_blocks``, the
  ``loopcontrols`` extension, ``raise_exception``, a ``tojson`` filter that does not escape
  HTML, ``strftime_now``, ``namespace``, ``dict``, the ``{% generation %}`` tag, and the
  tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as variables;
* ``deepseek_v4``: DeepSeek-V4's encoding, written here from its documentation (see
  :func:`render_deepseek_v4`) for ``deepseek_v4`` checkpoints without a Jinja template; the
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
else is a :class:`~xspec.errors.RequestError` that names the message and the key (the
server answers 400). ``options`` are the request's ``chat_template_kwargs``
(``enable_thinking`` for Qwen3; ``thinking`` / ``reasoning_effort`` for DeepSeek-V4).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xspec.errors import CheckpointError, RequestError

if TYPE_CHECKING:
    import jinja2

    from xspec.config import ModelConfig
    from xspec.tokenizer import Tokenizer

__all__ = [
    "ChatFormat",
    "ChatTemplate",
    "chat_prompt",
    "chat_prompt_ids",
    "check_messages",
    "load_chat_template",
    "render_deepseek_v4",
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


PLAIN = ChatTemplate(ChatFormat.plain, "xspec's plain format for the built-in presets")


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
    try:  # plain JSON types only: a template sees data, never a Python object's methods
        plain: dict[str, Any] = json.loads(json.dumps(out))
    except (TypeError, ValueError) as e:
        raise RequestError(f"{where} holds a value that is not JSON data ({e})") from None
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
    try:
        return dict(json.loads(json.dumps(dict(options))))
    except (TypeError, ValueError) as e:
        raise RequestError(
            f"chat_template_kwargs holds a value that is not JSON data ({e})"
        ) from None


# -- rendering -------------------------------------------------------------------------


def chat_prompt(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages``, ending with the assistant's turn header when
    ``add_generation_prompt``. Bad messages or a template that refuses them raise
    :class:`~xspec.errors.RequestError`."""
    msgs, opts = check_messages(messages), _options(options)
    if template.format is ChatFormat.jinja:
        return _render_jinja(template, msgs, add_generation_prompt, opts)
    if template.format is ChatFormat.deepseek_v4:
        return render_deepseek_v4(msgs, add_generation_prompt=add_generation_prompt, options=opts)
    if template.format is ChatFormat.plain:
        return "\n\n".join(m["content"] for m in msgs if "content" in m)
    raise RequestError(
        f"this model has no chat template ({template.source}): add a {CHAT_TEMPLATE_FILE} "
        f"or a chat_template in {TOKENIZER_CONFIG} to the checkpoint, or send the prompt to "
        "/v1/completions"
    )


def chat_prompt_ids(
    messages: list[dict[str, Any]],
    *,
    template: ChatTemplate,
    tokenizer: Tokenizer,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
) -> list[int]:
    """:func:`chat_prompt` as token ids. A Jinja or DeepSeek-V4 prompt already holds every
    special token the model expects (its BOS text too, or none: Qwen3), so the BOS id the
    tokenizer prepends to plain prompts is left off, as ``apply_chat_template`` tokenizes
    (no special tokens added). The plain format keeps it: the presets were trained with it."""
    text = chat_prompt(
        messages, template=template, add_generation_prompt=add_generation_prompt, options=options
    )
    ids = tokenizer.encode(text)
    adds_bos = tokenizer.bos_id is not None and tokenizer.encode("")[:1] == [tokenizer.bos_id]
    if template.format is not ChatFormat.plain and adds_bos:
        ids = ids[1:]  # [bos] + the text's ids: keep the text's
    return ids


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON without Jinja's HTML escaping (what chat templates are written against)."""
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    """The sandbox templates render in (built once; jinja2 is imported on first use)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` marks assistant text for training
        masks in transformers; rendering keeps its body (in a call block's scope, as there)."""

        tags = {"generation"}  # noqa: RUF012

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class SafeNamespace(Namespace):
        """``namespace()`` that refuses underscore attributes (no path to CPython internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                SafeNamespace._check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace._check(name)
            Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the underscore attribute {name!r}"
                )

    class DictMaker:
        """``dict(...)`` / ``dict.fromkeys(...)`` without handing the template the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=_strftime_now,
        namespace=SafeNamespace,
        dict=DictMaker(),
    )
    return env


@lru_cache(maxsize=8)
def _compiled(text: str) -> jinja2.Template:
    return _environment().from_string(text)


def _render_jinja(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    options: dict[str, Any],
) -> str:
    """Render as ``apply_chat_template(..., tokenize=False)`` does: special tokens, then
    the request's kwargs over them, then the messages."""
    import jinja2

    context = {
        **template.special_tokens,
        "tools": None,
        "documents": None,
        **options,
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _compiled(template.text).render(**context)
    except jinja2.TemplateError as e:  # raise_exception(...) in the template, or the sandbox
        raise RequestError(
            f"the chat template ({template.source}) refused these messages: {e}"
        ) from None
    except Exception as e:  # the template tripped on the input (a stranger's code)
        raise RequestError(
            f"the chat template ({template.source}) failed on these messages: "
            f"{type(e).__name__}: {e}"
        ) from None


# -- DeepSeek-V4 -----------------------------------------------------------------------

DSV4_BOS = "<｜begin▁of▁sentence｜>"
DSV4_EOS = "<｜end▁of▁sentence｜>"
DSV4_USER = "<｜User｜>"
DSV4_ASSISTANT = "<｜Assistant｜>"
DSV4_THINK, DSV4_END_THINK = "<think>", "</think>"
# the preamble reasoning_effort="max" puts before the first message (the reference text)
DSV4_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)
DEEPSEEK_V4 = ChatTemplate(
    ChatFormat.deepseek_v4,
    "DeepSeek-V4 encoding (built in, from the checkpoint's encoding/README.md)",
)


def _dsv4_mode(options: dict[str, Any]) -> tuple[bool, str | None]:
    """(thinking, reasoning_effort) from ``chat_template_kwargs``: ``thinking`` (or its
    alias ``enable_thinking``, as vLLM reads them; default false: chat mode) and
    ``reasoning_effort`` (null, ``"high"`` or ``"max"``; only ``"max"`` changes the prompt)."""
    thinking = options.get("thinking", options.get("enable_thinking", False))
    if not isinstance(thinking, bool):
        raise RequestError(f"chat_template_kwargs.thinking must be true or false, got {thinking!r}")
    effort = options.get("reasoning_effort")
    if effort not in (None, "high", "max"):
        raise RequestError(
            f'chat_template_kwargs.reasoning_effort must be null, "high" or "max", got {effort!r}'
        )
    return thinking, effort


def render_deepseek_v4(
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
) -> str:
    """DeepSeek-V4's chat encoding for checked messages (:func:`check_messages`).

    Source: the ``encoding/README.md`` of the DeepSeek-V4 checkpoints (e.g.
    huggingface.co/deepseek-ai/DeepSeek-V4-Flash) and its reference ``encode_messages``
    (``thinking_mode``, ``drop_thinking=True``, no tools), which SGLang mirrors in
    ``python/sglang/srt/entrypoints/openai/encoding_dsv4.py``. Written anew here::

        <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
        <｜User｜>{user}<｜Assistant｜></think>                       chat mode
        <｜User｜>{user}<｜Assistant｜><think>                        thinking mode

    A user message followed by the assistant (or ending the conversation, with
    ``add_generation_prompt``) gets ``<｜Assistant｜>`` and ``</think>``; in thinking mode
    the turns after the last user message get ``<think>`` instead, and an assistant message
    there writes ``{reasoning_content}</think>`` before its content (earlier turns drop
    their reasoning). ``reasoning_effort="max"`` in thinking mode puts a fixed preamble
    before the first message. Tool calls (DeepSeek's DSML) are not implemented: a ``tool``
    message or ``tool_calls`` is refused.
    """
    thinking, effort = _dsv4_mode(dict(options or {}))
    for i, m in enumerate(messages):
        if m["role"] == "tool" or m.get("tool_calls"):
            raise RequestError(
                f"messages[{i}]: tool calls are not supported with DeepSeek-V4's chat format "
                "in xspec (its DSML tool encoding is not implemented)"
            )
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    parts = [DSV4_BOS, DSV4_EFFORT_MAX if thinking and effort == "max" else ""]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content", "")
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(DSV4_USER + content)
        else:  # assistant; its reasoning is kept only after the last user message
            reasoning = m.get("reasoning_content", "") + DSV4_END_THINK
            parts.append((reasoning if thinking and i > last_user else "") + content + DSV4_EOS)
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role == "user" and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            opens_thinking = thinking and i >= last_user
            parts.append(DSV4_ASSISTANT + (DSV4_THINK if opens_thinking else DSV4_END_THINK))
    return "".join(parts)


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
        return PLAIN
    directory = checkpoint_dir if checkpoint_dir is not None else Path(model_cfg.path)
    config = _read_tokenizer_config(directory)
    file = directory / CHAT_TEMPLATE_FILE
    if file.is_file():
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
        _compiled(text)
    except Exception as e:  # jinja2.TemplateSyntaxError, with its line
        raise CheckpointError(f"the chat template {source} does not parse: {e}") from None
    return ChatTemplate(ChatFormat.jinja, source, text, _special_tokens(config))
