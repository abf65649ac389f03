"""DeepSeek-V4's chat format, written in Python from its documentation.

DeepSeek-V4 checkpoints describe their prompt format in ``encoding/README.md`` and ship a
reference implementation, ``encoding/encoding_dsv4.py``. xspec never imports or runs code
from a checkpoint: :func:`render` is written anew from that description (conversation,
thinking mode, reasoning effort; not DeepSeek's DSML tool calls).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from xspec.errors import RequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
# the preamble reasoning_effort="max" puts before the first message (the reference text)
EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to "
    "resolve the root cause, rigorously stress-testing your logic against all potential paths, "
    "edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate "
    "step, considered alternative, and rejected hypothesis to ensure absolutely no assumption "
    "is left unchecked.\n\n"
)


def _mode(options: dict[str, Any]) -> tuple[bool, str | None]:
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


def render(
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
) -> str:
    """DeepSeek-V4's chat encoding for checked messages (:func:`xspec.chat.check_messages`).

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
    thinking, effort = _mode(dict(options or {}))
    for i, m in enumerate(messages):
        if m["role"] == "tool" or m.get("tool_calls"):
            raise RequestError(
                f"messages[{i}]: tool calls are not supported with DeepSeek-V4's chat format "
                "in xspec (its DSML tool encoding is not implemented)"
            )
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    parts = [BOS, EFFORT_MAX if thinking and effort == "max" else ""]
    for i, m in enumerate(messages):
        role, content = m["role"], m.get("content", "")
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(USER + content)
        else:  # assistant; its reasoning is kept only after the last user message
            reasoning = m.get("reasoning_content", "") + END_THINK
            parts.append((reasoning if thinking and i > last_user else "") + content + EOS)
        nxt = messages[i + 1]["role"] if i + 1 < len(messages) else None
        if role == "user" and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            opens_thinking = thinking and i >= last_user
            parts.append(ASSISTANT + (THINK if opens_thinking else END_THINK))
    return "".join(parts)
