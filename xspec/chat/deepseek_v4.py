"""DeepSeek-V4's chat format, written in Python from its documentation.

DeepSeek-V4 checkpoints describe their prompt format in ``encoding/README.md`` and ship a
reference implementation, ``encoding/encoding_dsv4.py``. xspec never imports or runs code
from a checkpoint: :func:`render` is written anew from that description (conversation,
thinking mode, reasoning effort, tools and DSML tool calls).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from xspec.chat.tools import DSML
from xspec.errors import RequestError

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK, END_THINK = "<think>", "</think>"
TOOL_RESULT = "<tool_result>{}</tool_result>"
# the tools section a system message ends with (the reference's text; {schemas}: one JSON
# function spec a line)
TOOLS = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can "
    'invoke tools by writing a "<{t}tool_calls>" block like the following:\n\n'
    "<{t}tool_calls>\n"
    '<{t}invoke name="$TOOL_NAME">\n'
    '<{t}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{t}parameter>\n'
    "...\n"
    "</{t}invoke>\n"
    '<{t}invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</{t}invoke>\n"
    "</{t}tool_calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other types '
    '(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.'
    "\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n{schemas}\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls.\n"
)
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


def _turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as DeepSeek-V4 turns: it has no tool role, so tool results join the user
    turn (``<tool_result>...</tool_result>`` blocks, in the order of the calls they answer),
    as do consecutive user messages; the blocks are separated by a blank line."""
    turns: list[dict[str, Any]] = []
    order: dict[Any, int] = {}  # call id -> its place in the last assistant's tool_calls
    for m in messages:
        role = m["role"]
        if role not in ("user", "tool"):
            if m.get("tool_calls"):
                order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if c.get("id")}
            turns.append(dict(m))
            continue
        if not (turns and turns[-1]["role"] == "user"):
            turns.append({"role": "user", "blocks": []})
        if role == "tool":  # (its rank among the calls, its block)
            turns[-1]["blocks"].append(
                (order.get(m.get("tool_call_id"), 0), TOOL_RESULT.format(m["content"]))
            )
        else:
            turns[-1]["blocks"].append((None, m["content"]))
    for turn in turns:
        if "blocks" in turn:  # tool results in call order, in the places results take
            blocks = turn.pop("blocks")
            results = iter(sorted((b for b in blocks if b[0] is not None), key=lambda b: b[0]))
            turn["content"] = "\n\n".join(
                next(results)[1] if r is not None else t for r, t in blocks
            )
    return turns


def render(
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    options: Mapping[str, Any] | None = None,
    tools: Sequence[dict[str, Any]] | None = None,
) -> str:
    """DeepSeek-V4's chat encoding for checked messages (:func:`xspec.chat.check_messages`)
    and tools (:func:`xspec.chat.tools.check_tools`).

    Source: the ``encoding/README.md`` of the DeepSeek-V4 checkpoints (e.g.
    huggingface.co/deepseek-ai/DeepSeek-V4-Flash) and its reference ``encode_messages``
    (``thinking_mode``, ``drop_thinking=True``), which SGLang mirrors in
    ``python/sglang/srt/entrypoints/openai/encoding_dsv4.py``. Written anew here::

        <｜begin▁of▁sentence｜>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜>
        <｜User｜>{user}<｜Assistant｜></think>                       chat mode
        <｜User｜>{user}<｜Assistant｜><think>                        thinking mode

    A user turn followed by the assistant (or ending the conversation, with
    ``add_generation_prompt``) gets ``<｜Assistant｜>`` and ``</think>``; in thinking mode
    the turns after the last user turn get ``<think>`` instead, and an assistant message
    there writes ``{reasoning_content}</think>`` before its content (earlier turns drop
    their reasoning). ``reasoning_effort="max"`` in thinking mode puts a fixed preamble
    before the first message.

    Tools: the tools section (:data:`TOOLS`, one JSON function spec a line) ends the system
    message (an empty one is put first when there is none), and with tools no turn drops
    its reasoning. An assistant's ``tool_calls`` follow its content as a DSML block; tool
    results join the next user turn (:func:`_turns`).
    """
    thinking, effort = _mode(dict(options or {}))
    turns = _turns(messages)
    if tools:
        if turns[0]["role"] != "system":
            turns.insert(0, {"role": "system", "content": ""})
        schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        section = TOOLS.format(t=DSML.TOKEN, schemas=schemas)
        turns[0] = {**turns[0], "content": turns[0]["content"] + "\n\n" + section}
    keep_all = bool(tools)  # the reference keeps every turn's reasoning when tools are given
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    parts = [BOS, EFFORT_MAX if thinking and effort == "max" else ""]
    for i, m in enumerate(turns):
        role, content = m["role"], m.get("content", "")
        if role == "system":
            parts.append(content)
        elif role == "user":
            parts.append(USER + content)
        else:  # assistant; its reasoning is kept only after the last user turn
            reasoning = m.get("reasoning_content", "") + END_THINK
            calls = (
                DSML.render_calls(m["tool_calls"], f"messages[{i}]") if m.get("tool_calls") else ""
            )
            keep = thinking and (keep_all or i > last_user)
            parts.append((reasoning if keep else "") + content + calls + EOS)
        nxt = turns[i + 1]["role"] if i + 1 < len(turns) else None
        if role == "user" and (nxt == "assistant" or (nxt is None and add_generation_prompt)):
            opens_thinking = thinking and (keep_all or i >= last_user)
            parts.append(ASSISTANT + (THINK if opens_thinking else END_THINK))
    return "".join(parts)
