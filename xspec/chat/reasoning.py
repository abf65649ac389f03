"""The model's reasoning split off its reply (thinking mode).

With a thinking mode on (DeepSeek-V4's ``thinking``, Qwen3's ``enable_thinking``) a chat
reply is ``[<think>]{reasoning}</think>{content}``: DeepSeek-V4's prompt opens ``<think>``
itself, so its output starts inside the reasoning; Qwen3's model writes ``<think>`` first.
The rule here, as vLLM's ``deepseek_r1`` reasoning parser reads a reply: a leading
``<think>`` is dropped, the text before the first ``</think>`` is ``reasoning_content``,
the text after it ``content``; a reply with no ``</think>`` (cut by ``max_tokens`` while
it thought) is reasoning only, with no content.

:func:`split_reasoning` splits a whole reply; :class:`ReasoningStream` splits it piece by
piece as it streams, never releasing a part of a tag as text (a piece that may be the
start of ``</think>`` is held back until the next one tells). :func:`reasoning_opened`
says whether a prompt left the reply inside its reasoning (the grammar of a structured
reply then starts there, :meth:`xspec.grammar.GrammarSpec.after_reasoning`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from xspec.chat.tools import DSML

if TYPE_CHECKING:
    from xspec.chat import ChatTemplate

START, END = "<think>", "</think>"


def reasoning_opened(template: ChatTemplate | None, prompt: str) -> bool:
    """Whether a thinking-mode reply to ``prompt`` starts inside its reasoning: the prompt
    ends by opening ``<think>`` (DeepSeek-V4), or the model writes DSML calls (the
    DeepSeek-V4 family: the built-in presets' plain prompts follow its convention); else
    the model writes ``<think>`` itself (Qwen3)."""
    dsml = template is not None and template.tools == DSML.name
    return dsml or prompt.rstrip().endswith(START)


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str | None  # None: the reply never closed its reasoning


def split_reasoning(text: str, start: str = START, end: str = END) -> Split:
    """``text`` (a whole reply in thinking mode) as its reasoning and its content."""
    head = text.lstrip()
    if head.startswith(start):
        text = head[len(start) :]
    reasoning, found, content = text.partition(end)
    return Split(reasoning, content if found else None)


def _held(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may begin ``tag`` (a proper prefix)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """A streamed reply split as it arrives: :meth:`feed` each piece, :meth:`finish` at
    the end; each returns the (reasoning, content) text it releases. The released pieces
    add up to :func:`split_reasoning` of the whole reply."""

    def __init__(self, start: str = START, end: str = END) -> None:
        self.start, self.end = start, end
        self._state = "head"  # head: a leading start tag may come; then reasoning, content
        self._buf = ""  # text not released yet
        self.closed = False  # the reasoning ended (the end tag came)

    def feed(self, piece: str) -> tuple[str, str]:
        if self._state == "content":
            return "", piece
        self._buf += piece
        if self._state == "head":
            head = self._buf.lstrip()
            if len(head) < len(self.start) and self.start.startswith(head):
                return "", ""  # all of it may still be the start tag
            if head.startswith(self.start):
                self._buf = head[len(self.start) :]
            self._state = "reasoning"
        reasoning, found, content = self._buf.partition(self.end)
        if found:
            self._state, self._buf, self.closed = "content", "", True
            return reasoning, content
        keep = _held(self._buf, self.end)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep :]
        return out, ""

    def finish(self) -> tuple[str, str]:
        """The held text at the end of the reply: reasoning (a tag never completed)."""
        out, self._buf = self._buf, ""  # in the head: a start tag never completed
        return out, ""
